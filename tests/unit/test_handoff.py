"""gpumesh.handoff and the store's side of it: who may hand payloads off as files, and
how the coordinator claims them (by plain name, inside its own directory only)."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from gpumesh import handoff, wire
from gpumesh.coordinator.store import Store
from gpumesh.handoff import Handoff


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "data")
    yield s
    s.close()


def answer(s: Store, **over) -> dict:
    a = {"blob_dir": str(s.blob_dir.resolve()), "handoff_dir": str(s.handoff_dir.resolve()),
         "nonce": s.handoff_nonce}
    a.update(over)
    return a


def test_a_process_that_sees_the_coordinators_directory_may_hand_off(store):
    h = Handoff.from_answer(answer(store))
    assert h is not None and h.drop_dir == store.handoff_dir.resolve()
    assert (store.handoff_dir / handoff.PROBE).read_text() == store.handoff_nonce
    assert len(store.handoff_nonce) == 32


@pytest.mark.parametrize("over", [
    {"nonce": "0" * 32},                         # another coordinator's nonce: another machine
    {"handoff_dir": "/nonexistent/handoff"},     # not visible here
    {"handoff_dir": "relative/handoff"},
    {"blob_dir": "relative"},
    {"nonce": 7},
    {"nonce": "short"},
])
def test_a_process_that_does_not_see_it_may_not(store, over):
    assert Handoff.from_answer(answer(store, **over)) is None


def test_a_malformed_answer_is_no_handoff(store):
    assert Handoff.from_answer({}) is None
    assert Handoff.from_answer({"blob_dir": None, "handoff_dir": None, "nonce": None}) is None


def test_disabled_by_environment(store, monkeypatch):
    monkeypatch.setenv("GPUMESH_HANDOFF", "0")

    class NoHTTP:
        def request(self, *a, **k):
            raise AssertionError("must not ask when disabled")
    assert Handoff.probe(NoHTTP()) is None


def test_written_payload_maps_back_writable_without_changing_the_file(tmp_path):
    a = np.arange(300_000, dtype=np.float32)
    p = wire.dumps({"a": a, "s": "x"})
    name = handoff.write_file(tmp_path, p.chunks)
    assert handoff.NAME.fullmatch(name)
    path = tmp_path / name
    assert path.stat().st_size == p.size and (path.stat().st_mode & 0o777) == 0o600
    got = wire.loads(handoff.map_file(path))
    assert got["s"] == "x" and np.array_equal(got["a"], a)
    got["a"][:10] = -1  # copy-on-write: the array is the program's, the file stays
    assert got["a"][0] == -1
    assert np.array_equal(wire.loads(handoff.map_file(path))["a"], a)
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    assert handoff.map_file(empty).nbytes == 0


def test_a_failed_write_leaves_no_file(tmp_path):
    def chunks():
        yield b"x" * 100
        raise OSError("disk full")
    with pytest.raises(OSError, match="disk full"):
        handoff.write_file(tmp_path, chunks())
    assert list(tmp_path.iterdir()) == []


def test_open_refuses_paths_outside_the_blob_directory(store):
    h = Handoff.from_answer(answer(store))
    for bad in ("../gpumesh.db", "/etc/passwd", "args/../../gpumesh.db", 5):
        with pytest.raises(FileNotFoundError):
            h.open(bad)


def test_the_store_adopts_a_handed_off_file_by_name(store):
    big = os.urandom(3 * 2**20)
    name = handoff.write_file(store.handoff_dir, [big])
    inc = store.take_handoff(name)
    assert inc.size == len(big)
    store.create_job("j1", "", "function", None, {}, [("t1", 0, 1.0, inc)])
    inline, fname = store.task_args("t1")
    assert inline is None and store.file_path(fname).read_bytes() == big
    assert not (store.handoff_dir / name).exists()
    with pytest.raises(FileNotFoundError):  # claimed once only
        store.take_handoff(name)


@pytest.mark.parametrize("bad", ["../gpumesh.db", "x.part", "a" * 24 + ".tmp", ".probe",
                                 "../" + "a" * 24 + ".part", None, 3])
def test_the_store_refuses_anything_but_a_plain_handoff_name(store, bad):
    with pytest.raises(ValueError):
        store.take_handoff(bad)


def test_the_store_refuses_a_link_or_a_directory_under_a_handoff_name(store, tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(b"not yours")
    link = "b" * 24 + ".part"
    os.symlink(secret, store.handoff_dir / link)
    folder = "c" * 24 + ".part"
    (store.handoff_dir / folder).mkdir()
    for name in (link, folder, "d" * 24 + ".part"):
        with pytest.raises(FileNotFoundError):
            store.take_handoff(name)


def test_unclaimed_files_are_swept_after_their_ttl_and_at_restart(store, tmp_path):
    old = handoff.write_file(store.handoff_dir, [b"old"])
    new = handoff.write_file(store.handoff_dir, [b"new"])
    past = time.time() - 3600
    os.utime(store.handoff_dir / old, (past, past))
    assert store.sweep_handoff(time.time() - 600) == 1
    assert sorted(p.name for p in store.handoff_dir.iterdir()) == sorted([handoff.PROBE, new])
    nonce = store.handoff_nonce
    store.close()
    again = Store(tmp_path / "data")
    try:
        assert [p.name for p in again.handoff_dir.iterdir()] == [handoff.PROBE]
        assert again.handoff_nonce != nonce  # a restarted coordinator is another one
    finally:
        again.close()


def test_every_payload_the_store_keeps_as_a_file_is_handed_off():
    """The threshold is the store's inline limit: a payload the store would write into a
    file anyway is written there by its sender (over a pooled file), and one it keeps in
    a row still rides in the body. (It was 1 MiB: 256 KiB to 1 MiB went as bodies.)"""
    from gpumesh.limits import INLINE_BLOB_BYTES
    assert handoff.worth_it(INLINE_BLOB_BYTES + 1)
    assert handoff.worth_it(512 * 1024)
    assert not handoff.worth_it(INLINE_BLOB_BYTES)
    assert not handoff.worth_it(64 * 1024)
