"""Package-aware routing: a task that fails with ModuleNotFoundError on a worker is tried
on another; when none has the module the error names it and the workers that lack it."""

from __future__ import annotations

import json
import os
from importlib import metadata

import pytest
from click.testing import CliRunner

from gpumesh import accelerate, packages
from gpumesh.cli import main

from ..conftest import Proc

MODULE = "gm_only_on_one_worker"


def _worker(mesh, name: str, extra_path=None) -> Proc:
    env = dict(mesh.env, GM_WORKER_NAME=name)
    if extra_path is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(extra_path)] + [p for p in [env.get("PYTHONPATH")] if p])
    n = len(mesh.procs)
    before = mesh.alive()
    proc = Proc(["join", mesh.url], env, mesh.root / f"worker{n}-{name}.log")
    mesh.procs.append(proc)
    mesh.wait_alive(before + 1, proc)
    return proc


@pytest.fixture
def module_dir(tmp_path):
    d = tmp_path / "only-here"
    d.mkdir()
    (d / f"{MODULE}.py").write_text("VALUE = 40\n")
    return d


def test_workers_report_python_and_packages(make_mesh):
    mesh = make_mesh(workers=1)
    (w,) = mesh.workers()
    assert w["python"].count(".") == 2
    assert w["packages"]["cloudpickle"] == metadata.version("cloudpickle")
    assert w["packages"]["gpumesh"] == metadata.version("gpumesh")


def test_a_map_needing_a_module_one_worker_lacks_completes_on_the_other(make_mesh, module_dir):
    mesh = make_mesh(workers=0)
    _worker(mesh, "has-it", module_dir)
    _worker(mesh, "lacks-it")
    ids = {w["id"] for w in mesh.workers()}
    m = mesh.client()

    @accelerate(m)
    def uses_it(i):
        import time as _t
        _t.sleep(0.2)  # long enough that both idle workers are handed a task
        import gm_only_on_one_worker as mod
        return i + mod.VALUE, os.environ["GM_WORKER_NAME"]

    got = uses_it.map(list(range(8)))
    assert got == [(i + 40, "has-it") for i in range(8)]
    log = mesh.coordinator.output()
    # the worker without it was tried (and then never again for this job)
    tried = [ln for ln in log.splitlines() if f"has no module {MODULE!r}" in ln]
    assert len(tried) == 1, log
    assert any(wid in tried[0] for wid in ids)
    # and the pool remembers it, for `gpumesh doctor`
    lacks = {w["hostname"] + w["id"]: w.get("lacks") for w in mesh.workers()}
    assert sorted(lacks.values(), key=str) == [None, [MODULE]]
    r = CliRunner().invoke(main, ["doctor", "--json"], env={
        "GPUMESH_URL": mesh.url, "GPUMESH_TOKEN": mesh.token,
        "GPUMESH_CONFIG": mesh.env["GPUMESH_CONFIG"], "NO_COLOR": None})
    checks = {c["name"]: c for c in json.loads(r.output)["checks"]}
    assert checks["pool modules"]["status"] == "warn"
    assert checks["pool modules"]["detail"].startswith(
        f"recent jobs imported modules some workers lack: {MODULE} (not on ")
    assert checks["pool modules"]["fix"].startswith("their tasks ran on the other workers")


def test_no_worker_has_the_module_names_it_and_the_workers(make_mesh):
    mesh = make_mesh(workers=2)
    ids = sorted(w["id"] for w in mesh.workers())
    m = mesh.client()

    @accelerate(m)
    def needs_it(i):
        import gm_nowhere_to_be_found  # noqa: F401
        return i

    with pytest.raises(ModuleNotFoundError) as e:
        needs_it.map([1, 2])
    assert e.value.name == "gm_nowhere_to_be_found"
    msg = str(e.value)
    assert "No module named 'gm_nowhere_to_be_found' on any worker" in msg
    for wid in ids:  # both were tried, and both are named
        assert wid in msg
    assert "lack it" in msg
    # a call without the import still runs: the exclusion is per job
    assert accelerate(m)(lambda: 7)() == 7
    # and `gpumesh doctor` does not say those tasks ran on other workers: none could
    r = CliRunner().invoke(main, ["doctor", "--json"], env={
        "GPUMESH_URL": mesh.url, "GPUMESH_TOKEN": mesh.token,
        "GPUMESH_CONFIG": mesh.env["GPUMESH_CONFIG"], "NO_COLOR": None})
    mods = {c["name"]: c for c in json.loads(r.output)["checks"]}["pool modules"]
    assert mods["detail"].startswith("recent jobs imported modules no alive worker has: "
                                     "gm_nowhere_to_be_found (not on ")
    assert mods["fix"].startswith("no alive worker can run a task that imports them: it fails "
                                  "with ModuleNotFoundError")


def test_a_value_of_a_module_only_the_worker_has_says_this_machine_lacks_it(make_mesh, tmp_path):
    # The other direction: the task runs, and its value holds an object of a module the
    # worker has and the caller lacks. The caller's error says so, not "a worker lacks it".
    d = tmp_path / "worker-only"
    d.mkdir()
    (d / "gm_worker_side_only.py").write_text("class Point:\n    def __init__(self, x):\n"
                                            "        self.x = x\n")
    mesh = make_mesh(workers=0)
    _worker(mesh, "has-it", d)
    (wid,) = [w["id"] for w in mesh.workers()]
    m = mesh.client()

    @accelerate(m)
    def make_point(i):
        import gm_worker_side_only
        return gm_worker_side_only.Point(i)

    with pytest.raises(ModuleNotFoundError) as e:
        make_point.map([1, 2])
    assert e.value.name == "gm_worker_side_only"
    text = "\n".join(getattr(e.value, "__notes__", [])) or str(e.value.__cause__)
    assert "on worker" in text and wid in text
    assert "the task returned, but this process (Python " in text
    assert "this machine lacks the module 'gm_worker_side_only'" in text
    assert "the batch's other tasks were cancelled" in text
    # The worker is not blamed: it still takes the job's work, and lacks nothing.
    assert [w.get("lacks") for w in mesh.workers()] == [None]
    assert accelerate(m)(lambda: 7)() == 7


def test_inventory_reports_a_change_only_when_due(monkeypatch):
    now = [0.0]
    state = [{"a": "1"}]
    monkeypatch.setattr(packages, "installed", lambda: dict(state[0]))
    inv = packages.Inventory(rescan_s=60, clock=lambda: now[0])
    assert inv.current == {"a": "1"}
    state[0] = {"a": "1", "b": "2"}
    now[0] = 30
    assert inv.changed() is None  # not due yet
    now[0] = 61
    assert inv.changed() == {"a": "1", "b": "2"}
    now[0] = 130
    assert inv.changed() is None  # due, but nothing changed


def test_package_sets_are_validated_and_normalised():
    assert packages.check({"Scikit_Learn": "1.4.0", "numpy": "1.26"}) == \
        {"scikit-learn": "1.4.0", "numpy": "1.26"}
    for bad in ([], {"x": 1}, {"": "1"}, {"n" * 300: "1"}):
        with pytest.raises(ValueError, match="packages"):
            packages.check(bad)


def test_a_task_only_a_paused_worker_could_still_run_waits_for_it_and_says_so(make_mesh, module_dir, capfd):
    """The open worker lacks the module (so it never runs the job again), the one that
    has it is paused by its owner: the call waits for it, says why at once (not at the
    end of its long poll), and finishes there on resume."""
    import re
    import subprocess
    import sys
    import threading
    import time

    from ..conftest import wait_for

    mesh = make_mesh(workers=0)
    has_it = _worker(mesh, "has-it", module_dir)
    # (registered before it prints so: wait for the line)
    joined = wait_for(lambda: re.search(r"joined mesh as ([0-9a-f]+)", has_it.output()), 10,
                      "the worker's joined line")
    wid = joined.group(1)
    _worker(mesh, "lacks-it")

    def owner(*args: str) -> None:
        r = subprocess.run([sys.executable, "-m", "gpumesh", *args, "--worker", wid],
                           env=dict(mesh.env, GPUMESH_URL=mesh.url), capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
    owner("pause")
    wait_for(lambda: any(w["id"] == wid and (w.get("owner") or {}).get("state") == "paused"
                         for w in mesh.workers()), 10, "the pause")
    m = mesh.client()

    @accelerate(m)
    def uses_it(i):
        import gm_only_on_one_worker as mod
        return i + mod.VALUE, os.environ["GM_WORKER_NAME"]

    got = []
    caller = threading.Thread(target=lambda: got.append(uses_it(1)), daemon=True)
    started = time.monotonic()
    caller.start()
    said = wait_for(lambda: re.search(r"job ([0-9a-f]+) is waiting: 1 worker paused by its owner",
                                      capfd.readouterr().err), 15, "the caller's notice")
    assert time.monotonic() - started < 10       # at once, not after a 20 s long poll
    assert "waiting" in m.status(said.group(1))  # and `gpumesh status` says why too
    assert caller.is_alive() and got == []
    owner("resume")
    caller.join(60)
    assert got == [(41, "has-it")]
