#!/usr/bin/env bash
# gpumesh on a real NVIDIA GPU (docs/hardware.md): starts a coordinator and a worker on
# 127.0.0.1, checks detection (model, memory), GPU score above CPU score, a torch task on
# "cuda" returning a tensor (also to a CPU-only caller, and ../shared/cases/c07 when it
# exists), a gpu_memory_mb hint above the GPU's memory refused and one below accepted, a
# hint above the *free* memory held back while another process fills the GPU; prints a
# summary. Needs python3 with torch and gpumesh's dependencies.
#
#   scripts/gpu_check.sh                 gpumesh from src/, dependencies already installed
#   scripts/gpu_check.sh --wheels DIR    first install the wheels in DIR (no network used:
#                                        pip --no-index), e.g. starlette and uvicorn
#
# Exit code: 0 every check passed, 1 one failed, 2 no NVIDIA GPU on this machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [[ "${1:-}" == "--wheels" ]]; then
    site=$(mktemp -d)
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "${2:?--wheels needs a directory}"/*.whl
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" scripts/gpu_check.py
