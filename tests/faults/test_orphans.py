"""A worker's agent killed outright (``kill -9``, an OOM kill, a crash) takes its running
tasks with it: no task process, nor what it started, runs on to its end unwatched while
the coordinator re-runs the task elsewhere (a task handed back never runs to completion
twice). Function tasks (a fresh process per task, or the one a job keeps) and script
tasks; on both runtimes (``GPUMESH_RUNTIME=spawn`` too, scripts aside)."""

from __future__ import annotations

import os
import signal
import sys
from contextlib import closing

import pytest

from gpumesh import accelerate
from gpumesh.worker import procs

from ..conftest import _stat, alive, children, parent, proc_state, wait_for
from .test_workers import _call_in_thread, _owner

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads /proc to find the task's processes")

#: How long the task's first run sleeps before it writes its "finished" mark: far longer
#: than the test waits for it to end (an orphan cannot just finish meanwhile); its re-run
#: sleeps RERUN_S.
FIRST_RUN_S = 60.0
RERUN_S = 0.5
#: How long an orphan may outlive its agent (seconds): what ends it is an EOF or the
#: kernel's parent-death signal, at once; this is slack for a loaded machine.
ORPHAN_GRACE_S = 10.0


def _lines(path) -> list[list[int]]:
    try:
        return [[int(x) for x in line.split()] for line in path.read_text().splitlines()]
    except (OSError, ValueError):
        return []


def _task(c, isolation: str, started: str, finished: str):
    @accelerate(c, isolation=isolation)
    def work(tag):
        import os as _os
        import subprocess
        import sys as _sys
        import time as _t
        # a child of the task, in its process group: it must not outlive the agent either
        child = subprocess.Popen([_sys.executable, "-c", "import time; time.sleep(90)"])
        first = not _os.path.exists(started)
        with open(started, "a") as fh:
            fh.write(f"{_os.getpid()} {child.pid}\n")
        _t.sleep(FIRST_RUN_S if first else RERUN_S)
        with open(finished, "a") as fh:  # only a run that got to its end writes this
            fh.write(f"{_os.getpid()}\n")
        child.kill()
        child.wait()
        return tag * 2
    return work


_SCRIPT = """\
import json, os, subprocess, sys, time
STARTED, FINISHED, FIRST_RUN_S, RERUN_S = {args}
x = json.load(sys.stdin)["x"]
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(90)"])
first = not os.path.exists(STARTED)
with open(STARTED, "a") as fh:
    fh.write(f"{{os.getpid()}} {{child.pid}}\\n")
time.sleep(FIRST_RUN_S if first else RERUN_S)
with open(FINISHED, "a") as fh:
    fh.write(f"{{os.getpid()}}\\n")
child.kill()
child.wait()
print(json.dumps(x * 2))
"""


def _call(c, kind: str, started, finished, tmp_path):
    """Start the task (a function of ``isolation=kind``, or a script task) in a thread;
    (the thread, the box its result lands in as ``"v"``)."""
    if kind != "script":
        return _call_in_thread(_task(c, kind, str(started), str(finished)), 21)
    script = tmp_path / "orphan.py"
    script.write_text(_SCRIPT.format(args=repr((str(started), str(finished), FIRST_RUN_S,
                                                RERUN_S))))

    def run():
        job = c.submit(script=str(script), payloads=[{"x": 21}])
        (result,) = c.wait(job, timeout=60)
        return result["result"]
    return _call_in_thread(run)


def _describe(pid: int) -> str:
    """``pid``'s state, parent, group, session and command line, for a failure message."""
    fields = _stat(pid)
    if fields is None:
        return f"{pid}: gone"
    cmd = _cmdline(pid).replace(b"\0", b" ").decode(errors="replace")[:120]
    return f"{pid}: state {fields[0]} ppid {fields[1]} pgid {fields[2]} sid {fields[3]} [{cmd}]"


def _seen(task_pid: int, child_pid: int, agent) -> str:
    """What a failed wait saw: the two processes, the function hosts and zygotes still
    running (the task's parent among them), and the end of the killed agent's log."""
    hosts = [int(e) for e in os.listdir("/proc") if e.isdigit()
             and b"gpumesh.worker.runner" in _cmdline(int(e))]
    lines = [_describe(pid) for pid in (task_pid, child_pid, *hosts)]
    return ("the task and its child to end:\n  " + "\n  ".join(lines)
            + "\nthe agent's log ends:\n" + agent.output()[-3000:])


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read()
    except OSError:
        return b""


def _both_end_then_the_call_returns(task_pid: int, child_pid: int, th, agent) -> None:
    wait_for(lambda: not alive(task_pid) and not alive(child_pid), ORPHAN_GRACE_S,
             lambda: _seen(task_pid, child_pid, agent))
    th.join(60)
    assert not th.is_alive(), "the call returned"


def _kill_with_a_message_unread(agent, task_pid: int) -> None:
    """Kill the agent while a message its task's host sent lies unread in its socket:
    Linux then gives the host ECONNRESET, not EOF, which it must read as the same
    hang-up. (The agent is stopped, the host's idle spare killed, and the host's report
    of that exit, which the stopped agent cannot read, is waited for before the kill.)"""
    os.kill(agent.p.pid, signal.SIGSTOP)
    host = parent(task_pid)
    assert host is not None
    spares = wait_for(lambda: [p for p in children(host) if p != task_pid], 30,
                      "the host's next spare")
    for pid in spares:
        os.kill(pid, signal.SIGKILL)
    # reaped by the host (gone from /proc) once it has sent its report of the exit
    wait_for(lambda: all(proc_state(pid) == "gone" for pid in spares), 30, "the host's reap")
    os.kill(agent.p.pid, signal.SIGKILL)


@pytest.mark.parametrize("kind,kill", [("task", "group"), ("job", "group"), ("script", "group"),
                                       ("task", "agent"), ("script", "agent"),
                                       ("task", "unread")])
def test_a_killed_agent_takes_its_running_task_and_its_children_with_it(
        fault_mesh, tmp_path, kind, kill):
    if kind == "script" and procs.choose_runtime()[0] == "spawn":
        pytest.skip("the spawn runtime's agent has no watcher for its script tasks yet")
    if kill == "unread" and procs.choose_runtime()[0] == "spawn":
        pytest.skip("the spawn runtime has no function host: its task processes watch the agent's pid")
    m = fault_mesh(workers=2)
    started, finished = tmp_path / "started", tmp_path / "finished"
    with closing(m.client(output=False)) as c:
        th, box = _call(c, kind, started, finished, tmp_path)
        wait_for(lambda: _lines(started), 60, "the task to start")
        task_pid, child_pid = _lines(started)[0]
        agent = _owner(m, task_pid)
        assert agent is not None, "the worker running the task"
        assert alive(task_pid) and alive(child_pid)
        if kill == "group":  # everything in the agent's process group at once (kill -9 -PGID)
            os.killpg(agent.p.pid, signal.SIGKILL)
        elif kill == "unread":
            _kill_with_a_message_unread(agent, task_pid)
        else:
            os.kill(agent.p.pid, signal.SIGKILL)
        agent.p.wait(10)
        _both_end_then_the_call_returns(task_pid, child_pid, th, agent)
    assert box.get("v") == 42, box
    runs = _lines(started)
    assert len(runs) == 2, "run once more, on the other worker"
    # the orphan is gone (above), so it can never write its mark: one run finished, the re-run
    assert _lines(finished) == [[runs[1][0]]], "only the re-run got to its end"
    assert not alive(runs[1][1]), "the re-run's child ended with it"


def test_a_killed_function_host_takes_its_running_task_and_its_children_with_it(
        fault_mesh, tmp_path):
    # (the agent lives on: the kernel kills the task process with its host, the agent its
    # group, and the task runs again, its first run never finished)
    if procs.choose_runtime()[0] != "fork":
        pytest.skip("function hosts are the fork runtime's")
    m = fault_mesh(workers=1)
    started, finished = tmp_path / "started", tmp_path / "finished"
    with closing(m.client(output=False)) as c:
        th, box = _call(c, "task", started, finished, tmp_path)
        wait_for(lambda: _lines(started), 60, "the task to start")
        task_pid, child_pid = _lines(started)[0]
        host = parent(task_pid)
        agent = _owner(m, host) if host is not None else None
        assert agent is not None, "the task's host"
        os.kill(host, signal.SIGKILL)
        _both_end_then_the_call_returns(task_pid, child_pid, th, agent)
    assert box.get("v") == 42, box
    runs = _lines(started)
    assert len(runs) == 2 and _lines(finished) == [[runs[1][0]]], "only the re-run finished"
