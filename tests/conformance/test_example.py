"""The main example runs unchanged on every backend: ``examples/grid_search.py`` with only
``$GPUMESH_URL`` pointing elsewhere prints, byte for byte, what a local run prints."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grid_search.py"

pytest.importorskip("numpy", reason="the example needs NumPy (the 'examples' extra)")


def _run(env_extra: dict, home: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUMESH_")}
    env.update(HOME=str(home), GPUMESH_CONFIG=str(home / "config.json"), GPUMESH_DISCOVERY="0",
               RAY_AUTH_MODE="disabled", **env_extra)
    home.mkdir(parents=True, exist_ok=True)
    return subprocess.run([sys.executable, str(EXAMPLE)], env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def local_table(tmp_path_factory) -> str:
    r = _run({"GPUMESH_LOCAL": "1"}, tmp_path_factory.mktemp("local"))
    assert r.returncode == 0, r.stderr
    assert "best:" in r.stdout and r.stdout.count("\n") > 24  # the 24-row table and its summary
    return r.stdout


def test_grid_search_prints_the_local_table_on_every_backend(backend, local_table, tmp_path):
    name, client = backend
    extra = {"GPUMESH_URL": client.url}
    if getattr(client, "token", None):
        extra["GPUMESH_TOKEN"] = client.token
    r = _run(extra, tmp_path / "home")
    assert r.returncode == 0, r.stderr
    assert "running locally" not in r.stderr, r.stderr   # it ran on the backend
    assert r.stdout == local_table
