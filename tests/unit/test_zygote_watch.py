"""The zygote kills the process groups of the scripts it was asked to watch when the
agent hangs up (runner.zygote_main), and only those."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from gpumesh.worker import framing

from ..conftest import alive, children, wait_for

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads /proc; the fork runtime's zygote")


def _sleeper() -> subprocess.Popen:
    """A stand-in for a script task: a session of its own, and a child in its group."""
    return subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                             "subprocess.Popen([sys.executable, '-c', 'import time; "
                             "time.sleep(60)']); print(flush=True); time.sleep(60)"],
                            stdout=subprocess.PIPE, start_new_session=True)


def test_the_zygote_kills_the_watched_scripts_groups_at_the_agents_eof():
    ctrl, child = framing.control_pair()
    zygote = subprocess.Popen([sys.executable, "-m", "gpumesh.worker.runner", str(child.fileno())],
                              pass_fds=[child.fileno()], stdin=subprocess.DEVNULL)
    child.close()
    watched, let_go = _sleeper(), _sleeper()
    try:
        for p in (watched, let_go):
            assert p.stdout is not None and p.stdout.readline() == b"\n"  # its child started
        kids = {p.pid: children(p.pid) for p in (watched, let_go)}
        assert all(len(k) == 1 for k in kids.values()), kids
        for p in (watched, let_go):
            framing.send_msg(ctrl, {"op": "watch", "pid": p.pid})
        framing.send_msg(ctrl, {"op": "unwatch", "pid": let_go.pid})  # (it ended, say)
        ctrl.close()  # the agent dies
        assert zygote.wait(10) == 0
        watched.wait(10)
        wait_for(lambda: not alive(kids[watched.pid][0]), 10, "the watched script's child to end")
        assert let_go.poll() is None and alive(kids[let_go.pid][0]), "one no longer watched lives"
    finally:
        for p in (watched, let_go):
            try:
                os.killpg(p.pid, 9)
            except OSError:
                pass
            p.wait()
        if zygote.poll() is None:
            zygote.kill()
            zygote.wait()
