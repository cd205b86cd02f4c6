"""Quick CPU compute score for a worker.

The score is a relative, unbounded number for ranking workers against each
other; it is not a unit of anything.  Only the CPU is measured.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger("gpumesh.worker.bench")

GFLOPS_WEIGHT = 0.7
BANDWIDTH_WEIGHT = 0.3

_MATMUL_N = 256                   # matmul size: n x n float32
_COPY_BYTES = 16 * 1024 * 1024    # ~16 MiB per array for the copy test
_MIN_BUDGET_S = 0.01


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


def _numpy_gflops(np, deadline: float) -> float:
    """GFLOP/s of float32 n x n matmuls, repeated until ``deadline`` (perf_counter)."""
    n = _MATMUL_N
    a = np.arange(n * n, dtype=np.float32).reshape(n, n) / (n * n)
    b = a.T.copy()
    out = np.empty((n, n), dtype=np.float32)
    np.matmul(a, b, out=out)  # warm-up: BLAS thread start, page faults
    count = 0
    t0 = time.perf_counter()
    while True:
        np.matmul(a, b, out=out)
        count += 1
        now = time.perf_counter()
        if now >= deadline:
            break
    return _rate(2.0 * n ** 3 * count, now - t0)


def _numpy_bandwidth(np, deadline: float) -> float:
    """GB/s (10^9 bytes/s, read + written) of ``np.copyto`` on ~16 MiB arrays."""
    src = np.ones(_COPY_BYTES // 4, dtype=np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # warm-up: faults in dst's pages
    count = 0
    t0 = time.perf_counter()
    while True:
        np.copyto(dst, src)
        count += 1
        now = time.perf_counter()
        if now >= deadline:
            break
    return _rate(2.0 * src.nbytes * count, now - t0)


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
