"""A worker's GPUs without a GPU: the fake-GPU hook, CUDA_VISIBLE_DEVICES, free-memory
refresh through a fake NVML, the per-device benchmark and the background scorer."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import types

import pytest

from gpumesh.worker import bench, device, scoring
from gpumesh.worker.agent import WorkerAgent

TWO = [{"name": "NVIDIA A100-SXM4-80GB", "memory_total_mb": 81920, "memory_free_mb": 80000, "score": 5000},
       {"name": "NVIDIA GeForce RTX 4090", "memory_total_mb": 24564, "memory_free_mb": 2000,
        "gflops": 1000.0, "bandwidth_gbps": 100.0}]


@pytest.fixture
def fake_env(monkeypatch):
    monkeypatch.setenv(device.FAKE_GPUS_ENV, json.dumps(TWO))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def test_fake_gpus_replace_nvml(fake_env, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # would fail: the hook must not need it
    info = device.detect()
    assert info["gpus"] == [
        {"index": 0, "name": "NVIDIA A100-SXM4-80GB", "memory_total_mb": 81920,
         "memory_free_mb": 80000, "driver": "fake"},
        {"index": 1, "name": "NVIDIA GeForce RTX 4090", "memory_total_mb": 24564,
         "memory_free_mb": 2000, "driver": "fake"}]
    assert info["device"] == "GPU" and info["device_name"] == "NVIDIA A100-SXM4-80GB"


def test_fake_gpus_from_a_file_are_reread(tmp_path, monkeypatch):
    path = tmp_path / "gpus.json"
    path.write_text(json.dumps(TWO))
    monkeypatch.setenv(device.FAKE_GPUS_ENV, f"@{path}")
    mon = device.GpuMonitor([0, 1])
    assert mon.free_mb() == {0: 80000, 1: 2000}
    changed = [dict(TWO[0]), dict(TWO[1], memory_free_mb=20000)]
    path.write_text(json.dumps(changed))
    assert mon.free_mb() == {0: 80000, 1: 20000}
    assert device.GpuMonitor([1]).free_mb() == {1: 20000}
    assert device.GpuMonitor([]).free_mb() == {}
    path.write_text("not json")
    assert mon.free_mb() == {}                      # unreadable: nothing, never an exception


def test_unreadable_fake_gpus_are_ignored(monkeypatch):
    monkeypatch.setenv(device.FAKE_GPUS_ENV, "[not json")
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setattr(device.shutil, "which", lambda name: None)
    assert device.nvidia_gpus() == []


@pytest.mark.parametrize("cvd, indices", [
    (None, [0, 1, 2]), ("", []), ("-1", []), ("1", [1]), ("2,0", [2, 0]), ("0,-1,2", [0]),
    ("7", []), ("GPU-5b6c7d8e", [0, 1, 2]),
])
def test_visible(cvd, indices):
    gpus = [{"index": i, "name": f"g{i}"} for i in range(3)]
    env = {} if cvd is None else {"CUDA_VISIBLE_DEVICES": cvd}
    assert [g["index"] for g in device.visible(gpus, env)] == indices


def test_monitor_keeps_nvml_open_and_falls_back(monkeypatch):
    calls = {"init": 0, "shutdown": 0}

    class Mem:
        def __init__(self, free):
            self.free, self.total = free * 2**20, 0

    free = {0: 100, 1: 200}
    fake = types.SimpleNamespace(
        nvmlInit=lambda: calls.__setitem__("init", calls["init"] + 1),
        nvmlShutdown=lambda: calls.__setitem__("shutdown", calls["shutdown"] + 1),
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetMemoryInfo=lambda h: Mem(free[h]))
    monkeypatch.delenv(device.FAKE_GPUS_ENV, raising=False)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    mon = device.GpuMonitor([0, 1])
    assert mon.free_mb() == {0: 100, 1: 200}
    free[1] = 50
    assert mon.free_mb() == {0: 100, 1: 50}
    assert calls == {"init": 1, "shutdown": 0}       # initialised once, not per heartbeat
    mon.close()
    assert calls["shutdown"] == 1

    def broken(h):
        raise RuntimeError("GPU fell off the bus")
    fake.nvmlDeviceGetMemoryInfo = broken
    monkeypatch.setattr(device, "_nvidia_smi_gpus", lambda: [
        {"index": 0, "name": "x", "memory_total_mb": 1, "memory_free_mb": 7, "driver": "d"}])
    assert mon.free_mb() == {0: 7}                   # nvidia-smi instead


def test_measure_uses_fake_scores_and_cpu(fake_env):
    out = bench.measure([0, 1], budget_s=0.5)
    assert set(out) == {"cpu", "cuda:0", "cuda:1"}
    assert out["cuda:0"] == {"gflops": 0.0, "bandwidth_gbps": 0.0, "score": 5000.0, "backend": "fake"}
    assert out["cuda:1"]["score"] == round(1000 * 0.7 + 100 * 0.3, 3) == 730.0
    cpu = out["cpu"]
    assert cpu["score"] == round(cpu["gflops"] * 0.7 + cpu["bandwidth_gbps"] * 0.3, 3) > 0
    assert cpu["backend"] == "numpy"


def test_measure_without_gpu_libraries_leaves_gpus_unmeasured(monkeypatch):
    monkeypatch.delenv(device.FAKE_GPUS_ENV, raising=False)
    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.setitem(sys.modules, "cupy", None)
    out = bench.measure([0], budget_s=0.3)
    assert set(out) == {"cpu"}


def test_bench_process_prints_one_json_line_within_budget(fake_env):
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "gpumesh.worker.bench", "--gpus", "0,1"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip())
    assert out["cuda:0"]["score"] == 5000.0 and out["cpu"]["score"] > 0
    assert time.monotonic() - t0 < 10   # 3 s of measurement at most, plus the interpreter


def test_bench_env_numbers_cuda_devices_like_nvml(monkeypatch):
    monkeypatch.setenv("GPUMESH_TOKEN", "secret")
    env = scoring.bench_env([2, 5])
    assert env["CUDA_VISIBLE_DEVICES"] == "2,5" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert "GPUMESH_TOKEN" not in env


def test_describe_lines():
    info = {"cpu": "AMD EPYC", "gpus": [{"index": 0, "name": "NVIDIA H200"}]}
    assert scoring.describe({"cpu": {"score": 132.65}, "cuda:0": {"score": 40000}}, info) == [
        "device=GPU NVIDIA H200 (cuda:0) score=40000.000 GFLOP/s",
        "device=CPU AMD EPYC score=132.650 GFLOP/s"]


# ---------------------------------------------------------------- the scorer ---------

def test_scorer_reports_when_idle():
    got = []
    s = scoring.Scorer([], False, got.append)
    s.start()
    assert s.done.wait(30), "no scores within 30 s"
    assert list(got[0]) == ["cpu"] and got[0]["cpu"]["score"] > 0
    assert s.tries == 1
    s.close()


class SlowScorer(scoring.Scorer):
    """A 'benchmark' that never ends, so the test can watch it being interrupted."""

    def command(self):
        return [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"]


def test_scorer_never_runs_while_a_task_runs():
    s = SlowScorer([], False, lambda r: None)
    s.task_started()                       # a task is running before the scorer starts
    s.start()
    time.sleep(scoring.QUIET_S * 3)
    assert s._proc is None and s.tries == 0
    s.task_finished()
    deadline = time.monotonic() + 10
    while s._proc is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc = s._proc
    assert proc is not None and s.tries == 1
    t0 = time.monotonic()
    s.task_started()                       # a task arrives: the benchmark dies at once
    assert proc.wait(2) == -9
    assert time.monotonic() - t0 < 1.0
    time.sleep(scoring.QUIET_S * 3)
    assert s._proc is None or s._proc is not proc
    assert s.tries == 1                    # and does not start again while the task runs
    s.task_finished()
    s.close()


def test_agent_slots_and_their_environment(fake_env, tmp_path):
    info = device.detect()
    agent = WorkerAgent("http://127.0.0.1:9", "t", slots=2, info=info, cache_dir=tmp_path, bench=False)
    try:
        assert agent.slot_list == [{"id": 0, "kind": "cuda", "gpu": 0}, {"id": 1, "kind": "cuda", "gpu": 1},
                                   {"id": 2, "kind": "cpu"}, {"id": 3, "kind": "cpu"}]
        assert agent.slots == 4
        assert agent._slot_env[0] == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "0"}
        assert agent._slot_env[1]["CUDA_VISIBLE_DEVICES"] == "1"
        assert agent._slot_env[2] == {"CUDA_VISIBLE_DEVICES": ""}   # CPU slots see no GPU
        state = agent._device_state()
        assert state == {"gpu_free_mb": {"0": 80000, "1": 2000}}
        agent._on_scores({"cpu": {"score": 10.0}, "cuda:0": {"score": 5000.0}})
        assert agent.info["scores"] == {"cpu": 10.0, "cuda:0": 5000.0} and agent.info["score"] == 5000.0
        assert agent._device_state()["scores"] == {"cpu": 10.0, "cuda:0": 5000.0}
    finally:
        agent.executor.close()
    with pytest.raises(ValueError, match="slot"):
        WorkerAgent("http://127.0.0.1:9", "t", slots=0, info={"gpus": []}, cache_dir=tmp_path, bench=False)
