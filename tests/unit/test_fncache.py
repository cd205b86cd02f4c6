"""The worker's function blob cache stays under its cap, keeps what is held or still
needed by the executor's processes, drops what idles, and fetches an evicted blob again."""

from __future__ import annotations

import hashlib
import threading

import pytest

from gpumesh.worker.fncache import FunctionCache

from ..conftest import FakeClock

KB = 1024


class Coordinator:
    def __init__(self, *blobs: bytes):
        self.blobs = {hashlib.sha256(b).hexdigest(): b for b in blobs}
        self.fetched: list[str] = []

    def fetch(self, h: str) -> bytes | None:
        self.fetched.append(h)
        return self.blobs.get(h)


def blob(i: int, size: int = 100 * KB) -> bytes:
    return i.to_bytes(4, "big") * (size // 4)


def files(c: FunctionCache) -> set[str]:
    return {p.name for p in c.root.iterdir()}


def test_many_distinct_functions_stay_under_the_cap_least_recently_used_first(tmp_path):
    data = [blob(i) for i in range(10)]
    coord = Coordinator(*data)
    clock = FakeClock()
    c = FunctionCache(tmp_path / "fn", coord.fetch, 350 * KB, idle_s=60, clock=clock)
    hashes = list(coord.blobs)
    for h in hashes:
        clock.advance(1)
        path = c.acquire(h)
        assert path.read_bytes() == coord.blobs[h]
        c.release(h)
        assert sum(p.stat().st_size for p in c.root.iterdir()) <= 350 * KB
    assert files(c) == set(hashes[-3:])  # the three most recently used
    assert c.size == 300 * KB
    # an evicted one is fetched again, and still right
    coord.fetched.clear()
    assert c.acquire(hashes[0]).read_bytes() == data[0] and coord.fetched == [hashes[0]]
    c.release(hashes[0])
    # a cached one is not fetched
    coord.fetched.clear()
    c.acquire(hashes[-1])
    c.release(hashes[-1])
    assert coord.fetched == []


def test_held_and_in_use_blobs_are_never_evicted(tmp_path):
    data = [blob(i) for i in range(4)]
    coord = Coordinator(*data)
    hashes = list(coord.blobs)
    busy = {hashes[1] + "|/some/env/site-packages"}  # (a host keyed by its environment too)
    c = FunctionCache(tmp_path / "fn", coord.fetch, 150 * KB, idle_s=60, in_use=lambda: busy)
    c.acquire(hashes[0])                       # held: a running task
    c.acquire(hashes[1])
    c.release(hashes[1])                       # released, but a process still loads it
    assert files(c) == set(hashes[:2])         # over the cap: nothing may go
    c.acquire(hashes[2])
    c.release(hashes[2])
    assert files(c) == set(hashes[:2])         # the newest went instead
    c.release(hashes[0])
    busy.clear()
    c.acquire(hashes[3])
    c.release(hashes[3])
    assert files(c) == {hashes[3]}


def test_a_blob_idle_for_long_is_dropped(tmp_path):
    coord = Coordinator(blob(1, KB), blob(2, KB))
    h1, h2 = coord.blobs
    clock = FakeClock()
    c = FunctionCache(tmp_path / "fn", coord.fetch, 2**30, idle_s=60, clock=clock)
    c.acquire(h1)
    c.release(h1)
    clock.advance(30)
    c.acquire(h2)                               # held past the idle time: kept
    clock.advance(31)
    c.sweep()
    assert files(c) == {h2}
    clock.advance(120)
    c.sweep()
    assert files(c) == {h2}
    c.release(h2)
    clock.advance(61)
    c.sweep()
    assert files(c) == set() and c.size == 0


def test_a_corrupted_blob_is_refused_and_concurrent_fetches_fetch_once(tmp_path):
    coord = Coordinator(blob(1))
    (h,) = coord.blobs
    coord.blobs["ab" * 32] = b"not that"
    c = FunctionCache(tmp_path / "fn", coord.fetch, 2**30, idle_s=60)
    with pytest.raises(RuntimeError, match="arrived corrupted"):
        c.acquire("ab" * 32)
    assert files(c) == set()
    paths = []
    threads = [threading.Thread(target=lambda: paths.append(c.acquire(h))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(paths) == 8 and coord.fetched.count(h) == 1
