"""GPUMESH_TRACE: every hop of a call leaves one mark, from the process that made it."""

from __future__ import annotations

import os
import subprocess
import sys

from gpumesh import tracing

from ..conftest import Mesh


def _marks(path):
    return [(int(ns), int(pid), label) for ns, pid, label in
            (line.split(" ", 2) for line in path.read_text().splitlines())]


def test_marks_are_written_only_when_on_and_a_forked_child_writes_its_own(tmp_path):
    trace = tmp_path / "trace.log"
    code = (
        "import os\n"
        "from gpumesh import tracing\n"
        "tracing.mark('parent.first')\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    os.close(tracing._fd)  # the task closed the inherited number: no matter\n"
        "    tracing.mark('child.only')\n"
        "    os._exit(0)\n"
        "os.waitpid(pid, 0)\n"
        "tracing.mark('parent.second')\n"
        "print(os.getpid(), pid)\n"
    )
    env = dict(os.environ, GPUMESH_TRACE=str(trace))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60, check=True).stdout.split()
    parent, child = int(out[0]), int(out[1])
    marks = _marks(trace)
    assert [(pid, label) for _, pid, label in marks] == [
        (parent, "parent.first"), (child, "child.only"), (parent, "parent.second")]
    assert marks[0][0] <= marks[1][0] <= marks[2][0]  # one monotonic clock

    env.pop("GPUMESH_TRACE")
    empty = tmp_path / "off"
    empty.mkdir()
    got = subprocess.run([sys.executable, "-c", "from gpumesh import tracing; "
                          "tracing.mark('x'); print(tracing.PATH, tracing._fd)"],
                         env=env, cwd=empty, capture_output=True, text=True, timeout=60, check=True)
    assert got.stdout.split() == ["None", "None"]  # off: nothing opened, nothing written
    assert list(empty.iterdir()) == []


def test_a_traced_call_marks_every_hop_in_order(monkeypatch, tmp_path):
    trace = tmp_path / "trace.log"
    mesh = Mesh(tmp_path / "mesh")
    mesh.env["GPUMESH_TRACE"] = str(trace)
    mesh.start()
    try:
        worker = mesh.add_worker(slots=1)
        client = mesh.client()
        monkeypatch.setattr(tracing, "PATH", str(trace))  # this process imported it off
        monkeypatch.setattr(tracing, "_fd", None)  # restored after the test: closed below
        from gpumesh import accelerate
        f = accelerate(client)(lambda x: x * 2)
        assert f(1) == 2  # warm: the function host exists
        trace.write_text("")
        assert f(21) == 42
        client.close()
        marks = _marks(trace)
        first = {}
        for _ns, pid, label in marks:
            first.setdefault(label, (_ns, pid))
        assert [h for h in tracing.CALL_HOPS if h in first] == list(tracing.CALL_HOPS)
        times = [first[h][0] for h in tracing.CALL_HOPS]
        assert times == sorted(times)
        pids = {h: first[h][1] for h in tracing.CALL_HOPS}
        assert pids["caller.submit"] == pids["caller.answered"] == os.getpid()
        assert pids["agent.leased"] == pids["agent.post"] == worker.p.pid
        assert pids["coordinator.submit"] == pids["coordinator.answer"] == mesh.coordinator.p.pid
        assert pids["task.start"] == pids["task.reply"] not in (os.getpid(), worker.p.pid,
                                                                 mesh.coordinator.p.pid)
    finally:
        if tracing._fd is not None:
            os.close(tracing._fd)
        mesh.stop()
