"""The shared scenario programs (../shared/cases) against a running mesh, as subprocesses.

Each case prints ``OK [cNN]`` and exits 0 when gpumesh behaves right; on a fault it exits
non-zero with ``FAULT [cNN]: ...`` on stderr, which the assertion shows.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

CASES = Path(__file__).resolve().parents[3] / "shared" / "cases"

if not CASES.is_dir():
    pytest.skip(f"the shared cases directory {CASES} does not exist", allow_module_level=True)

CASE_TIMEOUT_S = 120

# case file prefix -> extra environment (sizes kept light for a 2-core test machine)
SELECTED = {
    "c02": {},
    "c03": {"GPUMESH_CASE_ARRAY_MB": "64"},
    "c04": {},
    "c06": {},
    "c09": {"GPUMESH_CASE_BIG_MB": "16"},
    "c12": {"GPUMESH_CASE_LEAK_MB": "16", "GPUMESH_CASE_LEAK_N": "24"},
    "c14": {"GPUMESH_CASE_FLOOD_MB": "16"},
    "c15": {},
    "c19": {},
    "c20": {},
    "c22": {},
    "c24": {},
    "c23": {"GPUMESH_CASE_MAP_N": "2000"},
    "c25": {},
}
if os.environ.get("GPUMESH_RUNTIME") == "spawn":
    # A fresh interpreter per task (~0.1 s of CPU each): 2,000 of them on a 2-core machine
    # would take the case past its timeout, so the spawn run maps fewer items.
    SELECTED["c23"] = {"GPUMESH_CASE_MAP_N": "300"}


def case_file(prefix: str) -> Path:
    found = sorted(CASES.glob(f"{prefix}_*.py"))
    if not found:
        pytest.skip(f"no {prefix}_*.py in {CASES}")
    return found[0]


@pytest.mark.parametrize("prefix", sorted(SELECTED))
def test_case(prefix, shared_mesh, tmp_path):
    path = case_file(prefix)
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUMESH_")}
    env.update(HOME=str(home), GPUMESH_CONFIG=str(tmp_path / "config.json"),
               GPUMESH_URL=shared_mesh.url, GPUMESH_TOKEN=shared_mesh.token,
               GPUMESH_CASE_WATCHDOG_S=str(CASE_TIMEOUT_S - 10), PYTHONUNBUFFERED="1",
               **SELECTED[prefix])
    try:
        r = subprocess.run([sys.executable, str(path)], env=env, cwd=tmp_path,
                           capture_output=True, text=True, timeout=CASE_TIMEOUT_S,
                           stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{path.name} did not finish within {CASE_TIMEOUT_S}s\n"
                    f"--- stdout\n{e.stdout}\n--- stderr\n{e.stderr}")
    report = f"{path.name} exited {r.returncode}\n--- stdout\n{r.stdout}\n--- stderr\n{r.stderr}"
    assert r.returncode == 0, report
    assert f"OK [{prefix}]" in r.stdout, report
    assert "FAULT" not in r.stderr, report
