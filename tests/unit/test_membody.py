"""Answers read into shared memory, and the ranges a task process maps out of them."""

from __future__ import annotations

import gc
import os

import pytest

from gpumesh import wire
from gpumesh.handoff import map_fd
from gpumesh.limits import HANDOFF_MIN_BYTES
from gpumesh.payloadref import PayloadRef
from gpumesh.worker import membody

pytestmark = pytest.mark.skipif(not membody.available(), reason="needs memfd_create (Linux)")


def read_into(body_bytes: bytes):
    buf = membody.buffer_for(len(body_bytes))
    memoryview(buf)[:] = body_bytes  # as Transport.stream_into fills it
    return buf


def test_small_answers_are_bytearrays_and_big_ones_memory_files():
    assert type(membody.buffer_for(HANDOFF_MIN_BYTES - 1)) is bytearray
    big = membody.buffer_for(HANDOFF_MIN_BYTES)
    assert isinstance(big, membody.MemBody) and len(big) == HANDOFF_MIN_BYTES
    assert os.fstat(big.fd).st_size == HANDOFF_MIN_BYTES
    assert os.readlink(f"/proc/self/fd/{big.fd}").startswith("/memfd:gpumesh-args")


def test_big_frames_become_ranges_that_map_to_exactly_their_bytes():
    first = bytes(range(256)) * (HANDOFF_MIN_BYTES // 256 + 3)   # big, odd length
    second = b"\x07" * (HANDOFF_MIN_BYTES + 4097)                 # big, starts mid-page
    chunks, size = wire.pack_frames([b'{"tasks": []}', first, b"tiny", second])
    body = read_into(b"".join(bytes(c) for c in chunks))
    meta, a, tiny, b = membody.slices(body)
    assert bytes(meta) == b'{"tasks": []}' and bytes(tiny) == b"tiny"
    assert isinstance(a, PayloadRef) and isinstance(b, PayloadRef) and a.kind == b.kind == "shm"
    assert (len(a), len(b)) == (len(first), len(second))
    # Several tasks in one answer: each big argument gets a memory file of its own, so
    # the descriptor a task is given leads to nothing of another task's.
    assert len({a.fd, b.fd, body.fd}) == 3 and (a.offset, b.offset) == (0, 0)
    assert os.fstat(a.fd).st_size == len(first) and os.fstat(b.fd).st_size == len(second)
    assert bytes(a.open()) == first and bytes(b.open()) == second
    # what the task process does with the descriptor and the range
    for rng, want in ((a, first), (b, second)):
        view = map_fd(rng.fd, rng.offset, rng.size)
        assert view.nbytes == len(want) and bytes(view) == want
        view[0] = 0  # copy-on-write: writable, and the agent's memory is untouched
        assert bytes(rng.open()) == want


def test_one_task_maps_its_range_of_the_answer_itself():
    arg = b"\x05" * (HANDOFF_MIN_BYTES + 11)
    chunks, _ = wire.pack_frames([b'{"tasks": [1]}', arg])
    body = read_into(b"".join(bytes(c) for c in chunks))
    meta, rng = membody.slices(body)
    assert rng.keep is body and rng.offset > 0  # no copy: the answer's own memory file
    assert bytes(map_fd(rng.fd, rng.offset, rng.size)) == arg


def test_a_plain_buffer_gives_plain_views():
    chunks, _ = wire.pack_frames([b"{}", b"x" * (HANDOFF_MIN_BYTES + 1)])
    body = bytearray(b"".join(bytes(c) for c in chunks))
    meta, payload = membody.slices(body)
    assert isinstance(payload, memoryview) and payload.nbytes == HANDOFF_MIN_BYTES + 1


def test_the_memory_file_is_closed_with_its_last_view():
    chunks, _ = wire.pack_frames([b"{}", b"y" * HANDOFF_MIN_BYTES])
    body = read_into(b"".join(bytes(c) for c in chunks))
    fd = body.fd
    rng = membody.slices(body)[1]
    del body
    gc.collect()
    held = os.fstat(fd)
    assert held.st_size > 0  # still held by the range a task is about to get
    del rng
    gc.collect()
    try:
        now = os.fstat(fd)
    except OSError:
        return  # closed
    # closed, and its number taken since by another thread's file (the suite's processes
    # run threads of earlier tests): not the memory file any more
    assert (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino)


def test_map_fd_refuses_a_range_outside_the_file(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"0123456789")
    fd = os.open(path, os.O_RDONLY)
    try:
        assert bytes(map_fd(fd, 3, 4)) == b"3456"
        assert bytes(map_fd(fd)) == b"0123456789"
        assert map_fd(fd, 10, 0).nbytes == 0
        for off, n in ((8, 3), (-1, 2), (0, 11)):
            with pytest.raises(ValueError):
                map_fd(fd, off, n)
    finally:
        os.close(fd)
