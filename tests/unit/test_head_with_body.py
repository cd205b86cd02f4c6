"""The coordinator sends a response's head together with its body (server._HeadWithBody)."""

from __future__ import annotations

from gpumesh.coordinator.server import _HeadWithBody

HEAD = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n"


class FakeTransport:
    def __init__(self):
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data):
        self.writes.append(bytes(data))

    def close(self):
        self.closed = True

    def is_closing(self):
        return self.closed


def test_head_and_small_body_leave_in_one_write():
    t = FakeTransport()
    w = _HeadWithBody(t)
    w.write(HEAD)
    assert t.writes == []
    w.write(b"hello")
    assert t.writes == [HEAD + b"hello"]
    w.write(HEAD)                      # the next response on the connection: same again
    w.write(memoryview(b"world"))
    assert t.writes == [HEAD + b"hello", HEAD + b"world"]


def test_every_answer_built_in_one_piece_leaves_with_its_head():
    # A results page with a 64 KiB result (its frames and meta around it), and the
    # biggest body frames_response builds in one piece: one write each. Up to a limit
    # of 64 KiB the first one's head went apart and woke the caller on its own.
    from gpumesh.coordinator.bodies import SMALL_BODY_BYTES
    for size in (64 * 1024 + 700, SMALL_BODY_BYTES):
        t = FakeTransport()
        w = _HeadWithBody(t)
        body = b"r" * size
        w.write(HEAD)
        w.write(body)
        assert t.writes == [HEAD + body]


def test_a_big_body_is_not_copied_to_join_the_head():
    t = FakeTransport()
    w = _HeadWithBody(t)
    big = b"x" * (_HeadWithBody.JOIN_BYTES + 1)
    w.write(HEAD)
    w.write(big)
    assert t.writes == [HEAD, big]


def test_continue_and_bodiless_answers_are_never_held():
    t = FakeTransport()
    w = _HeadWithBody(t)
    w.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    assert t.writes == [b"HTTP/1.1 100 Continue\r\n\r\n"]
    w.write(HEAD)                      # e.g. HEAD: no body write follows
    w.flush()
    assert t.writes[-1] == HEAD
    w.flush()                          # nothing held: nothing sent
    assert len(t.writes) == 2


def test_close_sends_a_held_head_first_and_the_rest_is_the_real_transport():
    t = FakeTransport()
    w = _HeadWithBody(t)
    w.write(HEAD)
    w.close()
    assert t.writes == [HEAD] and t.closed
    assert w.is_closing() is True
