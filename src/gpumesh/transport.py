"""HTTP to the coordinator, shared by callers and workers: auth, timeouts, error mapping.

One keep-alive ``httpx.Client`` per :class:`Transport` (TCP_NODELAY is set by httpcore).
Every failure becomes a :mod:`gpumesh.errors` exception:

* connection refused / connect timeout  -> :class:`Unreachable` (``sent=False``: the
  coordinator never saw the request, so falling back to local execution is safe)
* read timeout / connection dropped      -> :class:`Unreachable` (``sent=True``)
* 401 / 403                              -> :class:`~gpumesh.errors.AuthError`
* 413                                    -> :class:`~gpumesh.errors.PayloadTooLarge`
* other 4xx / 5xx                        -> :class:`~gpumesh.errors.RequestRejected`
"""

from __future__ import annotations

import socket
from collections.abc import Iterable
from typing import Any

import httpx

from .errors import AuthError, MeshUnavailable, PayloadTooLarge, RequestRejected
from .limits import (CONNECT_TIMEOUT_S, READ_TIMEOUT_S, TCP_KEEPCNT, TCP_KEEPIDLE_S,
                     TCP_KEEPINTVL_S)


class Unreachable(MeshUnavailable):
    """The coordinator did not answer. ``sent`` says whether the request may have arrived."""

    def __init__(self, message: str, sent: bool):
        super().__init__(message)
        self.sent = sent


class Transport:
    """Requests to one coordinator ``url`` with bearer ``token`` (may be None)."""

    def __init__(self, url: str, token: str | None, *, verify: Any = True):
        self.url = url
        headers = {}
        if token is not None:
            # UTF-8 bytes: a token with non-Latin-1 characters is still sent (and refused
            # by the coordinator with a clear 401) instead of failing inside the client.
            headers["authorization"] = b"Bearer " + token.encode("utf-8", "surrogateescape")
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=16)
        self.client = httpx.Client(
            base_url=url, headers=headers, trust_env=False,
            timeout=httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S),
            transport=httpx.HTTPTransport(verify=verify, limits=limits,
                                          socket_options=keepalive_options()))

    def close(self) -> None:
        self.client.close()

    def request(self, method: str, path: str, *, json: Any = None,
                content: bytes | Iterable[bytes] | None = None, params: dict | None = None,
                timeout: float | None = None, headers: dict | None = None) -> httpx.Response:
        """Send one request and return the (successful) response with its body read."""
        kwargs: dict[str, Any] = {}
        if timeout is not None:
            kwargs["timeout"] = httpx.Timeout(timeout, connect=CONNECT_TIMEOUT_S)
        try:
            resp = self.client.request(method, path, json=json, content=content, params=params,
                                       headers=headers, **kwargs)
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            raise Unreachable(f"cannot reach the coordinator at {self.url}: {e}", sent=False) from e
        except httpx.TransportError as e:
            raise Unreachable(f"the coordinator at {self.url} did not answer: "
                              f"{type(e).__name__}: {e}", sent=True) from e
        check(resp, self.url)
        return resp

    def stream_into(self, method: str, path: str, *, params: dict | None = None,
                    json: Any = None, content: Any = None, headers: dict | None = None,
                    timeout: float | None = None) -> bytearray | None:
        """GET a body straight into one writable ``bytearray`` (``None`` for 204).

        Reading into a preallocated buffer costs one copy and lets unpickled NumPy arrays
        be writable views of it.
        """
        kwargs: dict[str, Any] = {}
        if timeout is not None:
            kwargs["timeout"] = httpx.Timeout(timeout, connect=CONNECT_TIMEOUT_S)
        try:
            with self.client.stream(method, path, params=params, json=json, content=content,
                                    headers=headers, **kwargs) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    check(resp, self.url)
                if resp.status_code == 204:
                    return None
                size = int(resp.headers.get("content-length", "0"))
                buf = bytearray(size)
                view = memoryview(buf)
                pos = 0
                for chunk in resp.iter_raw():
                    n = len(chunk)
                    if pos + n > size:
                        buf.extend(b"\0" * (pos + n - size))
                        view = memoryview(buf)
                        size = pos + n
                    view[pos:pos + n] = chunk
                    pos += n
                if pos != size:
                    raise Unreachable(f"response from {self.url} ended after {pos} of {size} bytes",
                                      sent=True)
                return buf
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            raise Unreachable(f"cannot reach the coordinator at {self.url}: {e}", sent=False) from e
        except httpx.TransportError as e:
            raise Unreachable(f"the coordinator at {self.url} did not answer: "
                              f"{type(e).__name__}: {e}", sent=True) from e


def keepalive_options() -> list[tuple[int, int, int]]:
    """Socket options turning on TCP keepalive with the timings of ``limits``."""
    opts = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
    for name, value in (("TCP_KEEPIDLE", TCP_KEEPIDLE_S), ("TCP_KEEPINTVL", TCP_KEEPINTVL_S),
                        ("TCP_KEEPCNT", TCP_KEEPCNT)):
        if hasattr(socket, name):  # Linux has all three; macOS only some
            opts.append((socket.IPPROTO_TCP, getattr(socket, name), value))
    return opts


def check(resp: httpx.Response, url: str) -> None:
    """Raise the gpumesh error matching an HTTP error status; return for 2xx/3xx."""
    if resp.status_code < 400:
        return
    try:
        body = resp.json()
        code, message = body.get("error", ""), body.get("message", resp.text)
    except ValueError:
        code, message = "", resp.text[:500]
    if resp.status_code in (401, 403):
        raise AuthError(f"the coordinator at {url} refused the token ({resp.status_code}: {message}); "
                        "check --token / $GPUMESH_TOKEN")
    if resp.status_code == 413:
        raise PayloadTooLarge(message or "request over the coordinator's size limit")
    err = RequestRejected(f"{message} (HTTP {resp.status_code})", resp.status_code)
    err.code = code  # type: ignore[attr-defined]
    raise err
