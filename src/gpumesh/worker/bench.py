"""Quick compute score of each device of a worker: its CPU and each of its GPUs.

``score = gflops * 0.7 + bandwidth_gbps * 0.3``: a relative, unbounded number for
ranking devices against each other; it is not a unit of anything (see docs/hardware.md).
The CPU is measured with NumPy (a float32 matmul and a memory copy), a GPU with torch or,
without torch, CuPy (the same two operations on the device); Apple's MPS with torch.

A worker runs this module as a separate process (``python -m gpumesh.worker.bench
--gpus 0,1``), after it has joined and only while no task runs, and kills it the moment a
task arrives: the worker agent itself never imports torch nor creates a CUDA context.
The process prints one JSON object: ``{"cpu": {...}, "cuda:0": {...}, "mps": {...}}``
with ``gflops``, ``bandwidth_gbps``, ``score`` and ``backend`` per device; a device that
could not be measured (no torch nor CuPy) is absent. The measurements take at most
``TOTAL_BUDGET_S`` together; importing torch and starting CUDA come on top.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Sequence

log = logging.getLogger("gpumesh.worker.bench")

#: A device's score is GFLOP/s * GFLOPS_WEIGHT + GB/s * BANDWIDTH_WEIGHT. Only this module
#: computes scores (the coordinator compares them as they come), so the weights live here.
GFLOPS_WEIGHT = 0.7
BANDWIDTH_WEIGHT = 0.3

_MATMUL_N = 256                   # matmul size: n x n float32
_COPY_BYTES = 16 * 1024 * 1024    # ~16 MiB per array for the copy test
_MIN_BUDGET_S = 0.01              # a smaller budget cannot time anything

#: Seconds all measurements of one worker take together (CPU and every GPU).
TOTAL_BUDGET_S = 3.0
#: Seconds spent on the CPU (the rest is shared by the GPUs, at most GPU_BUDGET_S each).
CPU_BUDGET_S = 0.2
GPU_BUDGET_S = 0.8
_GPU_MATMUL_N = 4096                 # float32 n x n on the GPU
_GPU_COPY_BYTES = 256 * 1024 * 1024  # per array for the GPU copy test


def score(budget_s: float = 0.15) -> dict:
    """Measure this CPU and return ``{"gflops", "bandwidth_gbps", "score"}``.

    ``gflops``: float32 matmul throughput in GFLOP/s (10^9 floating point
    operations per second, counting 2*n^3 per n x n matmul).
    ``bandwidth_gbps``: memory copy bandwidth in GB/s (10^9 bytes per
    second, counting bytes read plus bytes written).
    ``score``: ``gflops * 0.7 + bandwidth_gbps * 0.3``, the product
    README's formula, rounded to 3 decimals.  It is a relative, unbounded
    number, only meaningful compared with other workers' scores.

    About half of ``budget_s`` (seconds) goes to each measurement; the call
    takes roughly ``budget_s`` and should stay under ``2 * budget_s`` plus
    the NumPy import time.  Without NumPy a much slower pure-Python estimate
    is used, which gives small numbers instead of failing.
    """
    budget_s = max(float(budget_s), _MIN_BUDGET_S)
    start = time.perf_counter()
    try:
        import numpy as np
    except ImportError:
        log.debug("numpy not importable; using pure-Python estimate")
        gflops, gbps = _python_measure(start, budget_s)
    else:
        # Budget counted from after the import, as documented.
        start = time.perf_counter()
        gflops = _numpy_gflops(np, start + budget_s / 2)
        gbps = _numpy_bandwidth(np, start + budget_s)
    total = round(gflops * GFLOPS_WEIGHT + gbps * BANDWIDTH_WEIGHT, 3)
    log.debug("bench: %.3f GFLOP/s, %.3f GB/s, score %.3f in %.3f s",
              gflops, gbps, total, time.perf_counter() - start)
    return {"gflops": gflops, "bandwidth_gbps": gbps, "score": total}


def _rate(amount: float, seconds: float) -> float:
    """``amount`` per second, in units of 10^9, guarding against a zero timer."""
    return amount / max(seconds, 1e-9) / 1e9


def _best_rate(op, amount: float, deadline: float) -> float:
    """``amount`` per second (units of 10^9) of the fastest of ``op()``'s repetitions until
    ``deadline`` (perf_counter; at least one). The fastest, not the mean, as ``timeit``
    advises: a slower repetition measured another process taking the core, not this
    device. On a busy machine the mean of NumPy's multi-threaded matmul fell 3-40x (one
    BLAS thread waiting for a core the other process held), while its fastest single
    repetition stayed within a few percent of an idle machine's (docs/hardware.md)."""
    op()  # warm-up: BLAS threads started, pages faulted in
    best = float("inf")
    while True:
        t0 = time.perf_counter()
        op()
        now = time.perf_counter()
        best = min(best, now - t0)
        if now >= deadline:
            return _rate(amount, best)


def _numpy_gflops(np, deadline: float) -> float:
    """GFLOP/s of one float32 n x n matmul (2n^3 operations), the fastest of those
    repeated until ``deadline`` (perf_counter)."""
    n = _MATMUL_N
    a = np.arange(n * n, dtype=np.float32).reshape(n, n) / (n * n)
    b = a.T.copy()
    out = np.empty((n, n), dtype=np.float32)
    return _best_rate(lambda: np.matmul(a, b, out=out), 2.0 * n ** 3, deadline)


def _numpy_bandwidth(np, deadline: float) -> float:
    """GB/s (10^9 bytes/s, read + written) of one ``np.copyto`` of ~16 MiB arrays, the
    fastest of those repeated until ``deadline``."""
    src = np.ones(_COPY_BYTES // 4, dtype=np.float32)
    dst = np.empty_like(src)
    return _best_rate(lambda: np.copyto(dst, src), 2.0 * src.nbytes, deadline)


def _python_measure(start: float, budget_s: float) -> tuple[float, float]:
    """Pure-Python fallback: (GFLOP/s, GB/s), both small but positive.

    GFLOP/s from a float multiply-add loop (2 flops per step), GB/s
    (10^9 bytes/s, read + written) from copying a 16 MiB bytearray.
    """
    deadline = start + budget_s / 2
    x, acc, flops = 1.000001, 0.0, 0
    t0 = time.perf_counter()
    while True:
        for _ in range(10_000):
            acc = acc * x + 1.0
        flops += 20_000
        now = time.perf_counter()
        if now >= deadline:
            break
    gflops = _rate(flops, now - t0)

    deadline = start + budget_s
    src = bytearray(_COPY_BYTES)
    dst = bytearray(_COPY_BYTES)
    count = 0
    t0 = time.perf_counter()
    while True:
        dst[:] = src
        count += 1
        now = time.perf_counter()
        if now >= deadline:
            break
    return gflops, _rate(2.0 * _COPY_BYTES * count, now - t0)



# ---------------------------------------------------------------- every device -------
def _result(gflops: float, gbps: float, backend: str) -> dict:
    return {"gflops": gflops, "bandwidth_gbps": gbps,
            "score": round(gflops * GFLOPS_WEIGHT + gbps * BANDWIDTH_WEIGHT, 3), "backend": backend}


def measure(gpus: Sequence[int] = (), mps: bool = False, budget_s: float = TOTAL_BUDGET_S) -> dict:
    """Score the CPU, the CUDA GPUs ``gpus`` (NVML indices) and, if ``mps``, the Apple
    GPU. Returns ``{device key: {"gflops", "bandwidth_gbps", "score", "backend"}}``.

    GPU ``k`` of ``gpus`` is CUDA device ``k`` of this process, which must have been
    started with ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` and ``CUDA_VISIBLE_DEVICES`` listing
    ``gpus`` in order (see :mod:`gpumesh.worker.scoring`).
    """
    out = {}
    cpu = score(min(CPU_BUDGET_S, budget_s))
    out["cpu"] = dict(cpu, backend="numpy" if "numpy" in sys.modules else "python")
    fake = _fake_scores()
    n_dev = len(gpus) + (1 if mps else 0)
    if not n_dev:
        return out
    each = max(0.1, min(GPU_BUDGET_S, (budget_s - CPU_BUDGET_S) / n_dev))
    if fake is not None:
        for i in gpus:
            f = fake[i] if i < len(fake) else {}
            if "score" in f:
                out[f"cuda:{i}"] = {"gflops": 0.0, "bandwidth_gbps": 0.0, "score": float(f["score"]),
                                    "backend": "fake"}
            elif "gflops" in f:
                out[f"cuda:{i}"] = _result(float(f["gflops"]), float(f.get("bandwidth_gbps", 0)), "fake")
        return out
    backend = _gpu_backend()
    for k, i in enumerate(gpus):
        if backend is None:
            break
        try:
            out[f"cuda:{i}"] = _measure_gpu(backend, k, each)
        except Exception as e:  # noqa: BLE001 - one GPU failing must not hide the others
            log.warning("benchmark of GPU %d failed: %s", i, e)
    if mps:
        try:
            import torch
            if torch.backends.mps.is_available():
                out["mps"] = _measure_torch(torch, torch.device("mps"), each, torch.mps.synchronize)
        except Exception as e:  # noqa: BLE001
            log.warning("benchmark of the Apple GPU failed: %s", e)
    return out


def _fake_scores() -> list[dict] | None:
    from .device import fake_entries
    entries = fake_entries()
    return None if entries is None else [g if isinstance(g, dict) else {} for g in entries]


def _gpu_backend():
    """("torch", module) or ("cupy", module), whichever imports and sees CUDA; else None."""
    try:
        import torch
        if torch.cuda.is_available():
            return ("torch", torch)
    except Exception:  # noqa: BLE001 - missing or broken: try CuPy
        log.debug("torch unavailable for the GPU benchmark", exc_info=True)
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() > 0:
            return ("cupy", cupy)
    except Exception:  # noqa: BLE001
        log.debug("cupy unavailable for the GPU benchmark", exc_info=True)
    return None


def _measure_gpu(backend, ordinal: int, budget_s: float) -> dict:
    name, mod = backend
    if name == "torch":
        dev = mod.device(f"cuda:{ordinal}")
        return _measure_torch(mod, dev, budget_s, lambda: mod.cuda.synchronize(dev))
    with mod.cuda.Device(ordinal):
        return _measure_cupy(mod, budget_s)


def _timed(step, sync, deadline: float) -> tuple[int, float]:
    """Run ``step`` (then ``sync``) until ``deadline``; (count, seconds)."""
    step()
    sync()  # warm-up: kernels load, memory is touched
    count, t0 = 0, time.perf_counter()
    while True:
        step()
        sync()
        count += 1
        now = time.perf_counter()
        if now >= deadline:
            return count, now - t0


def _measure_torch(torch, dev, budget_s: float, sync) -> dict:
    n = _GPU_MATMUL_N
    a = torch.rand((n, n), device=dev, dtype=torch.float32)
    b = torch.rand((n, n), device=dev, dtype=torch.float32)
    c = torch.empty((n, n), device=dev, dtype=torch.float32)
    start = time.perf_counter()
    count, secs = _timed(lambda: torch.matmul(a, b, out=c), sync, start + budget_s / 2)
    gflops = _rate(2.0 * n ** 3 * count, secs)
    del a, b, c
    src = torch.ones(_GPU_COPY_BYTES // 4, device=dev, dtype=torch.float32)
    dst = torch.empty_like(src)
    count, secs = _timed(lambda: dst.copy_(src), sync, time.perf_counter() + budget_s / 2)
    return _result(gflops, _rate(2.0 * _GPU_COPY_BYTES * count, secs), "torch")


def _measure_cupy(cp, budget_s: float) -> dict:
    n = _GPU_MATMUL_N
    sync = cp.cuda.Device().synchronize
    a = cp.random.rand(n, n, dtype=cp.float32)
    b = cp.random.rand(n, n, dtype=cp.float32)
    c = cp.empty((n, n), dtype=cp.float32)
    count, secs = _timed(lambda: cp.matmul(a, b, out=c), sync, time.perf_counter() + budget_s / 2)
    gflops = _rate(2.0 * n ** 3 * count, secs)
    del a, b, c
    src = cp.ones(_GPU_COPY_BYTES // 4, dtype=cp.float32)
    dst = cp.empty_like(src)
    count, secs = _timed(lambda: cp.copyto(dst, src), sync, time.perf_counter() + budget_s / 2)
    return _result(gflops, _rate(2.0 * _GPU_COPY_BYTES * count, secs), "cupy")


#: Seconds a benchmark waits for the other workers of its machine (and user) to finish
#: theirs: two measured at once on the same cores each see part of a machine (a fresh user
#: saw 2.8 and 148 GFLOP/s from two workers joined together on one 2-core box). Past
#: this it measures anyway.
MACHINE_TURN_WAIT_S = 30.0


def machine_turn(wait_s: float = MACHINE_TURN_WAIT_S, directory: str | None = None):
    """This machine's benchmark lock (a file in the temporary directory, one per user:
    :mod:`gpumesh.oslock`, released however the process ends), waited for up to
    ``wait_s`` seconds: the held lock, or None when it stayed taken or cannot be made."""
    import os
    import random
    import tempfile
    from pathlib import Path

    from .. import oslock
    who = os.getuid() if hasattr(os, "getuid") else os.environ.get("USERNAME", "user")
    path = Path(directory or tempfile.gettempdir()) / f"gpumesh-bench-{who}.lock"
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return oslock.acquire(path)
        except oslock.Held:
            if time.monotonic() >= deadline:
                return None
        except OSError:
            return None
        time.sleep(0.05 + 0.05 * random.random())


def main(argv: list[str] | None = None) -> int:
    """``python -m gpumesh.worker.bench [--gpus 0,1] [--mps] [--budget S]``: print the
    scores of :func:`measure` as one JSON line."""
    import argparse
    p = argparse.ArgumentParser(prog="python -m gpumesh.worker.bench")
    p.add_argument("--gpus", default="", help="NVML indices of the GPUs to measure, e.g. 0,1")
    p.add_argument("--mps", action="store_true", help="also measure the Apple GPU")
    p.add_argument("--budget", type=float, default=TOTAL_BUDGET_S, help="seconds for all measurements")
    args = p.parse_args(argv)
    gpus = [int(x) for x in args.gpus.split(",") if x.strip()]
    turn = machine_turn()  # (held until this process ends: a task's kill releases it too)
    print(json.dumps(measure(gpus, args.mps, args.budget)), flush=True)
    if turn is not None:
        turn.release()
    return 0


if __name__ == "__main__":
    sys.exit(main())
