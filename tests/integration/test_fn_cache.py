"""A worker's cache of function blobs stays under GPUMESH_FN_CACHE_MB however many big
functions it runs, and a function evicted from it still runs when called again (its
blob is fetched again from the coordinator for the new host)."""

from __future__ import annotations

import os
from contextlib import closing

from gpumesh import accelerate

BLOB = 1_000_000


def closes_over_a_megabyte(n: int):
    blob = os.urandom(BLOB)

    def g(x, blob=blob):
        return len(blob) + x + n

    return g


def test_distinct_big_functions_keep_the_cache_under_its_cap(make_mesh, tmp_path):
    m = make_mesh()
    tmp = tmp_path / "worker-tmp"
    tmp.mkdir()
    m.env.update(GPUMESH_FN_CACHE_MB="3", TMPDIR=str(tmp))
    m.add_worker()
    [fn_dir] = list(tmp.glob("gpumesh-worker-*/fn"))
    cap, most = 3 * 2**20, 3
    if os.environ.get("GPUMESH_RUNTIME") == "spawn":
        # (docs/owner.md: on the spawn runtime each warm function's spares load its blob
        # from disk, so up to MAX_WARM_FUNCTIONS blobs stay past the cap until they idle)
        from gpumesh.limits import MAX_WARM_FUNCTIONS
        cap += MAX_WARM_FUNCTIONS * (BLOB + 2**16)
        most += MAX_WARM_FUNCTIONS
    with closing(m.client(output=False)) as c:
        fns = [accelerate(c)(closes_over_a_megabyte(n)) for n in range(8)]
        for n, fn in enumerate(fns):
            assert fn(1) == BLOB + 1 + n
            # (a task's blob is let go before its result is posted)
            size = sum(p.stat().st_size for p in fn_dir.iterdir())
            assert size <= cap, f"{size} bytes after {n + 1} functions"
            assert len(list(fn_dir.iterdir())) <= most
        # the first function's blob and its warm host (MAX_WARM_FUNCTIONS) are both gone:
        # a new host loads it from a blob fetched again
        assert fns[0](2) == BLOB + 2
        assert fns[7](3) == BLOB + 3 + 7
    assert sum(p.stat().st_size for p in fn_dir.iterdir()) <= cap
