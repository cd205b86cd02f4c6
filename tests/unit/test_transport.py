"""The HTTP client (gpumesh.transport) against tiny raw servers on 127.0.0.1: bodies read
whole into one writable buffer, a body cut short or a dead port as Unreachable with the
right ``sent`` flag, and the keep-alive connection reused after a complete answer."""

from __future__ import annotations

import socket
import threading

import pytest

from gpumesh.transport import Transport, Unreachable


def _serve(answers: list[bytes], pieces: int = 1):
    """A server answering each request on one connection with the next of ``answers``,
    each sent in ``pieces`` writes. Returns (port, list of connections accepted)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    accepted = []

    def run():
        conn, _ = srv.accept()
        accepted.append(conn)
        for answer in answers:
            data = b""
            while b"\r\n\r\n" not in data:
                got = conn.recv(65536)
                if not got:
                    return
                data += got
            step = max(1, len(answer) // pieces)
            for i in range(0, len(answer), step):
                conn.sendall(answer[i:i + step])
        conn.close()
        srv.close()

    threading.Thread(target=run, daemon=True).start()
    return srv.getsockname()[1], accepted


def _answer(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body) + body


def test_bodies_arrive_whole_and_writable_over_one_connection():
    big = bytes(range(256)) * 40_000   # ~10 MiB, sent in 7 pieces
    port, accepted = _serve([_answer(big), _answer(b'{"ok": true}')], pieces=7)
    t = Transport(f"http://127.0.0.1:{port}", "token")
    buf = t.stream_into("GET", "/big", timeout=10)
    assert isinstance(buf, bytearray) and buf == big
    assert t.request("GET", "/small", timeout=10).json() == {"ok": True}
    assert len(accepted) == 1          # the second request reused the connection
    t.close()


def test_a_body_cut_short_is_unreachable_after_sending():
    port, _ = _serve([b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n" + b"x" * 10])
    t = Transport(f"http://127.0.0.1:{port}", "token")
    with pytest.raises(Unreachable) as ei:
        t.stream_into("GET", "/cut", timeout=10)
    assert ei.value.sent is True
    assert "ended after 10 of 1000 bytes" in str(ei.value)


def test_a_closed_port_is_unreachable_before_sending():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    t = Transport(f"http://127.0.0.1:{port}", "token")
    with pytest.raises(Unreachable) as ei:
        t.request("GET", "/v1/health", timeout=2)
    assert ei.value.sent is False
    assert "Connection refused" in str(ei.value) and "HTTPConnection(" not in str(ei.value)


def test_a_big_body_leaves_in_small_views_never_copied():
    # urllib3 sends under the connect timeout, one sendall per piece: pieces stay small.
    from gpumesh.transport import SEND_PIECE_BYTES, _pieces
    big = bytearray(b"y" * (2 * SEND_PIECE_BYTES + 5))
    out = list(_pieces([b"head", big]))
    assert out[0] == b"head"
    assert [len(p) for p in out[1:]] == [SEND_PIECE_BYTES, SEND_PIECE_BYTES, 5]
    assert all(isinstance(p, memoryview) for p in out[1:])
    big[0] = ord("z")                  # views of the caller's buffer
    assert bytes(out[1][:1]) == b"z"


class _Sends:
    """A connection's socket that records each ``sendall`` instead of sending it (the
    rest is a socketpair's)."""

    def __init__(self, sock):
        self.sock, self.sent = sock, []

    def sendall(self, data):
        self.sent.append(bytes(data))

    def __getattr__(self, name):
        return getattr(self.sock, name)


_K = 1024


@pytest.mark.parametrize("body, joined", [
    ([b"a" * 100, memoryview(b"b" * 50)], 2),  # head and a small body: one write
    # A 64 KiB result's post (its meta, then the payload as one piece): one write too.
    # Up to a limit of 64 KiB its head went apart, and woke the coordinator on its own.
    ([b"a" * 100, b"c" * (64 * _K + 400)], 2),
    ([b"a" * 100, bytearray(b"c" * (256 * _K))], 2),  # a whole piece of SEND_PIECE_BYTES
    # What does not fit follows what was held, as it is.
    ([b"a" * 100, b"c" * (256 * _K), memoryview(b"d" * (256 * _K))], 2),
])
def test_a_request_s_head_and_body_pieces_leave_in_one_write(body, joined):
    a, b = socket.socketpair()
    try:
        conn = Transport("http://127.0.0.1:9", "tok").pool.ConnectionCls("127.0.0.1", 9)
        conn.sock = _Sends(a)
        size = sum(memoryview(x).nbytes for x in body)
        conn.request("POST", "/v1/x", body=body, headers={"content-length": str(size)})
        sent = conn.sock.sent
        assert len(sent) == 1 + len(body) - joined
        assert sent[0].startswith(b"POST /v1/x HTTP/1.1\r\n")
        assert sent[0].split(b"\r\n\r\n", 1)[1] == b"".join(bytes(x) for x in body[:joined])
        assert [bytes(x) for x in body[joined:]] == sent[1:]
        conn.sock = None
    finally:
        a.close()
        b.close()


def _refusal(status: int, code: str, message: str):
    import json

    from gpumesh.transport import Response, check
    body = json.dumps({"error": code, "message": message}).encode()
    with pytest.raises(Exception) as info:
        check(Response(status, {"content-type": "application/json"}, body), "http://h:1")
    return info.value


def test_a_role_refusal_is_not_called_a_refused_token():
    from gpumesh import AuthError
    # a good token whose person may not do this: the token is not the thing to check
    e = _refusal(403, "forbidden", "bob's token (view) cannot cancel jobs; ask whoever holds "
                                   "the main token")
    assert isinstance(e, AuthError)
    # (the coordinator's text says who can help: never `gpumesh token list`, which only an
    # admin may run, and an admin is never refused for its role)
    assert str(e) == ("the coordinator at http://h:1 does not allow this: bob's token (view) "
                      "cannot cancel jobs; ask whoever holds the main token (HTTP 403)")
    # a wrong token is
    e = _refusal(401, "unauthorized", "the token was refused")
    assert isinstance(e, AuthError) and "refused the token" in str(e) and "check --token" in str(e)
