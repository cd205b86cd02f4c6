"""``isolation="job"`` on the fork runtime: a slot keeps the forked task process of its
job's last task (a child of the function's host, waiting on its socket) for the job's
next task there, and closes it when the slot moves to another job, after JOB_IDLE_S
without a task, with its host, or at ``Executor.close()``. Each test drives a real
Executor: a real zygote, host and task processes."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest

from gpumesh import wire
from gpumesh.protocol import TaskGrant
from gpumesh.worker import executor as executor_mod
from gpumesh.worker import procs
from gpumesh.worker.executor import Executor
from gpumesh.worker.host import Host

from ..conftest import alive, descendants, function_blob, parent, wait_for

pytestmark = pytest.mark.skipif(sys.platform != "linux" or bool(procs.fork_missing()),
                                reason="the fork runtime, read through /proc")


@pytest.fixture
def ex(tmp_path):
    e = Executor(spool=tmp_path / "spool")
    yield e
    e.close()


def _call(ex, tmp_path, fn, *args, job="jA", slot=0, timeout=60, task_id=None, isolation="job"):
    h, path = function_blob(tmp_path, fn)
    body = b"".join(bytes(c) for c in wire.dumps((args, {})).chunks)
    ex.new_output()
    grant = TaskGrant(task_id or os.urandom(8).hex(), "-", h, timeout=timeout,
                      isolation=isolation, job_id=job)
    return ex.run(grant, path, body, slot=slot)


def _value(out):
    assert out.status == "ok", out.error
    return wire.loads(out.payload)


def _where(x=None):
    import os
    import sys
    seen = getattr(sys, "_gpumesh_job_seen", [])  # state only a reused process carries
    seen.append(x)
    sys._gpumesh_job_seen = seen
    return os.getpid(), os.getppid(), list(seen)


def _gone(pid: int) -> bool:
    return wait_for(lambda: not alive(pid), 10, f"process {pid} to end")


def test_a_jobs_tasks_in_a_slot_share_one_forked_child_of_the_function_host(ex, tmp_path):
    pid, host, seen = _value(_call(ex, tmp_path, _where, 1))
    assert seen == [1]
    # Not a fresh interpreter: a forked child of the function's host, the same parent as
    # a default task's process of that function, and never the agent's own child.
    _other, default_parent, default_seen = _value(_call(ex, tmp_path, _where, 0, job=None,
                                                        slot=1, isolation="task"))
    assert host == default_parent != os.getpid() and default_seen == [0]
    assert parent(pid) == host
    assert _value(_call(ex, tmp_path, _where, 2)) == (pid, host, [1, 2])
    assert _value(_call(ex, tmp_path, _where, 3)) == (pid, host, [1, 2, 3])
    # Another job gets a process of its own, which has none of the first job's state.
    pid_b, host_b, seen_b = _value(_call(ex, tmp_path, _where, 4, job="jB"))
    assert pid_b != pid and host_b == host and seen_b == [4]
    _gone(pid)  # the slot moved on to job B: job A's process is closed
    # Two slots of one job: a process each.
    pid_c, _, seen_c = _value(_call(ex, tmp_path, _where, 5, job="jB", slot=1))
    assert pid_c not in (pid, pid_b) and seen_c == [5]
    assert _value(_call(ex, tmp_path, _where, 6, job="jB"))[::2] == (pid_b, [4, 6])
    assert alive(pid_c)  # (slot 1 ran nothing else)


def _crash_or_pid(mode, pid_file=None):
    import os
    import subprocess
    import time
    if mode == "crash":
        os._exit(3)
    if mode == "child":  # start a child, say who both are, and outlive any timeout
        child = subprocess.Popen(["sleep", "120"])
        with open(pid_file, "w") as fh:
            fh.write(f"{os.getpid()} {child.pid}")
        time.sleep(120)
    return os.getpid()


def test_a_crash_costs_only_that_process_and_the_jobs_next_task_gets_a_new_one(ex, tmp_path):
    first = _value(_call(ex, tmp_path, _crash_or_pid, "pid"))
    out = _call(ex, tmp_path, _crash_or_pid, "crash")
    assert out.status == "error" and out.error["type"] == "TaskCrashed"
    assert out.error["code"] == 3 and "code 3" in out.error["message"]
    _gone(first)
    second = _value(_call(ex, tmp_path, _crash_or_pid, "pid"))
    assert second != first
    assert _value(_call(ex, tmp_path, _crash_or_pid, "pid")) == second  # kept again
    # One killed from outside while it idles: the next task finds out before sending
    # and runs in a fresh process instead.
    os.kill(second, signal.SIGKILL)
    _gone(second)
    third = _value(_call(ex, tmp_path, _crash_or_pid, "pid"))
    assert third not in (first, second)


@pytest.mark.parametrize("how", ["timeout", "cancel"])
def test_a_timeout_or_cancel_kills_the_kept_process_and_its_children(ex, tmp_path, how):
    kept = _value(_call(ex, tmp_path, _crash_or_pid, "pid"))
    pid_file = tmp_path / "pids"
    got = {}

    def run():
        got["out"] = _call(ex, tmp_path, _crash_or_pid, "child", str(pid_file), task_id="t-long",
                           timeout=3 if how == "timeout" else 60)

    t = threading.Thread(target=run)
    t.start()
    text = wait_for(lambda: pid_file.exists() and pid_file.read_text(), 30, "the task to start")
    task_pid, child_pid = map(int, text.split())
    assert task_pid == kept  # the job's kept process ran it
    if how == "cancel":
        assert ex.cancel("t-long")
    t.join(30)
    assert not t.is_alive()
    out = got["out"]
    assert out.status == "error"
    if how == "timeout":
        assert out.error["type"] == "TaskTimeout" and out.error["kind"] == "timeout"
    else:
        assert out.error["kind"] == "cancelled"
    _gone(task_pid)
    _gone(child_pid)
    fresh = _value(_call(ex, tmp_path, _crash_or_pid, "pid"))
    assert fresh != kept  # it was not kept: the job's next task got a new process


def _say(i):
    import sys
    print(f"out of task {i}")
    print(f"err of task {i}", file=sys.stderr)
    return i


def test_each_task_writes_its_output_to_its_own_files(ex, tmp_path):
    seen = []

    def call_on_new_thread(i):  # another thread: other output files, the same slot
        def run():
            assert _value(_call(ex, tmp_path, _say, i)) == i
            out, err = ex.output_paths()
            with open(out) as fo, open(err) as fe:
                seen.append((fo.read(), fe.read()))
        t = threading.Thread(target=run)
        t.start()
        t.join(60)

    for i in range(3):
        assert _value(_call(ex, tmp_path, _say, i)) == i
        out, err = ex.output_paths()
        with open(out) as fo, open(err) as fe:
            seen.append((fo.read(), fe.read()))
    call_on_new_thread(3)
    assert seen == [(f"out of task {i}\n", f"err of task {i}\n") for i in range(4)]


def test_a_kept_process_closes_when_idle_and_keeps_its_host_while_it_lives(ex, tmp_path, monkeypatch):
    monkeypatch.setattr(executor_mod, "JOB_IDLE_S", 2.0)  # (room for a slow second call on a loaded machine)
    monkeypatch.setattr(executor_mod, "WARM_IDLE_S", 0.3)
    pid, host, _ = _value(_call(ex, tmp_path, _where))
    time.sleep(0.6)  # past WARM_IDLE_S: a host with no kept process would be closed now
    assert _value(_call(ex, tmp_path, _where))[:2] == (pid, host)
    _gone(pid)  # after JOB_IDLE_S without a task
    _gone(host)  # and then its host, idle too
    pid2, host2, seen = _value(_call(ex, tmp_path, _where))
    assert pid2 != pid and host2 != host and seen == [None]


def test_a_slot_running_another_jobs_or_a_default_task_closes_the_kept_process(ex, tmp_path):
    a = _value(_call(ex, tmp_path, _crash_or_pid, "pid", job="jA"))
    b = _value(_call(ex, tmp_path, _crash_or_pid, "pid", job="jB", slot=1))
    assert _value(_call(ex, tmp_path, _crash_or_pid, "pid", job=None, isolation="task")) not in (a, b)
    _gone(a)
    assert alive(b)  # another slot's
    assert _value(_call(ex, tmp_path, _crash_or_pid, "pid", job="jB", slot=1)) == b


def test_a_dead_host_drops_its_kept_processes(ex, tmp_path):
    pid, host, _ = _value(_call(ex, tmp_path, _where))
    assert host != os.getpid() and parent(host) != os.getpid()  # the host, not us or the zygote
    hosts = list(ex._hosts.values())
    assert len(hosts) == 1  # this test's one function's host
    os.kill(host, signal.SIGKILL)
    _gone(pid)  # it leads a session of its own: it ends because its socket closed
    # The executor learns of the death on its host's reader thread; a call made before
    # that is handed back ("retry", host_died: never lost), not what this test is about.
    wait_for(lambda: all(h.dead for h in hosts), 10,
             "the executor to see its function host die")
    pid2, host2, seen = _value(_call(ex, tmp_path, _where))
    assert pid2 != pid and host2 != host and seen == [None]


def test_close_leaves_no_process_behind(tmp_path):
    ex = Executor(spool=tmp_path / "spool")
    try:
        pids = {_value(_call(ex, tmp_path, _where, slot=s))[0] for s in (0, 1)}
        assert len(pids) == 2
        # What this executor started: its zygote and all below it (not the rest of this
        # test process's children, e.g. a session's mesh in a whole-suite run).
        assert ex._zygote is not None
        zygote = ex._zygote.pid
        everything = {zygote, *descendants(zygote)}
        assert pids <= everything and len(everything) >= 4  # zygote, host, two kept
    finally:
        ex.close()
    for pid in everything:
        _gone(pid)


def _echo_big(data):
    import os
    return os.getpid(), bytes(reversed(data))


def test_big_arguments_and_results_cross_a_kept_process_task_after_task(ex, tmp_path):
    pids = set()
    for i in range(3):
        data = bytes([i]) * (3 << 20) + b"end"  # past the inline limit and the memory-file one
        out = _call(ex, tmp_path, _echo_big, data)
        assert out.status == "ok", out.error
        assert isinstance(out.payload, memoryview)  # the result came as a memory file
        pid, back = wire.loads(out.payload)
        assert back == data[::-1]
        pids.add(pid)
    assert len(pids) == 1


def _importing(name=None):
    import importlib
    import os
    if name:
        importlib.import_module(name)
    return os.getpid()


def test_a_kept_process_reports_each_module_a_task_imports_once(ex, tmp_path, monkeypatch):
    reported: list[list[str]] = []
    monkeypatch.setattr(Host, "preload", lambda host, modules, path: reported.append(list(modules or ())))
    mod = "tabnanny"  # (a module no function host loads)
    pids = [_value(_call(ex, tmp_path, _importing, name)) for name in (None, None, mod, mod, None)]
    assert len(set(pids)) == 1  # one kept process ran them all
    # nothing new, nothing new, the module (the host preloads it), then nothing again
    assert [mod in r for r in reported] == [False, False, True, False, False], reported


# ------------------------------------------------------------ pipelining ------------
# A slot's next grant of the same job is sent to its kept process behind the running
# task (Executor._send_ahead), which begins it as soon as that one ends. What must still
# hold: the task sent ahead writes its own output files, its timeout starts when it
# begins, a task withdrawn before it began never runs, one withdrawn after it began keeps
# its result, and one whose process died before it began runs once, elsewhere.

def _step(i, seconds=0.0, marks=None, how="ok"):
    """Print, wait ``seconds``, append ``i`` to ``marks`` (a run that got to its end),
    return (i, pid, when it began)."""
    import os
    import sys
    import time
    began = time.time()
    print(f"out of {i}")
    print(f"err of {i}", file=sys.stderr)
    time.sleep(seconds)
    if how == "crash":
        os._exit(3)
    if marks:
        with open(marks, "a") as fh:
            fh.write(f"{i}\n")
    return i, os.getpid(), began


class Slot:
    """One slot's thread as the agent drives it: grants in order, each run with the next
    one offered as ``ahead``."""

    def __init__(self, ex, tmp_path, job="jA", timeout=60):
        self.ex, self.job, self.timeout = ex, job, timeout
        self.h, self.path = function_blob(tmp_path, _step)
        self.queue: list = []

    def grant(self, *args, timeout=None):
        body = b"".join(bytes(c) for c in wire.dumps((args, {})).chunks)
        g = TaskGrant(os.urandom(8).hex(), "-", self.h, timeout=timeout or self.timeout,
                      isolation="job", job_id=self.job)
        self.queue.append((g, body))
        return g

    def run(self, withdraw=False):
        g, body = self.queue.pop(0)
        out_path, err_path = self.ex.new_output(g.task_id)
        outcome = self.ex.run(g, self.path, body, slot=0, withdraw=withdraw,
                              ahead=lambda: self.queue[0] if self.queue else None)
        with open(out_path) as fo, open(err_path) as fe:
            return outcome, fo.read(), fe.read()


def _marks(path) -> list[int]:
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def test_a_task_sent_ahead_begins_when_the_last_one_ends_and_writes_its_own_output(ex, tmp_path):
    marks = tmp_path / "marks"
    slot = Slot(ex, tmp_path)
    for i in range(4):
        slot.grant(i, 0.2 if i == 0 else 0.0, str(marks))
    first, out, err = slot.run()
    i, pid, _ = _value(first)
    assert (i, out, err) == (0, "out of 0\n", "err of 0\n")
    assert ex.sent_ahead(slot.queue[0][0].task_id)
    # It runs to its end before its own run is called: sent ahead, not sent by that run.
    wait_for(lambda: _marks(marks) == [0, 1], 30, "the task sent ahead to run")
    for n in range(1, 4):
        outcome, out, err = slot.run()
        assert _value(outcome)[:2] == (n, pid)  # the job's one kept process
        assert (out, err) == (f"out of {n}\n", f"err of {n}\n")  # its own, whole
    assert _marks(marks) == [0, 1, 2, 3]


def test_the_timeout_of_a_task_sent_ahead_starts_when_it_begins(ex, tmp_path):
    slot = Slot(ex, tmp_path)
    slot.grant(0, 1.0)
    slot.grant(1, 0.5, timeout=1.2)  # sent during the 1 s before it: 1.5 s from then
    assert _value(slot.run()[0])[0] == 0
    assert _value(slot.run()[0])[0] == 1
    slot.grant(2, 2.0, timeout=0.5)
    outcome = slot.run()[0]
    assert outcome.status == "error" and outcome.error["kind"] == "timeout"


def test_a_task_withdrawn_before_it_began_never_runs(ex, tmp_path):
    marks = tmp_path / "marks"
    slot = Slot(ex, tmp_path)
    slot.grant(0, 0.8, str(marks))
    dropped = slot.grant(1, 0.0, str(marks))
    slot.grant(2, 0.0, str(marks))

    def cancel_soon():  # as the agent does for a cancelled queued grant
        wait_for(lambda: ex.sent_ahead(dropped.task_id), 30, "the task sent ahead")
        slot.queue.pop(0)
        withdrawn.append(ex.withdraw(dropped.task_id))
    withdrawn: list = []
    t = threading.Thread(target=cancel_soon)
    t.start()
    _i, pid, _ = _value(slot.run()[0])
    t.join(10)
    assert withdrawn == [True]
    outcome, out, _err = slot.run()
    i, pid_next, _ = _value(outcome)
    assert (i, out) == (2, "out of 2\n")
    assert pid_next != pid  # its process was not used again: the skip's answer is unread
    wait_for(lambda: not alive(pid), 10, "the process of the withdrawn task to end")
    assert _marks(marks) == [0, 2]


def test_a_task_handed_back_after_it_began_keeps_its_result_and_one_before_does_not_run(ex, tmp_path):
    marks = tmp_path / "marks"
    slot = Slot(ex, tmp_path)
    slot.grant(0, 0.0, str(marks))
    slot.grant(1, 0.0, str(marks))
    assert _value(slot.run()[0])[0] == 0
    wait_for(lambda: _marks(marks) == [0, 1], 30, "task 1 to begin and end in the kept process")
    outcome, out, _ = slot.run(withdraw=True)
    assert _value(outcome)[0] == 1 and out == "out of 1\n"  # it finished first: it stands
    # Withdrawn while the task before it still runs: it answers that it did not begin.
    slot.grant(2, 0.8, str(marks))
    held_back = slot.grant(3, 0.0, str(marks))
    t = threading.Thread(target=lambda: wait_for(lambda: ex.sent_ahead(held_back.task_id), 30,
                                                 "the task sent ahead") and ex.withdraw(held_back.task_id))
    t.start()
    _i, pid, _ = _value(slot.run()[0])
    t.join(10)
    outcome, out, _ = slot.run(withdraw=True)
    assert outcome.status == "error" and outcome.error["kind"] == "cancelled", outcome.error
    assert "before it began" in outcome.error["message"] and out == ""
    slot.grant(4, 0.0, str(marks))
    assert _value(slot.run()[0])[:2] == (4, pid)  # the process answered: still the job's
    assert _marks(marks) == [0, 1, 2, 4]


def test_a_task_sent_to_a_process_that_then_died_runs_once_in_a_new_one(ex, tmp_path):
    marks = tmp_path / "marks"
    slot = Slot(ex, tmp_path)
    slot.grant(0, 0.3, str(marks), "crash")
    slot.grant(1, 0.0, str(marks))
    crashed = slot.run()[0]
    assert crashed.status == "error" and crashed.error["kind"] == "crashed", crashed.error
    outcome, out, _ = slot.run()
    assert _value(outcome)[0] == 1 and out == "out of 1\n"
    assert _marks(marks) == [1]
