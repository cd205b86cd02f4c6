"""A slot's queue of grants (behind short tasks, in either isolation, with a coordinator
offering ``result_batch``): a worker that dies or is paused with queued grants loses no
task, and no task runs twice where it was queued."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpumesh import accelerate
from gpumesh.worker.poster import QUEUE_DEPTH

from ..conftest import Proc, alive, wait_for


def _recording(c, marks: str, seconds: float, isolation: str = "job"):
    @accelerate(c, isolation=isolation)
    def work(i):
        import os as _os
        import time as _t
        _t.sleep(seconds)
        with open(marks, "a") as fh:  # one line per run that got to its end
            fh.write(f"{i} {_os.environ.get('QG_ROLE', '-')}\n")
        return i * 3
    return work


def _runs(marks) -> list[tuple[int, str]]:
    """(item, which worker ran it) of every run that finished."""
    try:
        text = marks.read_text()
    except FileNotFoundError:
        return []
    return [(int(a), b) for a, b in (line.split() for line in text.splitlines())]


def _running(m, wid: str) -> int:
    return next(w for w in m.workers() if w["id"] == wid)["running"]


def _join(m, role: str) -> tuple[Proc, str]:
    """Start a one-slot worker whose tasks see ``QG_ROLE=role``; (its process, its id)."""
    before = {w["id"] for w in m.workers()}
    proc = Proc(["join", m.url, "--slots", "1"], dict(m.env, QG_ROLE=role), m.root / f"{role}.log")
    m.procs.append(proc)
    m.wait_alive(len(before) + 1, proc)
    return proc, next(w["id"] for w in m.workers() if w["id"] not in before)


@pytest.mark.parametrize("isolation", ["job", "task"])
def test_a_worker_killed_with_queued_grants_loses_no_task_and_runs_none_twice(
        fault_mesh, tmp_path, isolation):
    m = fault_mesh(workers=0)
    a, wid_a = _join(m, "a")
    _join(m, "b")
    marks = tmp_path / "runs.txt"
    out: list = []
    with closing(m.client(output=False)) as c:
        fn = _recording(c, str(marks), 0.02, isolation)  # short: the slot queues (QUEUE_TASK_S)
        th = threading.Thread(target=lambda: out.append(fn.map(range(400))), daemon=True)
        th.start()
        # a's one slot holds its running task and queued grants behind it
        wait_for(lambda: len(_runs(marks)) >= 10 and _running(m, wid_a) > 1, 60,
                 "queued grants on the worker")
        os.killpg(a.p.pid, signal.SIGKILL)  # the agent (its task processes end with it)
        a.p.wait(10)
        th.join(120)
        assert not th.is_alive(), "the map finished on the other worker"
    assert out == [[i * 3 for i in range(400)]]
    runs = _runs(marks)
    per_item = Counter(i for i, _w in runs)
    assert set(per_item) == set(range(400)), "every task ran"
    for role in ("a", "b"):
        assert max(Counter(i for i, w in runs if w == role).values(), default=0) <= 1, \
            f"worker {role} ran a task twice"
    twice = [i for i, n in per_item.items() if n > 1]
    # only results the dead worker had computed but not yet had acknowledged run again:
    # at most its running task and the queue behind it, never a queued grant it never began
    assert len(twice) <= 1 + QUEUE_DEPTH, twice


@pytest.mark.parametrize("isolation", ["job", "task"])
def test_a_pause_hands_the_queued_grants_back_and_none_runs_until_resume(
        fault_mesh, tmp_path, isolation):
    m = fault_mesh(workers=0)
    m.add_worker(slots=1)
    wid = m.workers()[0]["id"]
    marks = tmp_path / "runs.txt"
    out: list = []
    env = dict(m.env, GPUMESH_URL=m.url)

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "gpumesh", *args], env=env,
                              capture_output=True, text=True, timeout=60)

    with closing(m.client(output=False)) as c:
        fn = _recording(c, str(marks), 0.02, isolation)
        th = threading.Thread(target=lambda: out.append(fn.map(range(300))), daemon=True)
        th.start()
        wait_for(lambda: len(_runs(marks)) >= 3 and _running(m, wid) > 1, 60, "queued grants")
        said = cli("pause")
        assert said.returncode == 0, said.stderr
        # one slot: at most one task runs (and finishes); queued ones (there are most
        # likely some at this moment) go back now, and are counted apart
        assert re.search(r"no new tasks; (no task running|1 running task\(s\) finish)"
                         r"(; [1-9]\d* queued task\(s\) handed back)?$", said.stdout.strip()), \
            said.stdout
        # the running task finishes; every queued grant goes back: the worker holds nothing
        wait_for(lambda: _running(m, wid) == 0, 20, "the queued grants to be handed back")
        done = len(_runs(marks))
        job = c.jobs()[0]
        view = c.status(job["id"])
        assert 3 <= done < 300, "paused mid-map"
        assert view["counts"].get("done", 0) == done and view["counts"]["pending"] == 300 - done
        assert cli("resume").returncode == 0
        th.join(120)
        assert not th.is_alive()
        assert out == [[i * 3 for i in range(300)]]
        assert sorted(i for i, _pid in _runs(marks)) == list(range(300)), "each ran exactly once"
        assert c.status(job["id"])["counts"] == {"done": 300}


def _gated(c, marks: str, gate: str, started: str, gated: int):
    """A no-op job-mode task (a deep queue) whose item ``gated`` says which worker runs it
    and then waits for the file ``gate``."""
    @accelerate(c, isolation="job")
    def work(i):
        import os as _os
        import time as _t
        role = _os.environ.get("QG_ROLE", "-")
        if i == gated:
            with open(started, "a") as fh:
                fh.write(f"{role} {_os.getpid()}\n")
            while not _os.path.exists(gate):
                _t.sleep(0.01)
        with open(marks, "a") as fh:
            fh.write(f"{i} {role}\n")
        return i * 3
    return work


@dataclass
class _Scene:
    """A 300-task map of :func:`_gated` tasks running in ``thread``; ``box`` gets its value
    or the exception it raised."""
    thread: threading.Thread
    box: list
    marks: Path
    gate: Path
    job_id: str
    role: str       # the worker running the gated task
    task_pid: int   # its task process


def _start_gated(c, folder: Path, gated: int) -> _Scene:
    """Start the map of a :class:`_Scene` (files in ``folder``); returns once its gated
    task waits at the gate."""
    folder.mkdir(parents=True)
    marks, gate, started = folder / "runs.txt", folder / "gate", folder / "started"
    known = {j["id"] for j in c.jobs()}
    fn = _gated(c, str(marks), str(gate), str(started), gated)
    box: list = []

    def run():
        try:
            box.append(fn.map(range(300)))
        except Exception as e:  # noqa: BLE001 - a cancelled map raises
            box.append(e)
    th = threading.Thread(target=run, daemon=True)
    th.start()
    wait_for(lambda: started.exists() and started.read_text().strip(), 60, "the gated task")
    role, task_pid = started.read_text().split()[:2]
    job_id = wait_for(lambda: next((j["id"] for j in c.jobs() if j["id"] not in known), None),
                      10, "the map's job")
    return _Scene(th, box, marks, gate, job_id, role, int(task_pid))


def _gated_with_queue(c, m, wids: dict[str, str], folder: Path, gated: int,
                      settle=lambda scene: None) -> _Scene:
    """A :class:`_Scene` whose gated task's worker (one of ``wids``, role -> worker id)
    holds queued grants behind it once ``settle(scene)`` has returned.

    A slot queues grants only behind tasks that ran short (QUEUE_TASK_S): on a loaded
    machine the tasks just before the gated one may not have, and its worker then holds
    no queue. Such a map is let finish (its value checked) and the scene set again, up
    to four times; each try takes a few seconds. What a test asserts is not retried."""
    for attempt in range(4):
        scene = _start_gated(c, folder / f"try{attempt}", gated)
        settle(scene)
        # (the answer to the post before the gated task brings its queue: moments later)
        deadline = time.monotonic() + 3
        while _running(m, wids[scene.role]) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        if _running(m, wids[scene.role]) > 1:
            return scene
        scene.gate.touch()
        scene.thread.join(60)
        assert scene.box == [[i * 3 for i in range(300)]]
    pytest.fail("in 4 maps the gated task's worker never held a queue behind it")


def test_a_worker_killed_mid_batch_with_its_results_in_loses_no_task_and_runs_none_twice(
        fault_mesh, tmp_path):
    m = fault_mesh(workers=0)
    procs = dict([("a", _join(m, "a")), ("b", _join(m, "b"))])
    wids = {role: wid for role, (_proc, wid) in procs.items()}
    with closing(m.client(output=False)) as c:

        def settle(scene: _Scene):
            # the other worker ran everything it could, and every run that ended is
            # stored (none is held back in a batch)
            other = wids["b" if scene.role == "a" else "a"]

            def settled():
                counts = c.status(scene.job_id)["counts"]
                return (counts.get("pending", 0) == 0 and _running(m, other) == 0
                        and counts.get("done", 0) == len(_runs(scene.marks)))

            def seen():
                return (f"counts {c.status(scene.job_id)['counts']}, {len(_runs(scene.marks))} "
                        f"runs ended, the other worker running {_running(m, other)}")
            wait_for(settled, 60, seen)
        scene = _gated_with_queue(c, m, wids, tmp_path, 150, settle)
        proc = procs[scene.role][0]
        # Mid-batch, the agent's process group killed: its running task, which leads a
        # session of its own, goes with it (test_orphans); one that ran on would get past
        # the gate and run a second time.
        os.killpg(proc.p.pid, signal.SIGKILL)
        proc.p.wait(10)
        wait_for(lambda: not alive(scene.task_pid), 10, "the killed worker's task process to end")
        scene.gate.touch()
        scene.thread.join(120)
        assert not scene.thread.is_alive(), "the map finished on the other worker"
    assert scene.box == [[i * 3 for i in range(300)]]
    per_item = Counter(i for i, _w in _runs(scene.marks))
    assert set(per_item) == set(range(300)), "every task ran"
    assert [i for i, n in per_item.items() if n > 1] == [], "a task ran to completion twice"


def test_a_job_cancelled_mid_batch_runs_none_of_its_queued_grants_and_frees_the_slot(
        fault_mesh, tmp_path):
    m = fault_mesh(workers=0)
    _proc, wid = _join(m, "a")
    with closing(m.client(output=False)) as c:
        scene = _gated_with_queue(c, m, {"a": wid}, tmp_path, 40)
        job_id, marks, gate, th = scene.job_id, scene.marks, scene.gate, scene.thread
        ran = len(_runs(marks))
        assert c.cancel(job_id) > 1
        # the gated task is killed and every queued grant dropped: the slot is free
        wait_for(lambda: _running(m, wid) == 0, 30, "the worker to hold nothing")
        th.join(60)
        assert not th.is_alive() and isinstance(scene.box[0], Exception), "the cancelled map raised"
        gate.touch()  # (a queued grant that ran after all would get past the gate now)
        again = accelerate(c, isolation="job")(lambda i: i + 1)
        assert again.map(range(20)) == list(range(1, 21))  # the slot serves the next job
        assert len(_runs(marks)) == ran, "a cancelled task ran"
        assert c.status(job_id)["counts"].get("done", 0) == ran
