"""The only worker (or the only one that can run the call) dies while a call waits: the
wait for another one is bounded.

With ``timeout=T`` the caller gives up after T seconds with no worker alive; without one,
after ``GPUMESH_NO_WORKER_TIMEOUT`` seconds (default 600). Either way it raises WorkerLost
naming how long no worker was alive, prints its one-line notice once, and cancels the job,
so a worker joining later never runs the abandoned task.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

from gpumesh import WorkerLost, accelerate
from gpumesh.versions import python_minor

from ..conftest import Proc
from ..conftest import wait_for


def _pids(path) -> list[int]:
    try:
        return [int(x) for x in path.read_text().split()]
    except (OSError, ValueError):
        return []


def _job_state(client, job_id: str) -> str:
    return client.status(job_id)["state"]


def test_call_with_timeout_ends_when_its_only_worker_dies(fault_mesh, tmp_path, capfd):
    m = fault_mesh(workers=1)
    client = m.client(output=False)
    marker = tmp_path / "pids"

    @accelerate(client, timeout=3)
    def slow(path):
        import os
        import time
        with open(path, "a") as fh:
            fh.write(f"{os.getpid()}\n")
        time.sleep(60)  # far past the timeout: only the worker's death ends it
        return "finished"

    box: dict = {}

    def call():
        try:
            box["v"] = slow(str(marker))
        except BaseException as e:  # noqa: BLE001
            box["e"] = e
        box["t"] = time.monotonic()

    th = threading.Thread(target=call, daemon=True)
    th.start()
    wait_for(lambda: _pids(marker), 20, "the task to start")
    killed_at = time.monotonic()
    os.kill(m.procs[1].p.pid, signal.SIGKILL)
    th.join(45)  # bounded: before this change the call waited for ever
    assert not th.is_alive(), "the call with timeout=3 still waits with no worker alive"
    err = box.get("e")
    assert type(err) is WorkerLost, box
    assert box["t"] - killed_at >= 3  # it did wait out its timeout for a worker to come back
    text = str(err)
    assert "no worker has been alive in the mesh at" in text and "timeout=3s" in text, text
    job_id = text.split("of job ")[1].split()[0]
    # the job was cancelled: a worker joining now does not run the abandoned task
    wait_for(lambda: _job_state(client, job_id) == "cancelled", 10, lambda: client.status(job_id))
    m.add_worker()
    assert len(_pids(marker)) == 1
    stderr = capfd.readouterr().err
    assert stderr.count("no live worker in the mesh") == 1, stderr
    assert "(for up to 3s)" in stderr, stderr


CALLER = textwrap.dedent("""
    import sys
    from gpumesh import GPUMesh, WorkerLost, accelerate

    mesh = GPUMesh(sys.argv[1], output=False)

    @accelerate(mesh)
    def slow(path):
        import os, time
        with open(path, "a") as fh:
            fh.write(f"{os.getpid()}\\n")
        time.sleep(60)

    try:
        slow(sys.argv[2])
    except WorkerLost as e:
        print("WorkerLost:", e, flush=True)
        sys.exit(3)
    print("no error", flush=True)
""")


def test_call_without_timeout_gives_up_after_the_documented_limit(fault_mesh, tmp_path):
    m = fault_mesh(workers=1)
    marker = tmp_path / "pids"
    script = tmp_path / "caller.py"
    script.write_text(CALLER)
    env = dict(m.env, GPUMESH_NO_WORKER_TIMEOUT="2")
    caller = subprocess.Popen([sys.executable, str(script), m.url, str(marker)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              stdin=subprocess.DEVNULL)
    try:
        wait_for(lambda: _pids(marker) or caller.poll() is not None, 30, "the task to start or the caller to exit")
        assert caller.poll() is None, caller.communicate()
        os.kill(m.procs[1].p.pid, signal.SIGKILL)
        out, err = caller.communicate(timeout=45)
    finally:
        if caller.poll() is None:
            caller.kill()
            caller.wait()
    assert caller.returncode == 3, (out, err)
    assert out.startswith("WorkerLost: no worker has been alive in the mesh at "), out
    assert "GPUMESH_NO_WORKER_TIMEOUT=2s" in out and "1 of 1 task(s)" in out, out
    assert err.count("no live worker in the mesh") == 1, err
    assert "waiting for one to (re)join (for up to 2s)" in err, err


def test_call_ends_when_the_only_worker_that_can_run_it_dies(fault_mesh, tmp_path, capfd):
    """A gpu= call whose GPU worker dies while a CPU-only worker stays: nothing alive can
    run it, so the wait is bounded the same way."""
    m = fault_mesh(workers=0)
    gpu_env = dict(m.env, GPUMESH_FAKE_GPUS=json.dumps([{"name": "NVIDIA GeForce RTX 4090",
                                                          "memory_total_mb": 24564, "score": 3000}]))
    gpu_box = Proc(["join", m.url], gpu_env, tmp_path / "gpu.log")
    m.procs.append(gpu_box)
    m.wait_alive(1, gpu_box)
    m.add_worker()  # CPU only (no fake GPUs)
    client = m.client(output=False)
    marker = tmp_path / "pids"

    @accelerate(client, gpu="cuda", timeout=3)
    def on_gpu(path):
        import os
        import time
        with open(path, "a") as fh:
            fh.write(f"{os.getpid()}\n")
        time.sleep(60)

    box: dict = {}

    def call():
        try:
            on_gpu(str(marker))
        except BaseException as e:  # noqa: BLE001
            box["e"] = e

    th = threading.Thread(target=call, daemon=True)
    th.start()
    wait_for(lambda: _pids(marker), 20, "the task to start")
    os.kill(gpu_box.p.pid, signal.SIGKILL)
    th.join(45)
    assert not th.is_alive(), "the gpu= call still waits with no GPU worker alive"
    assert type(box.get("e")) is WorkerLost, box
    # Both say what the job needs: the GPU, and the caller's Python (the function, defined
    # here, travels by value).
    needs = f"gpu='cuda', Python {python_minor()} (code shipped by value)"
    assert f"no worker that can run its tasks [{needs}] has been alive" in str(box["e"]), box["e"]
    assert m.alive() == 1  # the CPU worker was there all along
    stderr = capfd.readouterr().err
    assert "can run job" in stderr and f"(they need {needs})" in stderr, stderr
    assert "(for up to 3s)" in stderr, stderr


def test_map_with_return_exceptions_gets_worker_lost_in_each_unfinished_place(fault_mesh, tmp_path):
    """``.map(..., return_exceptions=True)``: the finished item keeps its value, each item
    that could not run holds the WorkerLost, and the job is cancelled all the same."""
    m = fault_mesh(workers=1)
    client = m.client(output=False)
    marker = tmp_path / "pids"

    @accelerate(client, timeout=3)
    def step(path, i):
        import os
        import time
        if i == 0:
            return "quick"
        with open(path, "a") as fh:
            fh.write(f"{os.getpid()}\n")
        time.sleep(60)

    box: dict = {}

    def call():
        box["v"] = step.map([(str(marker), i) for i in range(3)], return_exceptions=True)

    th = threading.Thread(target=call, daemon=True)
    th.start()
    wait_for(lambda: _pids(marker), 20, "the slow item to start")
    os.kill(m.procs[1].p.pid, signal.SIGKILL)
    th.join(45)
    assert not th.is_alive(), "the map still waits with no worker alive"
    first, second, third = box["v"]
    assert first == "quick"
    assert type(second) is WorkerLost and second is third, box["v"]
    assert "2 of 3 task(s)" in str(second) and "timeout=3s" in str(second)
    job_id = str(second).split("of job ")[1].split()[0]
    wait_for(lambda: _job_state(client, job_id) == "cancelled", 10, lambda: client.status(job_id))
