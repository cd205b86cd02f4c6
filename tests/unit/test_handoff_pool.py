"""The handoff pool (gpumesh.handoff): a released result or argument file is written over
by the next sender only when no process maps it, so a payload a caller or a task holds
never changes."""

from __future__ import annotations

import gc
import os
import time

import pytest

from gpumesh import handoff
from gpumesh.coordinator.reaper import Reaper
from gpumesh.payloadref import PayloadRef, from_meta, store_file

pytestmark = pytest.mark.skipif(handoff.fcntl is None, reason="the pool needs flock (POSIX)")

MiB = 1 << 20
OLD = b"o" * (2 * MiB)
NEW = b"n" * (2 * MiB)


@pytest.fixture
def dirs(tmp_path):
    blobs, drop = tmp_path / "blobs", tmp_path / "blobs" / "handoff"
    (blobs / "results" / "j").mkdir(parents=True)
    drop.mkdir()
    return blobs, drop


def stored(blobs, name: str = "t", data: bytes = OLD):
    path = blobs / "results" / "j" / name
    path.write_bytes(data)
    return path


def pooled(drop) -> list[str]:
    return sorted(p.name for p in drop.iterdir() if handoff.FREE.fullmatch(p.name))


def set_aside(drop) -> list[str]:
    return sorted(p.name for p in drop.iterdir() if handoff.HELD.fullmatch(p.name))


def test_a_mapped_file_is_deleted_not_pooled_and_the_map_keeps_its_bytes(dirs):
    blobs, drop = dirs
    path = stored(blobs)
    view = store_file(blobs, "results/j/t").open()  # the caller's map, under its lock
    assert handoff.pool_file(drop, path, 64 * MiB) is False
    assert pooled(drop) == [] and not path.exists()
    # whatever a sender writes now is a new file: the held map cannot see it
    handoff.write_file(drop, [NEW])
    assert bytes(view) == OLD
    del view
    gc.collect()


def test_a_file_nobody_maps_is_pooled_and_written_over_in_place(dirs):
    blobs, drop = dirs
    path = stored(blobs)
    view = store_file(blobs, "results/j/t").open()
    assert bytes(view[:4]) == b"oooo"
    del view  # the map is gone: so is its lock
    gc.collect()
    ino = os.stat(path).st_ino
    assert handoff.pool_file(drop, path, 64 * MiB) is True
    (free,) = pooled(drop)
    assert os.stat(drop / free).st_ino == ino
    half = NEW[:MiB + 5]  # smaller than the pooled file (within 2x): written over, cut down
    name = handoff.write_file(drop, [half[:100], half[100:]])
    assert pooled(drop) == []
    assert os.stat(drop / name).st_ino == ino and (drop / name).read_bytes() == half


def test_a_reader_that_locks_after_the_file_left_the_store_treats_it_as_gone(dirs):
    blobs, drop = dirs
    path = stored(blobs)
    fd = os.open(path, os.O_RDONLY)  # opened before the store moved it...
    try:
        assert handoff.pool_file(drop, path, 64 * MiB) is True  # (no lock yet: pooled)
        assert handoff.lock_shared(fd, path) is False  # ...locked after: not the store's now
    finally:
        os.close(fd)
    with pytest.raises(FileNotFoundError):
        store_file(blobs, "results/j/t").open()


def test_the_pool_keeps_to_its_budget_and_only_fitting_files_are_claimed(dirs):
    blobs, drop = dirs
    assert handoff.pool_file(drop, stored(blobs, "a"), 3 * MiB) is True
    assert handoff.pool_file(drop, stored(blobs, "b"), 3 * MiB) is False  # 4 MiB > budget: deleted
    assert len(pooled(drop)) == 1 and not (blobs / "results" / "j" / "b").exists()
    small = b"s" * (MiB // 2)  # a 2 MiB file is more than twice that: a new file instead
    name = handoff.write_file(drop, [small])
    assert len(pooled(drop)) == 1 and (drop / name).read_bytes() == small
    assert handoff.pool_file(drop, stored(blobs, "c", b"x" * 1000), 64 * MiB) is False  # too small


def test_past_the_held_maps_limit_a_payload_is_read_into_memory(dirs, monkeypatch):
    blobs, drop = dirs
    stored(blobs)
    monkeypatch.setattr(handoff, "MAX_LOCKED_MAPS", handoff._held)  # no room left
    view = store_file(blobs, "results/j/t").open()
    assert bytes(view) == OLD and isinstance(view.obj, bytearray)
    ref = PayloadRef("store", path=blobs / "results" / "j" / "t", offset=10, size=20)
    assert bytes(ref.open()) == OLD[10:30]
    # nothing holds a lock now: the file may be pooled
    assert handoff.pool_file(drop, blobs / "results" / "j" / "t", 64 * MiB) is True


def test_the_reaper_pools_then_empties_the_pool_when_idle(dirs, monkeypatch):
    from gpumesh.coordinator import reaper
    monkeypatch.setattr(reaper, "HANDOFF_POOL_IDLE_S", 0.3)
    blobs, drop = dirs
    r = Reaper(drop, 64 * MiB)
    try:
        r.remove(pool=[stored(blobs)], dirs=[blobs / "results" / "j"])
        assert r.flush(10)
        assert len(pooled(drop)) == 1 and not (blobs / "results" / "j").exists()
        deadline = time.monotonic() + 10
        while pooled(drop) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pooled(drop) == []
    finally:
        r.close()


def test_the_reaper_pools_a_mapped_file_only_once_its_map_is_gone(dirs):
    """``r = f(a)`` in a loop holds the previous result while the next call runs: its
    file is set aside where no sender takes it, and pooled when the map goes."""
    blobs, drop = dirs
    path = stored(blobs)
    ino = os.stat(path).st_ino
    view = store_file(blobs, "results/j/t").open()
    r = Reaper(drop, 64 * MiB)
    try:
        r.remove(pool=[path])
        assert r.flush(10)
        assert pooled(drop) == [] and len(set_aside(drop)) == 1 and not path.exists()
        name = handoff.write_file(drop, [NEW])  # a sender meanwhile: a new file, not that one
        assert os.stat(drop / name).st_ino != ino
        time.sleep(0.2)  # several retries while the map lives
        assert pooled(drop) == [] and bytes(view) == OLD
        del view
        gc.collect()
        deadline = time.monotonic() + 10
        while not pooled(drop) and time.monotonic() < deadline:
            time.sleep(0.02)
        (free,) = pooled(drop)
        assert os.stat(drop / free).st_ino == ino and set_aside(drop) == []
    finally:
        r.close()
    assert pooled(drop) == []  # closing empties the pool


def test_a_pinned_arguments_file_stays_out_of_the_pool_while_any_map_from_it_lives(dirs):
    """The agent pins a task's arguments' file and passes its descriptor to the task
    process, which maps it and closes its copy; the agent then lets go of its own. The
    lock pin() took lasts as long as any of them: the descriptor, then the map."""
    blobs, drop = dirs
    (blobs / "args" / "j").mkdir(parents=True)
    path = blobs / "args" / "j" / "t"
    path.write_bytes(OLD)
    ino = os.stat(path).st_ino
    pinned = store_file(blobs, "args/j/t").pin()  # the agent
    waiting = handoff.take_out(drop, path, 64 * MiB)  # the job released while its task runs
    assert waiting is not None
    assert handoff.try_pool(waiting) is False  # the agent's descriptor holds the lock
    meta, fds = pinned.to_meta()
    passed = from_meta(meta, [os.dup(fds[0])])  # as SCM_RIGHTS passes it: the same open file
    view = passed.open()  # the task process
    passed.release()
    pinned.release()
    assert handoff.try_pool(waiting) is False  # only the map is left, and holds it
    name = handoff.write_file(drop, [NEW])  # a sender: a new file
    assert os.stat(drop / name).st_ino != ino and bytes(view) == OLD
    del view
    gc.collect()
    assert handoff.try_pool(waiting) is True
    (free,) = pooled(drop)
    assert os.stat(drop / free).st_ino == ino


def test_pinning_a_file_the_store_has_moved_treats_it_as_gone(dirs, monkeypatch):
    """Opened before the store set the file aside, locked after: the agent treats it as
    gone (the task is handed back), as it does a file that is not there."""
    blobs, drop = dirs
    path = stored(blobs)
    real_lock = handoff.lock_shared

    def moved_between(fd, where):  # the store's take_out between open and flock
        assert handoff.take_out(drop, path, 64 * MiB) is not None
        return real_lock(fd, where)
    monkeypatch.setattr(handoff, "lock_shared", moved_between)
    ref = store_file(blobs, "results/j/t")
    with pytest.raises(FileNotFoundError):
        ref.pin()
    assert ref.fd is None
    (waiting,) = set_aside(drop)
    assert handoff.try_pool(str(drop / waiting)) is True  # no lock was left behind
