"""``isolation="job"`` pipelining on the fork runtime: a slot's next grant of the same job
is sent to its kept process behind the running task (Executor._send_ahead), which
begins it as soon as that one ends. Each test drives a real Executor (zygote, host, task
processes) and checks what must still hold: the task sent ahead writes its own output
files, its timeout starts when it begins, a task withdrawn before it began never runs,
one withdrawn after it began keeps its result, and one whose process died before it
began runs once, elsewhere."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

from gpumesh import wire
from gpumesh.protocol import TaskGrant
from gpumesh.worker import procs
from gpumesh.worker.executor import Executor

from ..conftest import alive, function_blob, wait_for

pytestmark = pytest.mark.skipif(sys.platform != "linux" or bool(procs.fork_missing()),
                                reason="the fork runtime, read through /proc")


@pytest.fixture
def ex(tmp_path):
    e = Executor(spool=tmp_path / "spool")
    yield e
    e.close()


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


def _value(outcome):
    assert outcome.status == "ok", outcome.error
    return wire.loads(outcome.payload)


def _marks(path) -> list[int]:
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def test_a_task_sent_ahead_begins_when_the_last_one_ends_and_writes_its_own_output(ex, tmp_path):
    slot = Slot(ex, tmp_path)
    for i in range(4):
        slot.grant(i, 0.2 if i == 0 else 0.0)
    first, out, err = slot.run()
    ran_first = time.time()
    i, pid, _ = _value(first)
    assert (i, out, err) == (0, "out of 0\n", "err of 0\n")
    for n in range(1, 4):
        outcome, out, err = slot.run()
        i, pid_n, began = _value(outcome)
        assert (i, pid_n) == (n, pid)  # the job's one kept process
        assert (out, err) == (f"out of {n}\n", f"err of {n}\n")  # its own, whole
        if n == 1:
            # It had begun before its run was called: sent ahead, not sent by that run.
            assert began < ran_first


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
    time.sleep(0.3)  # task 1 has begun (and ended) in the kept process
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
