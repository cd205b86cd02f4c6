"""Connections that hold file descriptors without making progress, against a real
coordinator over real sockets: a request refused at the gate before its body is closed
with its answer, a body that stops sending is dropped, and a flood of silent sockets
over GPUMESH_MAX_CONNECTIONS keeps neither a worker nor a new caller out."""

from __future__ import annotations

import socket
import sys
import time

import cloudpickle
import urllib3

cloudpickle.register_pickle_by_value(sys.modules[__name__])

#: Connections the flood test allows, and the silent sockets it opens (more than that).
CAP, FLOOD = 40, 120


def plus_one(x):
    return x + 1


def _closed_within(s: socket.socket, seconds: float) -> tuple[bool, bytes]:
    """Whether the server closed ``s`` within ``seconds``, and what it sent before."""
    got, deadline = b"", time.monotonic() + seconds
    while time.monotonic() < deadline:
        s.settimeout(max(deadline - time.monotonic(), 0.01))
        try:
            data = s.recv(65536)
        except socket.timeout:
            break
        except ConnectionError:
            return True, got
        if not data:
            return True, got
        got += data
    return False, got


def _post_head(port: int, token: str | None, length: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    auth = b"" if token is None else b"Authorization: Bearer " + token.encode() + b"\r\n"
    s.sendall(b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\n" + auth
              + b"Content-Length: " + str(length).encode() + b"\r\n\r\nGMF1")
    return s


def test_refused_and_stalled_bodies_give_their_sockets_back(secure_mesh):
    m = secure_mesh(env={"GPUMESH_HEAD_TIMEOUT": "3", "GPUMESH_BODY_TIMEOUT": "2"})
    t0 = time.monotonic()
    no_token = [_post_head(m.port, None, 100_000_000) for _ in range(20)]
    wrong = _post_head(m.port, "not-the-token-at-all-0123456789", 100_000_000)
    stalled = _post_head(m.port, m.token, 100_000)
    try:
        for s in [*no_token, wrong]:
            closed, answer = _closed_within(s, 2.0)
            assert closed and answer.startswith(b"HTTP/1.1 401"), answer[:200]
            assert b"connection: close" in answer.lower()
        assert time.monotonic() - t0 < 3, "answered and closed at once, not after a keep-alive wait"
        closed, answer = _closed_within(stalled, 8.0)
        assert closed and answer == b"", answer[:200]
        assert time.monotonic() - t0 < 8, "a body that sends nothing is dropped"
    finally:
        for s in [*no_token, wrong, stalled]:
            s.close()
    # a client that sends a whole big body under a wrong token still reads its 401
    r = urllib3.request("POST", f"{m.url}/v1/jobs", body=b"x" * (8 << 20),
                        headers={"authorization": "Bearer not-the-token-at-all-0123456789"},
                        retries=False, timeout=10)
    assert r.status == 401
    # and the coordinator still serves
    r = urllib3.request("GET", f"{m.url}/v1/health", retries=False, timeout=5)
    assert r.status == 200


def test_a_flood_of_silent_sockets_over_the_cap_keeps_no_one_out(secure_mesh, no_local_fallback):
    m = secure_mesh(env={"GPUMESH_MAX_CONNECTIONS": str(CAP), "GPUMESH_HEAD_TIMEOUT": "30"})
    m.join()
    c = m.client()
    try:
        assert c.run_calls(plus_one, [((1,), {})]) == [2]
        flood = []
        try:
            for _ in range(FLOOD):
                flood.append(socket.create_connection(("127.0.0.1", m.port), timeout=5))
            # a new caller's connection gets in (it sends its head at once) ...
            r = urllib3.request("GET", f"{m.url}/v1/health", retries=False, timeout=5)
            assert r.status == 200
            # ... and the joined worker and a caller run a call while the flood stands
            t0 = time.monotonic()
            assert c.run_calls(plus_one, [((i,), {}) for i in range(5)]) == [1, 2, 3, 4, 5]
            assert time.monotonic() - t0 < 20
            closed = sum(_closed_within(s, 0.05)[0] for s in flood)
            assert closed >= FLOOD - CAP, closed
        finally:
            for s in flood:
                s.close()
    finally:
        c.close()
