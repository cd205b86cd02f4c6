"""Store.incoming: payloads written to a file as they arrive, adopted instead of copied."""

from __future__ import annotations

import hashlib

from gpumesh.coordinator.store import Incoming, Store
from gpumesh.limits import INLINE_BLOB_BYTES


def incoming(store: Store, data: bytes) -> Incoming:
    inc = store.incoming()
    for i in range(0, len(data), 1000):
        inc.write(memoryview(data)[i:i + 1000])
    inc.finish()
    return inc


def test_adopted_files_are_renamed_into_place(tmp_path):
    s = Store(tmp_path / "data")
    big = bytes(range(256)) * (INLINE_BLOB_BYTES // 256 + 3)
    args = incoming(s, big)
    s.create_job("j1", "", "function", None, {}, [("t1", 0, 1.0, args), ("t2", 1, 1.0, b"small")])
    assert args.path is None  # adopted
    inline, fname = s.task_args("t1")
    assert inline is None and s.file_path(fname).read_bytes() == big
    assert s.task_args("t2") == (b"small", None)
    result = incoming(s, big[::-1])
    s.finish("t1", "done", 0, None, result, "j1")
    (row,) = list(s.results_after("j1", -1, 10))
    assert s.file_path(row.result_file).read_bytes() == big[::-1] and row.result_size == len(big)
    h = hashlib.sha256(big).hexdigest()
    blob = incoming(s, big)
    assert blob.sha256() == h
    s.put_blob(h, blob)
    assert s.blob_file(h).read_bytes() == big
    again = incoming(s, big)
    s.put_blob(h, again)  # already there: not adopted, the caller discards it
    again.discard()
    again.discard()
    assert list(s.incoming_dir.iterdir()) == []
    s.close()


def test_discard_removes_an_unfinished_file_and_a_restart_clears_leftovers(tmp_path):
    s = Store(tmp_path / "data")
    half = s.incoming()
    half.write(b"x" * 10)
    path = half.path
    half.discard()
    assert not path.exists()
    crashed = s.incoming()  # a crash mid-upload: never discarded
    crashed.write(b"y" * 10)
    crashed.finish()
    s.close()
    s = Store(tmp_path / "data")
    assert list(s.incoming_dir.iterdir()) == []
    s.close()


def test_full_sync_fsyncs_an_incoming_file_before_it_is_adopted(tmp_path, monkeypatch):
    import gpumesh.coordinator.store as store_mod
    synced = []
    real = store_mod.os.fsync
    monkeypatch.setattr(store_mod.os, "fsync", lambda fd: (synced.append(fd), real(fd)))
    monkeypatch.setenv("GPUMESH_SYNC", "FULL")
    s = Store(tmp_path / "full")
    incoming(s, b"z" * 100)
    assert len(synced) == 1
    s.close()
    monkeypatch.setenv("GPUMESH_SYNC", "NORMAL")
    synced.clear()
    s = Store(tmp_path / "normal")
    incoming(s, b"z" * 100)
    assert synced == []
    s.close()
