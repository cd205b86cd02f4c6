"""Hardware-aware placement with real processes and fake GPUs (the GPUMESH_FAKE_GPUS hook).

One coordinator and two workers that believe they have GPUs:

* ``a100``: one "NVIDIA A100-SXM4-80GB" (score 5000) and one CPU slot;
* ``rtx``:  two "NVIDIA GeForce RTX 4090" (score 3000 each) whose free memory is read from
  a file the tests rewrite, and one CPU slot.

A task learns where it ran from its own environment: ``CUDA_VISIBLE_DEVICES`` (set by the
worker for its slot) indexes the worker's fake-GPU list, which the task inherits.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import httpx
import pytest

from gpumesh import Unsatisfiable, accelerate, wire
from tests.conftest import Mesh, Proc, wait_for

A100 = {"name": "NVIDIA A100-SXM4-80GB", "memory_total_mb": 81920, "memory_free_mb": 80000, "score": 5000}
RTX = {"name": "NVIDIA GeForce RTX 4090", "memory_total_mb": 24564, "memory_free_mb": 20000, "score": 3000}


def rtx_gpus(free0: int, free1: int) -> str:
    return json.dumps([dict(RTX, memory_free_mb=free0), dict(RTX, memory_free_mb=free1)])


def where() -> tuple[str, str]:
    """(model of the GPU this task was given or "cpu", CUDA_VISIBLE_DEVICES)."""
    import json as _json
    import os as _os
    cvd = _os.environ.get("CUDA_VISIBLE_DEVICES")
    raw = _os.environ.get("GPUMESH_FAKE_GPUS", "[]")
    if raw.startswith("@"):
        with open(raw[1:]) as fh:
            raw = fh.read()
    gpus = _json.loads(raw)
    return (gpus[int(cvd)]["name"] if cvd else "cpu"), cvd


def start_worker(m: Mesh, name: str, fake: str, *args: str) -> Proc:
    env = dict(m.env, GPUMESH_FAKE_GPUS=fake)
    proc = Proc(["join", m.url, *args], env, m.root / f"{name}.log")
    m.procs.append(proc)
    return proc


@pytest.fixture(scope="module")
def hw(tmp_path_factory):
    root = tmp_path_factory.mktemp("hardware")
    m = Mesh(root)
    m.start()
    m.rtx_file = root / "rtx.json"
    m.rtx_file.write_text(rtx_gpus(20000, 1000))
    m.a100 = start_worker(m, "a100", json.dumps([A100]))
    m.wait_alive(1, m.a100)
    m.rtx = start_worker(m, "rtx", f"@{m.rtx_file}", "--cpu-slots", "1")
    m.wait_alive(2, m.rtx)
    # the benchmark runs after joining; wait for every worker's scores
    wait_for(lambda: all(w.get("scores") for w in m.workers()), 60, "the scores")
    yield m
    m.stop()


@pytest.fixture
def client(hw):
    c = hw.client(output=False)
    yield c
    c.close()


def worker_by_gpu(hw, name: str) -> dict:
    return next(w for w in hw.workers() if w.get("gpus") and w["gpus"][0]["name"] == name)


# ---------------------------------------------------------------- detection, slots ---

def test_workers_register_their_gpus_slots_and_scores(hw):
    a = worker_by_gpu(hw, A100["name"])
    assert a["device"] == "GPU" and a["device_name"] == A100["name"]
    assert [(g["index"], g["memory_total_mb"], g["memory_free_mb"]) for g in a["gpus"]] == [(0, 81920, 80000)]
    assert a["slot_list"] == [{"id": 0, "kind": "cuda", "gpu": 0}, {"id": 1, "kind": "cpu"}]
    assert a["slots"] == 2
    assert a["scores"]["cuda:0"] == 5000.0 and a["scores"]["cpu"] > 0 and a["score"] == 5000.0
    r = worker_by_gpu(hw, RTX["name"])
    assert [g["memory_free_mb"] for g in r["gpus"]] == [20000, 1000]
    assert [s["kind"] for s in r["slot_list"]] == ["cuda", "cuda", "cpu"]
    assert r["scores"]["cuda:0"] == r["scores"]["cuda:1"] == 3000.0
    # the join output: joined first, the scores once measured
    out = hw.a100.output()
    assert "[worker] slots: 1 GPU (cuda:0 NVIDIA A100-SXM4-80GB (81920 MiB)), 1 CPU" in out
    assert out.index("[worker] joined mesh as") < out.index(
        "[worker] device=GPU NVIDIA A100-SXM4-80GB (cuda:0) score=5000.000 GFLOP/s")
    assert "[worker] device=CPU " in out


def test_pool_api(client):
    devices = client.devices()
    assert [(d["name"], d["device"], d["score"]) for d in devices[:3]] == [
        (A100["name"], "cuda:0", 5000.0), (RTX["name"], "cuda:0", 3000.0), (RTX["name"], "cuda:1", 3000.0)]
    assert [d["kind"] for d in devices[3:]] == ["cpu", "cpu"]
    assert client.device_count() == 1  # machines: both workers run on this one
    assert client.gpu_count() == 3
    # the two workers share this machine's CPU: counted once, at its best measured score
    cpu_score = max(d["score"] for d in devices if d["kind"] == "cpu")
    assert client.total_score() == pytest.approx(5000 + 3000 + 3000 + cpu_score, abs=0.01)
    best = client.auto_device()
    assert (best["name"], best["device"], best["memory_total_mb"]) == (A100["name"], "cuda:0", 81920)


def test_devices_and_workers_commands(hw):
    env = dict(hw.env, GPUMESH_URL=hw.url)
    r = subprocess.run([sys.executable, "-m", "gpumesh", "devices"], env=env, capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    rows = [ln for ln in r.stdout.splitlines() if "busy]" in ln]
    assert len(rows) == 5
    assert rows[0].split()[:4] == ["GPU", "cuda:0", "NVIDIA", "A100-SXM4-80GB"]
    assert "80000/81920 MiB free" in rows[0] and "score=5000.000" in rows[0]
    assert sum(1 for row in rows if row.startswith("  CPU  cpu")) == 2
    r = subprocess.run([sys.executable, "-m", "gpumesh", "workers"], env=env, capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert "score=5000.000" in r.stdout and "score=3000.000" in r.stdout
    # each worker's slots, from what it registered: a mixed pool at a glance
    by_score = {ln.split("score=")[1].split()[0]: ln for ln in r.stdout.splitlines() if "score=" in ln}
    assert by_score["5000.000"].endswith("[alive]  slots: 1 GPU, 1 CPU")
    assert by_score["3000.000"].endswith("[alive]  slots: 2 GPU, 1 CPU")


# ---------------------------------------------------------------- placement ----------

def test_gpu_model_and_kind_select_slots(client):
    run = accelerate(client)(where)
    assert accelerate(client, gpu="A100")(where)() == (A100["name"], "0")
    assert run.to("RTX 4090")()[0] == RTX["name"]
    assert run.to("A10").__call__ is not None  # building it is fine; running it is not:
    with pytest.raises(Unsatisfiable):
        run.to("A10")()
    assert run.to("cpu")() == ("cpu", "")        # a CPU slot of a GPU machine sees no GPU
    assert run.to("cuda")()[1] in ("0", "1")
    # nothing asked: the strongest free slot - once every worker is back in its lease poll
    # (a slot still posting its last result is not free yet, so give them a moment)
    picked = []
    for _ in range(5):
        time.sleep(0.5)
        picked.append(run()[0])
        if picked[-1] == A100["name"]:
            break
    assert picked[-1] == A100["name"], picked


def test_two_gpus_run_two_tasks_at_once(client):
    @accelerate(client, gpu="RTX 4090")
    def hold(i):
        import os as _os
        import time as _t
        t0 = _t.time()
        _t.sleep(1.5)
        return _os.environ["CUDA_VISIBLE_DEVICES"], _os.environ.get("CUDA_DEVICE_ORDER"), t0, _t.time()

    got = hold.map([0, 1])
    assert sorted(g[0] for g in got) == ["0", "1"]
    assert {g[1] for g in got} == {"PCI_BUS_ID"}
    (s0, e0), (s1, e1) = [(g[2], g[3]) for g in got]
    assert max(s0, s1) < min(e0, e1), "the two tasks did not run at the same time"


def test_vram_hint_uses_the_free_memory_last_reported(hw, client):
    hw.rtx_file.write_text(rtx_gpus(20000, 1000))
    run = accelerate(client, gpu="RTX 4090")(where)
    got = run.map([{"gpu_memory_mb": 5000}, {"gpu_memory_mb": 5000}, {"gpu_memory_mb": 500}])
    assert [g[1] for g in got[:2]] == ["0", "0"]   # GPU 1 has only 1000 MiB free
    assert got[2][0] == RTX["name"]


def test_vram_hint_above_every_card_is_unsatisfiable(client):
    run = accelerate(client, gpu="cuda")(where)
    with pytest.raises(Unsatisfiable) as e:
        run.map([{"gpu_memory_mb": 90000}])
    msg = str(e.value)
    assert "gpu_memory_mb=90000" in msg
    assert "NVIDIA A100-SXM4-80GB (81920 MiB, 80000 MiB free)" in msg
    assert "NVIDIA GeForce RTX 4090 (24564 MiB" in msg


def test_task_waits_for_free_memory_then_runs(hw, client):
    hw.rtx_file.write_text(rtx_gpus(20000, 1000))
    run = accelerate(client, gpu="RTX 4090")(where)
    out: list = []
    th = threading.Thread(target=lambda: out.append(run.map([{"gpu_memory_mb": 22000}])), daemon=True)
    th.start()
    th.join(3.0)
    assert th.is_alive(), "the task ran on a GPU without enough free memory"
    hw.rtx_file.write_text(rtx_gpus(20000, 23000))   # GPU 1 frees memory; the heartbeat says so
    # The heartbeat that reports the memory answers the worker's open lease poll with
    # the task (tests/unit/test_heartbeat_wake.py): seconds. The bound stays generous:
    # a loaded CI run once took past 15 s here, for a cause not found.
    th.join(30)
    assert not th.is_alive()
    assert out == [[(RTX["name"], "1")]]
    hw.rtx_file.write_text(rtx_gpus(20000, 1000))


def test_unsatisfiable_requirements_raise_at_call_time(client):
    for opts in ({"gpu": "H100"}, {"memory": "100TB"}, {"cores": 4096}, {"gpu_memory": "100GB"},
                 {"gpu": "cpu", "gpu_memory": "1GB"}):
        f = accelerate(client, **opts)(where)
        t0 = time.monotonic()
        with pytest.raises(Unsatisfiable) as e:
            f()
        assert time.monotonic() - t0 < 5
        assert "the pool has 2 alive worker(s)" in str(e.value), str(e.value)
    assert accelerate(client, cores=1, memory="1GB")(where)()  # what the pool has runs


def test_submit_validates_requirements_at_the_boundary(hw):
    def post(meta_extra):
        fn = wire.dumps(where, code=True)
        meta = {"job_id": "abcdef123456", "kind": "function", "fn": fn.sha256(), "fn_inline": True,
                "n_tasks": 1, **meta_extra}
        chunks, size = wire.pack_frames([json.dumps(meta).encode(), fn, wire.dumps(((), {}))])
        return httpx.post(f"{hw.url}/v1/jobs", content=b"".join(bytes(c) for c in chunks),
                          headers={"authorization": f"Bearer {hw.token}",
                                   "content-type": "application/x-gpumesh-frames"}, timeout=10)
    for extra, field in [({"require": {"memory": "16GB"}}, "require.memory"),
                         ({"require": {"gpu": "cuda:3"}}, "gpu"),
                         ({"require": {"tpu": 1}}, "require.tpu"),
                         ({"require": "A100"}, "require"),
                         ({"gpu_memory_mb": [-5]}, "gpu_memory_mb"),
                         ({"gpu_memory_mb": [1, 2]}, "gpu_memory_mb")]:
        r = post(extra)
        assert r.status_code == 400, (extra, r.text)
        assert field in r.json()["message"], (extra, r.json())
    r = post({"require": {"gpu": "TPU v5"}})
    assert r.status_code == 409 and r.json()["error"] == "unsatisfiable"


def _hold_where(seconds):
    """Sleep, then say where this task ran (a task that keeps its slot busy)."""
    import time as _t
    _t.sleep(seconds)
    return where()


def test_hinted_map_items_run_only_on_gpus(client):
    # 5 free slots (3 GPUs, 2 CPUs) and 5 tasks that each fit every GPU: without the hint
    # two would start on the CPU slots at once; with it they wait for a GPU.
    got = accelerate(client)(_hold_where).map([{"seconds": 1.0, "gpu_memory_mb": 500}] * 5)
    assert all(model != "cpu" for model, _ in got), got
    assert {model for model, _ in got} <= {A100["name"], RTX["name"]}


def test_hinted_single_call_waits_for_a_busy_gpu(client):
    run = accelerate(client)(_hold_where)
    busy: list = []
    th = threading.Thread(target=lambda: busy.append(run.map([{"seconds": 5.0, "gpu_memory_mb": 500}] * 3)),
                          daemon=True)
    th.start()
    deadline = time.monotonic() + 20
    while sum(d["busy"] for d in client.devices() if d["kind"] == "cuda") < 3:
        assert time.monotonic() < deadline, "the three GPUs never got busy"
        time.sleep(0.1)
    # every GPU is busy and both CPU slots are free: the call waits for a GPU
    model, cvd = run(0.0, gpu_memory_mb=500)
    assert model != "cpu" and cvd in ("0", "1")
    th.join(30)
    assert len(busy) == 1 and all(m != "cpu" for m, _ in busy[0])


def test_hinted_single_call_larger_than_every_gpu_is_unsatisfiable(client):
    t0 = time.monotonic()
    with pytest.raises(Unsatisfiable) as e:
        accelerate(client)(where)(gpu_memory_mb=90000)
    assert time.monotonic() - t0 < 5
    msg = str(e.value)
    assert "gpu_memory_mb=90000" in msg and "the pool has 2 alive worker(s)" in msg
    assert "NVIDIA A100-SXM4-80GB (81920 MiB, 80000 MiB free)" in msg


ECHO = """\
import json, os, sys
p = json.load(sys.stdin)
print(json.dumps({"payload": p, "cvd": os.environ.get("CUDA_VISIBLE_DEVICES")}))
"""


def test_script_payload_hints_place_tasks_and_reach_the_script(hw, client, tmp_path):
    hw.rtx_file.write_text(rtx_gpus(20000, 1000))
    script = tmp_path / "echo.py"
    script.write_text(ECHO)
    payloads = [{"x": 1, "gpu_memory_mb": 5000, "cost": 4}, {"x": 2, "gpu_memory_mb": 30000},
                {"x": 3}]
    job_id = client.submit(name="hinted", script=str(script), payloads=payloads)
    got = client.wait(job_id, timeout=60)
    assert [g["result"]["payload"] for g in got] == payloads          # unchanged
    assert got[0]["result"]["cvd"] in ("0", "1")                      # a GPU with 5000 MiB free
    a100 = worker_by_gpu(hw, A100["name"])["id"]
    assert got[1]["worker"] == a100 and got[1]["result"]["cvd"] == "0"  # only the A100 has 30000
    assert [t["cost"] for t in client.status(job_id)["tasks"]] == [4.0, 1.0, 1.0]
    with pytest.raises(Unsatisfiable) as e:
        client.submit(script=str(script), payloads=[{"gpu_memory_mb": 90000}])
    assert "gpu_memory_mb=90000" in str(e.value) and "the pool has 2 alive worker(s)" in str(e.value)
    with pytest.raises(ValueError, match="payload #1: 'cost' is a scheduling hint"):
        client.submit(script=str(script), payloads=[{}, {"cost": "high"}])


# ---------------------------------------------------------------- no worker alive ----

def test_no_worker_alive_runs_locally_only_if_this_machine_can(make_mesh, capsys):
    m = make_mesh(workers=0)
    c = m.client(output=False)
    assert accelerate(c, cores=1, memory="1MB")(where)() == ("cpu", os.environ.get("CUDA_VISIBLE_DEVICES"))
    with pytest.raises(Unsatisfiable) as e:
        accelerate(c, gpu="NoSuchGPU 9000")(where)()
    assert "no worker is alive in the mesh at" in str(e.value)
    assert "this machine cannot run where (gpu='NoSuchGPU 9000')" in str(e.value)
    c.close()


def test_no_worker_alive_a_hinted_call_runs_locally_only_on_a_gpu(make_mesh):
    from gpumesh.worker.device import detect
    if detect()["gpus"]:
        pytest.skip("this machine has a GPU: a hinted call may run here")
    m = make_mesh(workers=0)
    c = m.client(output=False)
    run = accelerate(c)(where)
    with pytest.raises(Unsatisfiable) as e:
        run(gpu_memory_mb=100)
    assert "no worker is alive in the mesh at" in str(e.value)
    assert "this machine cannot run where (gpu_memory_mb=100): its cpu has no GPU" in str(e.value)
    assert run(gpu_memory_mb=0)[0] == "cpu"                    # 0 MiB is no hint
    c.close()


# ---------------------------------------------------------------- join flags ---------

def test_cpu_slots_flag_and_its_alias(make_mesh):
    m = make_mesh(workers=0)
    for i, flag in enumerate(("--cpu-slots", "--slots")):
        proc = Proc(["join", m.url, flag, "3"], m.env, m.root / f"w{i}.log")
        m.procs.append(proc)
        m.wait_alive(i + 1, proc)
    assert sorted(w["slots"] for w in m.workers()) == [3, 3]
    assert all([s["kind"] for s in w["slot_list"]] == ["cpu"] * 3 for w in m.workers())
    r = subprocess.run([sys.executable, "-m", "gpumesh", "join", m.url, "--cpu-slots", "0"],
                       env=dict(m.env, GPUMESH_FAKE_GPUS="[]"), capture_output=True, text=True, timeout=30)
    assert r.returncode == 2  # a usage error on this machine
    assert r.stderr.strip().splitlines() == ["Error: --cpu-slots 0 leaves this worker no slot: it has no GPU"]


def test_gpu_only_worker(make_mesh):
    m = make_mesh(workers=0)
    proc = Proc(["join", m.url, "--cpu-slots", "0"], dict(m.env, GPUMESH_FAKE_GPUS=json.dumps([A100])),
                m.root / "gpu-only.log")
    m.procs.append(proc)
    m.wait_alive(1, proc)
    (w,) = m.workers()
    assert w["slot_list"] == [{"id": 0, "kind": "cuda", "gpu": 0}]
    c = m.client(output=False)
    assert accelerate(c)(where)() == (A100["name"], "0")
    with pytest.raises(Unsatisfiable):
        accelerate(c, gpu="cpu")(where)()
    c.close()
