"""Unit tests for gpumesh.worker.device and gpumesh.worker.bench."""

import os
import platform
import subprocess
import sys
import time

import pytest

from gpumesh.worker import bench, device

KEYS = {"hostname", "user", "platform", "python", "cpu", "cores", "ram_mb",
        "gpus", "mps", "device", "device_name"}
GPU_KEYS = {"index", "name", "memory_total_mb", "memory_free_mb", "driver"}


# ---------------------------------------------------------------- detect()

def test_detect_keys_and_types():
    info = device.detect()
    assert set(info) == KEYS
    for key in ("hostname", "user", "platform", "python", "cpu", "device", "device_name"):
        assert isinstance(info[key], str), key
    assert isinstance(info["cores"], int)
    assert isinstance(info["ram_mb"], int)
    assert isinstance(info["gpus"], list)
    assert isinstance(info["mps"], bool)
    assert info["platform"] == platform.system()
    assert info["python"] == platform.python_version()
    assert info["cpu"]
    assert info["device"] in ("GPU", "CPU")
    for gpu in info["gpus"]:
        assert set(gpu) == GPU_KEYS
        assert isinstance(gpu["index"], int)
        assert isinstance(gpu["memory_total_mb"], int)
    if info["gpus"]:
        assert info["device"] == "GPU"
        assert info["device_name"] == info["gpus"][0]["name"]
    elif not info["mps"]:
        assert info["device"] == "CPU"
        assert info["device_name"] == info["cpu"]


def test_cores_is_cpu_count():
    assert device.detect()["cores"] == os.cpu_count()


@pytest.mark.skipif(sys.platform != "linux", reason="Linux only")
def test_ram_positive_on_linux():
    ram = device.ram_mb()
    assert ram > 0
    assert device.detect()["ram_mb"] == ram


@pytest.mark.skipif(sys.platform != "linux", reason="Linux only")
def test_ram_without_psutil_uses_sysconf(monkeypatch):
    monkeypatch.setitem(sys.modules, "psutil", None)  # import psutil -> ImportError
    expected = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1024 * 1024)
    assert device.ram_mb() == expected > 0


@pytest.mark.skipif(sys.platform != "linux", reason="Linux only")
def test_cpu_model_matches_proc_cpuinfo():
    with open("/proc/cpuinfo") as f:
        names = [line.split(":", 1)[1].strip() for line in f
                 if line.split(":", 1)[0].strip() == "model name"]
    if names and names[0]:
        assert device.cpu_model() == names[0]
    else:
        assert device.cpu_model()


def test_device_cpu_without_gpus(monkeypatch):
    monkeypatch.setattr(device, "nvidia_gpus", lambda: [])
    info = device.detect()
    assert info["gpus"] == []
    assert info["device"] == "CPU"
    assert info["device_name"] == info["cpu"] == device.cpu_model()


def test_device_gpu_when_gpus(monkeypatch):
    gpu = {"index": 0, "name": "NVIDIA H200", "memory_total_mb": 143771,
           "memory_free_mb": 143000, "driver": "550.54.15"}
    monkeypatch.setattr(device, "nvidia_gpus", lambda: [gpu])
    info = device.detect()
    assert info["device"] == "GPU"
    assert info["device_name"] == "NVIDIA H200"
    assert info["gpus"] == [gpu]


def test_detect_survives_gpu_exception(monkeypatch):
    def boom():
        raise RuntimeError("driver exploded")
    monkeypatch.setattr(device, "nvidia_gpus", boom)
    info = device.detect()
    assert info["gpus"] == [] and info["device"] == "CPU"


# ---------------------------------------------------------- nvidia_gpus()

def test_nvidia_gpus_no_pynvml_no_smi(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setattr(device.shutil, "which", lambda name: None)
    assert device.nvidia_gpus() == []


def test_nvidia_gpus_falls_back_to_smi(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setattr(device.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    calls = []

    def fake_run(cmd, **kw):
        calls.append((cmd, kw))
        return subprocess.CompletedProcess(
            cmd, 0, stdout="0, NVIDIA A100-SXM4-80GB, 81920, 80000, 550.54.15\n", stderr="")
    monkeypatch.setattr(device.subprocess, "run", fake_run)
    gpus = device.nvidia_gpus()
    assert gpus == [{"index": 0, "name": "NVIDIA A100-SXM4-80GB",
                     "memory_total_mb": 81920, "memory_free_mb": 80000,
                     "driver": "550.54.15"}]
    (cmd, kw), = calls
    assert cmd[1:] == ["--query-gpu=index,name,memory.total,memory.free,driver_version",
                       "--format=csv,noheader,nounits"]
    assert kw["timeout"] == 5


@pytest.mark.parametrize("exc", [FileNotFoundError("nvidia-smi"),
                                 subprocess.TimeoutExpired("nvidia-smi", 5)])
def test_nvidia_smi_failure_means_no_gpus(monkeypatch, exc):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setattr(device.shutil, "which", lambda name: "/usr/bin/nvidia-smi")

    def fake_run(cmd, **kw):
        raise exc
    monkeypatch.setattr(device.subprocess, "run", fake_run)
    assert device.nvidia_gpus() == []


def test_nvidia_smi_nonzero_exit_means_no_gpus(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setattr(device.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(device.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(
        cmd, 9, stdout="", stderr="NVIDIA-SMI has failed"))
    assert device.nvidia_gpus() == []


def test_nvml_path(monkeypatch):
    """A fake pynvml: every GPU enumerated, bytes names decoded, MiB units, shutdown called."""
    import types

    class Mem:
        def __init__(self, total, free):
            self.total, self.free = total, free

    state = {"shutdown": False}
    names = [b"NVIDIA H100 80GB HBM3", "NVIDIA L4"]
    mems = [Mem(81559 * 2**20, 80000 * 2**20 + 123), Mem(23034 * 2**20, 22000 * 2**20)]
    fake = types.SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: state.update(shutdown=True),
        nvmlSystemGetDriverVersion=lambda: b"550.54.15",
        nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetName=lambda h: names[h],
        nvmlDeviceGetMemoryInfo=lambda h: mems[h],
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert device.nvidia_gpus() == [
        {"index": 0, "name": "NVIDIA H100 80GB HBM3", "memory_total_mb": 81559,
         "memory_free_mb": 80000, "driver": "550.54.15"},
        {"index": 1, "name": "NVIDIA L4", "memory_total_mb": 23034,
         "memory_free_mb": 22000, "driver": "550.54.15"},
    ]
    assert state["shutdown"]


def test_nvml_init_failure_falls_back_to_smi(monkeypatch):
    import types

    def fail():
        raise RuntimeError("NVML Shared Library Not Found")
    monkeypatch.setitem(sys.modules, "pynvml", types.SimpleNamespace(nvmlInit=fail))
    monkeypatch.setattr(device.shutil, "which", lambda name: None)
    assert device.nvidia_gpus() == []


# ------------------------------------------------------ parse_nvidia_smi()

def test_parse_nvidia_smi_sample():
    text = "0, NVIDIA A100-SXM4-80GB, 81920, 80000, 550.54.15"
    assert device.parse_nvidia_smi(text) == [{
        "index": 0,
        "name": "NVIDIA A100-SXM4-80GB",
        "memory_total_mb": 81920,
        "memory_free_mb": 80000,
        "driver": "550.54.15",
    }]


def test_parse_nvidia_smi_multi_and_junk():
    text = ("0, NVIDIA A100-SXM4-80GB, 81920, 80000, 550.54.15\n"
            "\n"
            "1, NVIDIA GH200 480GB, [N/A], [N/A], 550.54.15\n"
            "No devices were found\n"
            "x, bad, 1, 2, 3\n")
    gpus = device.parse_nvidia_smi(text)
    assert [g["index"] for g in gpus] == [0, 1]
    assert gpus[1] == {"index": 1, "name": "NVIDIA GH200 480GB", "memory_total_mb": 0,
                       "memory_free_mb": 0, "driver": "550.54.15"}
    assert device.parse_nvidia_smi("") == []


# ----------------------------------------------------------------- score()

def _check_score(result):
    assert set(result) == {"gflops", "bandwidth_gbps", "score"}
    assert all(isinstance(v, float) for v in result.values())
    assert result["gflops"] > 0
    assert result["bandwidth_gbps"] > 0
    assert result["score"] > 0
    expected = result["gflops"] * 0.7 + result["bandwidth_gbps"] * 0.3
    assert result["score"] == round(expected, 3)
    assert abs(result["score"] - expected) <= 0.0005 + 1e-9


def test_score_values_and_time():
    import numpy  # noqa: F401  -- import cost is excluded from the time budget

    t0 = time.perf_counter()
    result = bench.score()
    elapsed = time.perf_counter() - t0
    _check_score(result)
    assert elapsed < 2.0
    # numbers a real NumPy CPU run cannot be below
    assert result["gflops"] > 0.1
    assert result["bandwidth_gbps"] > 0.1


def test_score_respects_budget():
    t0 = time.perf_counter()
    _check_score(bench.score(0.05))
    assert time.perf_counter() - t0 < 0.05 * 2 + 0.25  # slack for allocation on a busy host


def test_score_without_numpy(monkeypatch):
    monkeypatch.setitem(sys.modules, "numpy", None)  # import numpy -> ImportError
    t0 = time.perf_counter()
    result = bench.score(0.1)
    assert time.perf_counter() - t0 < 2.0
    _check_score(result)
    assert result["gflops"] < 10  # a pure-Python loop is nowhere near BLAS speed


def test_a_rate_is_the_fastest_repetition_not_the_mean():
    """Repetitions slowed by another process (every other one here takes 20x longer) do
    not lower the rate: it is the fastest repetition's (bench._best_rate)."""
    durations = iter([0.0] + [0.001, 0.02] * 50)  # the first call is the warm-up

    def op():
        time.sleep(next(durations))

    rate = bench._best_rate(op, 2e9 * 0.001, time.perf_counter() + 0.15)
    # 2e9 * 1 ms of work in the fastest repetition (~1 ms, plus sleep's overshoot): ~2
    assert 1.0 < rate <= 2.0, rate


def test_a_rate_times_at_least_one_repetition():
    calls = []
    rate = bench._best_rate(lambda: calls.append(1), 1e9, deadline=0.0)
    assert len(calls) == 2 and rate > 0  # the warm-up and one timed repetition
