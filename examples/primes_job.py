"""A script job: count the primes in one range per task (``gpumesh submit``'s protocol).

    gpumesh submit examples/primes_job.py --payloads examples/primes_payloads.json --wait
    echo '{"start": 0, "stop": 100}' | python examples/primes_job.py      # one task, here

Each task is ``python primes_job.py`` on a worker with one payload as JSON on stdin,
``{"start": A, "stop": B}`` (integers, 0 <= A <= B <= 10**9, B - A <= 10**7). It prints
a progress line, then its result as the last stdout line, one JSON object:
``{"start", "stop", "primes", "largest"}`` (the number of primes p with A <= p < B, and
the largest of them or null). Other keys of the payload (such as the scheduling hints
``cost`` and ``gpu_memory_mb``) are ignored. A bad payload is exit status 2 with the
reason on stderr, which fails that task.

The same from Python::

    from gpumesh import GPUMesh
    m = GPUMesh()
    job = m.submit(name="primes", script="examples/primes_job.py",
                   payloads=json.load(open("examples/primes_payloads.json")))
    print(sum(t["result"]["primes"] for t in m.wait(job)))   # 9592 primes below 100,000

Standard library only, so any worker with Python can run it.
"""

from __future__ import annotations

import json
import math
import sys

MAX_STOP = 10**9
MAX_SPAN = 10**7


def count_primes(start: int, stop: int) -> tuple[int, int | None]:
    """(how many primes p satisfy start <= p < stop, the largest such p or None), by a
    segmented sieve of Eratosthenes: O(stop - start) memory, base primes up to sqrt(stop)."""
    if stop <= 2 or stop <= start:
        return 0, None
    start = max(start, 2)
    root = math.isqrt(stop - 1)
    base = bytearray([1]) * (root + 1)
    base[0:2] = b"\x00\x00"
    for i in range(2, math.isqrt(root) + 1):
        if base[i]:
            base[i * i::i] = bytes(len(range(i * i, root + 1, i)))
    segment = bytearray([1]) * (stop - start)
    for p in (i for i, is_p in enumerate(base) if is_p):
        first = max(p * p, (start + p - 1) // p * p)
        segment[first - start::p] = bytes(len(range(first, stop, p)))
    count = segment.count(1)
    largest = start + segment.rindex(1) if count else None
    return count, largest


def read_payload(text: str) -> tuple[int, int]:
    """``(start, stop)`` from the payload JSON; ValueError saying what is wrong."""
    payload = json.loads(text)
    if not isinstance(payload, dict) or not {"start", "stop"} <= set(payload):
        raise ValueError('the payload must be a JSON object with integer "start" and "stop"')
    start, stop = payload["start"], payload["stop"]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (start, stop)):
        raise ValueError('"start" and "stop" must be integers')
    if not 0 <= start <= stop <= MAX_STOP or stop - start > MAX_SPAN:
        raise ValueError(f"need 0 <= start <= stop <= {MAX_STOP} and stop - start <= {MAX_SPAN}, "
                         f"got start={start}, stop={stop}")
    return start, stop


def main() -> int:
    try:
        start, stop = read_payload(sys.stdin.read())
    except ValueError as e:  # json.JSONDecodeError is a ValueError too
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"sieving [{start}, {stop})", flush=True)  # forwarded to the caller, kept for `gpumesh logs`
    primes, largest = count_primes(start, stop)
    print(json.dumps({"start": start, "stop": stop, "primes": primes, "largest": largest}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
