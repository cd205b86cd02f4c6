"""The framing on a task process's socket (gpumesh.worker.runner): a message of several
frames goes in one write, descriptors travel with its first bytes, and a platform without
a gathering write (Windows) sends the same bytes."""

from __future__ import annotations

import os
import socket
import sys
import threading

import pytest

from gpumesh.worker import framing


class _NoSendmsg:
    """A socket as Windows offers it: no ``sendmsg``."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.writes = 0

    def sendall(self, data) -> None:
        self.writes += 1
        self.sock.sendall(data)


def _pair():
    a, b = socket.socketpair()
    b.settimeout(10)
    return a, b


def test_frames_arrive_whole_and_in_order_from_one_write():
    a, b = _pair()
    try:
        framing.send_frames(a, [b'{"status": "ok"}', [b"ab", memoryview(b"cd"), bytearray(b"")], b""])
        # Everything was written before the reader looks: one write, one wake-up.
        assert b.recv(4096, socket.MSG_PEEK) == (
            (16).to_bytes(8, "little") + b'{"status": "ok"}' + (4).to_bytes(8, "little") + b"abcd"
            + (0).to_bytes(8, "little"))
        meta, fds = framing.recv_blob_fds(b)
        assert (bytes(meta), fds) == (b'{"status": "ok"}', [])
        assert bytes(framing.recv_blob(b)) == b"abcd"
        assert bytes(framing.recv_blob(b)) == b""
    finally:
        a.close()
        b.close()


@pytest.mark.skipif(sys.platform == "win32", reason="descriptor passing")
def test_a_descriptor_travels_with_the_first_frame():
    a, b = _pair()
    r, w = os.pipe()
    try:
        framing.send_frames(a, [b"meta", b"x" * 100_000], [w])
        meta, fds = framing.recv_blob_fds(b)
        assert bytes(meta) == b"meta" and len(fds) == 1
        os.write(fds[0], b"through the passed descriptor")
        os.close(fds[0])
        assert os.read(r, 100) == b"through the passed descriptor"
        assert bytes(framing.recv_blob(b)) == b"x" * 100_000
    finally:
        for fd in (r, w):
            os.close(fd)
        a.close()
        b.close()


def test_without_sendmsg_a_small_message_is_one_write_and_a_big_one_the_same_bytes():
    a, b = _pair()
    try:
        plain = _NoSendmsg(a)
        framing.send_frames(plain, [b"m", b"small"])  # type: ignore[arg-type]
        assert plain.writes == 1
        assert (bytes(framing.recv_blob(b)), bytes(framing.recv_blob(b))) == (b"m", b"small")
        big = b"y" * (framing.COALESCE_BYTES + 1)
        sender = threading.Thread(target=framing.send_frames, args=(plain, [b"m", big]))
        sender.start()
        assert (bytes(framing.recv_blob(b)), bytes(framing.recv_blob(b))) == (b"m", big)
        sender.join(10)
        with pytest.raises(OSError):
            framing.send_frames(plain, [b"m"], [0])  # type: ignore[arg-type]  # no descriptors there
    finally:
        a.close()
        b.close()
