"""``requires=`` that one worker cannot build (its Python is too old for the version asked
for, say) runs on another worker that can; only when none can does the call fail, naming
each worker's reason. Each worker's ``uv`` is a stand-in on its PATH: one fails as uv
does for a package that needs a newer Python, the other "installs" a small module."""

from __future__ import annotations

import os
import sys

import pytest

from gpumesh import TaskFailed, accelerate

from ..conftest import Proc

REQUIRES = ["gm-fake-req>=3"]
#: What uv prints first when the worker's Python is too old: the reason a build failed.
REASON = "the current Python version (3.10.13) does not satisfy Python>=3.11"

FAILING_UV = f"""#!/bin/sh
cat >&2 <<'OUT'
  x No solution found when resolving dependencies:
  `-> Because {REASON} and all versions of gm-fake-req>=3 depend on Python>=3.11, we can
      conclude that gm-fake-req>=3 cannot be used.
Downloading 1
Downloading 2
Downloading 3
Downloading 4
Downloading 5
Downloading 6
OUT
exit 1
"""

#: ``uv pip install ... --target DIR REQ``: makes DIR/gm_fake_req, as an install would.
BUILDING_UV = f"""#!{sys.executable}
import os, sys
target = sys.argv[sys.argv.index("--target") + 1]
os.makedirs(os.path.join(target, "gm_fake_req"))
with open(os.path.join(target, "gm_fake_req", "__init__.py"), "w") as fh:
    fh.write("VERSION = '3.0'\\n")
"""


def _uv_dir(root, name: str, script: str):
    d = root / name
    d.mkdir()
    (d / "uv").write_text(script)
    (d / "uv").chmod(0o755)
    return d


def _join(mesh, name: str, uv_dir, envs) -> Proc:
    env = dict(mesh.env, GM_WORKER_NAME=name, GPUMESH_ENV_DIR=str(envs),
               PATH=os.pathsep.join([str(uv_dir), os.environ.get("PATH", "")]))
    before = mesh.alive()
    proc = Proc(["join", mesh.url, "--allow-installs"], env, mesh.root / f"worker-{name}.log")
    mesh.procs.append(proc)
    mesh.wait_alive(before + 1, proc)
    return proc


def _uses_it(i):
    import os as _os
    import time as _t
    _t.sleep(0.2)  # long enough that both idle workers are handed a task
    import gm_fake_req
    return i, gm_fake_req.VERSION, _os.environ["GM_WORKER_NAME"]


def test_a_requires_one_worker_cannot_build_runs_on_the_other(make_mesh, tmp_path):
    mesh = make_mesh(workers=0)
    _join(mesh, "cannot", _uv_dir(tmp_path, "failing", FAILING_UV), tmp_path / "envs-a")
    _join(mesh, "builds", _uv_dir(tmp_path, "building", BUILDING_UV), tmp_path / "envs-b")
    m = mesh.client()
    got = accelerate(m, requires=REQUIRES)(_uses_it).map(list(range(6)))
    assert got == [(i, "3.0", "builds") for i in range(6)]
    log = mesh.coordinator.output()
    tried = [ln for ln in log.splitlines() if "could not provide requires=" in ln]
    assert len(tried) == 1, log  # tried on the worker that cannot once, then never again
    assert REASON in tried[0]


def test_a_requires_no_worker_can_build_fails_naming_each_workers_reason(make_mesh, tmp_path):
    mesh = make_mesh(workers=0)
    failing = _uv_dir(tmp_path, "failing", FAILING_UV)
    _join(mesh, "one", failing, tmp_path / "envs-a")
    _join(mesh, "two", failing, tmp_path / "envs-b")
    ids = sorted(w["id"] for w in mesh.workers())
    m = mesh.client()
    with pytest.raises(TaskFailed) as e:
        accelerate(m, requires=REQUIRES)(_uses_it)(1)
    msg = str(e.value)
    assert msg.startswith("no alive worker could run this task: "), msg
    for wid in ids:  # each was tried, and each is named with uv's reason
        assert f"({wid}, Python {sys.version.split()[0]}) could not provide requires=: uv could " \
               f"not install ['gm-fake-req>=3']: x No solution found" in msg
    assert msg.count(REASON) == 2
