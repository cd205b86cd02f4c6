#!/usr/bin/env bash
# Create .venv-bench (separate from .venv) with gpumesh plus the peer frameworks that
# benchmarks/run.py compares against: dask.distributed and ray.
#
#   bash benchmarks/setup_peers.sh            # gpumesh + dask[distributed] + ray
#   NO_RAY=1 bash benchmarks/setup_peers.sh   # skip ray (large download)
#   .venv-bench/bin/python benchmarks/run.py --quick
#
# ray is tried separately: when it has no wheel for this Python/platform, or its
# install fails, the script keeps dask only and says so (run.py shows ray as n/a).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV="${VENV:-.venv-bench}"

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
fi
PIP="$VENV/bin/python -m pip"

$PIP install -q -e '.[bench]' 'dask[distributed]'
echo "[setup_peers] installed gpumesh, numpy, psutil, httpx, dask[distributed]"

if [ "${NO_RAY:-0}" = "1" ]; then
    echo "[setup_peers] NO_RAY=1: skipping ray"
elif $PIP install -q ray; then
    echo "[setup_peers] installed ray"
else
    echo "[setup_peers] WARNING: 'pip install ray' failed; continuing with dask only" >&2
fi

"$VENV/bin/python" - <<'PY'
import importlib
for name in ("gpumesh", "numpy", "psutil", "distributed", "ray"):
    try:
        m = importlib.import_module(name)
        print(f"[setup_peers] {name:12s} {getattr(m, '__version__', '?')}")
    except Exception as e:  # noqa: BLE001
        print(f"[setup_peers] {name:12s} not available ({type(e).__name__})")
PY
