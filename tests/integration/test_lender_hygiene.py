"""A lent machine stays its owner's: what a task leaves behind is cleaned up, with real
processes on 127.0.0.1, on both task runtimes.

* a child a task started in a session of its own (out of its process group's reach)
  dies when the task ends, at ``gpumesh pause --now``, and when the worker stops;
  with ``isolation="job"``, when the job's process ends (Linux: child subreapers);
* a task's output file on the lender's disk stays near ``SPOOL_CAP_BYTES`` however
  much it prints, and is emptied once its output is delivered;
* a task's temporary files (``tempfile``) live in a directory of its own inside the
  worker's, removed when its process is done.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from contextlib import closing

import pytest

from gpumesh import accelerate
from gpumesh.limits import SPOOL_CAP_BYTES

from ..conftest import Proc, alive, wait_for
from .test_owner import cli, joined_id

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads /proc; subreapers are Linux's")

RUNTIMES = ["fork", "spawn"]
#: How long an escaped child may outlive what ends it (seconds): slack for a loaded machine.
GRACE_S = 5.0
#: The escaped child's own life if nothing kills it: far longer than any wait here.
BUSY = "import time\nend = time.time() + 60\nwhile time.time() < end: pass"


def _join(m, name: str, runtime: str) -> Proc:
    proc = Proc(["join", m.url, "--slots", "1", "--runtime", runtime], m.env, m.root / f"{name}.log")
    m.procs.append(proc)
    joined_id(proc)
    return proc


def _escaping_task(c, marks: str, seconds: float, isolation: str = "task"):
    @accelerate(c, isolation=isolation)
    def escape(i):
        import os as _os
        import subprocess
        import sys as _sys
        import tempfile
        import time as _t
        child = subprocess.Popen([_sys.executable, "-c", BUSY], start_new_session=True)
        # the task's own short-lived subprocess still gets its exit status
        code = subprocess.run([_sys.executable, "-c", "import sys; sys.exit(3)"]).returncode
        fd, path = tempfile.mkstemp()
        _os.close(fd)
        with open(f"{marks}/{i}", "w") as fh:
            fh.write(json.dumps({"child": child.pid, "task": _os.getpid(), "tmp": path,
                                 "gettempdir": tempfile.gettempdir(),
                                 "env": _os.environ.get("TMPDIR"), "cwd": _os.getcwd()}))
        _t.sleep(seconds)
        return code
    return escape


def _mark(marks, i) -> dict:
    path = marks / str(i)
    return wait_for(lambda: path.exists() and path.read_text() and json.loads(path.read_text()),
                    30, f"task {i} to start")


def _gone(pid: int) -> bool:
    return not alive(pid)  # (a zombie has ended)


def _worker_dir(path: str) -> str:
    """The worker's own directory (gpumesh-worker-*) that ``path`` lies in."""
    parts = path.split(os.sep)
    i = next(i for i, p in enumerate(parts) if p.startswith("gpumesh-worker-"))
    return os.sep.join(parts[:i + 1])


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_what_a_task_leaves_dies_with_it_and_its_temp_files_go(make_mesh, tmp_path, runtime):
    m = make_mesh(workers=0)
    _join(m, "w", runtime)
    marks = tmp_path / "marks"
    marks.mkdir()
    with closing(m.client(output=False)) as c:
        fn = _escaping_task(c, str(marks), 0.5)
        assert fn(0) == 3  # subprocess.run's own exit status reached the task
        mark = _mark(marks, 0)
        wait_for(lambda: _gone(mark["child"]), GRACE_S, "the escaped child to die with its task")
        # its temporary directory was its own, inside the worker's, and it is gone
        tmp = mark["tmp"]
        assert not os.path.exists(tmp)
        assert not os.path.exists(os.path.dirname(tmp))
        assert mark["gettempdir"] == mark["env"] == os.path.dirname(tmp)
        assert os.path.dirname(mark["gettempdir"]) == os.path.join(_worker_dir(tmp), "tmp")
        assert not mark["cwd"].startswith(mark["gettempdir"])  # (its working directory is not moved)
        # a map: each task's child dies with it, every result arrives
        (marks / "0").unlink()
        assert fn.map(range(4)) == [3, 3, 3, 3]
        for i in range(4):
            mark = _mark(marks, i)
            wait_for(lambda m=mark: _gone(m["child"]), GRACE_S, f"item {i}'s escaped child to die")
            assert not os.path.exists(mark["tmp"])
        # What is left is the directory of a spare that waits for its next task (made as
        # it was forked, fork runtime: p<its pid>), never a finished task's.
        left = os.listdir(os.path.join(_worker_dir(mark["tmp"]), "tmp"))
        assert all(n.startswith("p") and alive(int(n[1:])) for n in left), left
        assert runtime == "fork" or left == []


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_jobs_kept_process_keeps_what_it_started_until_it_ends(make_mesh, tmp_path, runtime):
    m = make_mesh(workers=0)
    _join(m, "w", runtime)
    marks = tmp_path / "marks"
    marks.mkdir()
    with closing(m.client(output=False)) as c:
        fn = _escaping_task(c, str(marks), 0.1, isolation="job")
        assert fn.map([0, 1]) == [3, 3]
        first, second = _mark(marks, 0), _mark(marks, 1)
        assert first["task"] == second["task"]  # one process for the job's tasks
        assert first["gettempdir"] == second["gettempdir"]
        time.sleep(1.0)  # the job's process is kept (idle): what it started lives on
        assert alive(first["child"]) and alive(second["child"])
        assert os.path.exists(first["tmp"]) and os.path.exists(second["tmp"])
        # another job's task in the slot: the job's process is let go, and all it left
        # (that job keeps a process of its own, and what it started, in its turn)
        other = _escaping_task(c, str(marks), 0.1, isolation="job")
        assert other(2) == 3
        for mark in (first, second):
            wait_for(lambda m=mark: _gone(m["child"]), GRACE_S, "the job's escaped children to die")
        wait_for(lambda: not os.path.exists(first["gettempdir"]), GRACE_S,
                 "the job's temporary directory to go")


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_pause_now_and_a_stopping_worker_kill_what_the_task_left(make_mesh, tmp_path, runtime):
    m = make_mesh(workers=0)
    w = _join(m, "w", runtime)
    wid = joined_id(w)
    marks = tmp_path / "marks"
    marks.mkdir()
    with closing(m.client(output=False)) as c:
        fn = _escaping_task(c, str(marks), 60)
        th = threading.Thread(target=lambda: fn(0), daemon=True)
        th.start()
        mark = _mark(marks, 0)
        assert alive(mark["child"])
        r = cli(m, "pause", "--now", "--worker", wid)
        assert r.returncode == 0, r.stderr
        wait_for(lambda: _gone(mark["task"]) and _gone(mark["child"]), GRACE_S,
                 "pause --now to kill the task and its escaped child")
        assert not os.path.exists(mark["tmp"])
        # the handed-back task runs again on resume; then the worker stops under it
        (marks / "0").unlink()
        assert cli(m, "resume", "--worker", wid).returncode == 0
        mark = _mark(marks, 0)
        assert alive(mark["child"])
        w.stop()
        wait_for(lambda: _gone(mark["task"]) and _gone(mark["child"]), GRACE_S,
                 "the stopped worker's task and its escaped child to die")
        assert not os.path.exists(_worker_dir(mark["tmp"]))


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_task_printing_far_past_the_cap_keeps_its_output_file_small(make_mesh, tmp_path, runtime):
    m = make_mesh(workers=0)
    _join(m, "w", runtime)
    where = tmp_path / "where"
    mib, total = 2**20, 48  # MiB printed, well past the cap
    with closing(m.client(output=False)) as c:
        @accelerate(c)
        def loud(n):
            import os as _os
            import sys as _sys
            import time as _t
            with open(str(where), "w") as fh:
                fh.write(_os.readlink("/proc/self/fd/1"))  # its output file on this disk
            line = "x" * 1023 + "\n"
            for k in range(n):
                _sys.stdout.write(f"{k:06d}" + line[6:] + line * 1023)  # 1 MiB
                _t.sleep(0.05)  # ~20 MB/s: a fast printer, not an instant one
            print("stderr end", file=_sys.stderr)
            return n

        sizes: list[int] = []
        done = threading.Event()

        def watch() -> None:
            path = wait_for(lambda: where.exists() and where.read_text(), 30, "the task to start")
            while not done.is_set():
                try:
                    sizes.append(os.stat(path).st_size)
                except OSError:
                    pass
                time.sleep(0.005)

        th = threading.Thread(target=watch, daemon=True)
        th.start()
        try:
            assert loud(total) == total
        finally:
            done.set()
            th.join(10)
        spool = where.read_text()
        # never past the cap by more than what one flush interval's printing adds
        assert sizes and max(sizes) <= SPOOL_CAP_BYTES + 8 * mib, max(sizes)
        assert max(sizes) >= SPOOL_CAP_BYTES  # (it did print past the cap)
        assert os.stat(spool).st_size == 0  # emptied once its output was delivered
        job = c.jobs()[0]["id"]
        (log,) = c.logs(job)
        # what the caller sees: the start of the output, in order, and the whole stderr
        assert log["stdout"].startswith("000000x")
        assert "000001x" in log["stdout"]
        assert "stderr end" in log["stderr"]
