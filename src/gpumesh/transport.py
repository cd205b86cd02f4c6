"""HTTP to the coordinator, shared by callers and workers: auth, timeouts, error mapping.

One keep-alive ``urllib3`` connection pool per :class:`Transport` (TCP_NODELAY and TCP
keepalive set on every connection). urllib3 rather than a higher-level client because
every task costs a few requests on the caller and on the worker, and urllib3 spends about
half the CPU per request of httpx, which shows in a no-op call's latency wherever the
processes share the CPU (the figures: docs/performance.md, "Where the numbers in the code
came from").
Every failure becomes a :mod:`gpumesh.errors` exception:

* connection refused / connect timeout  -> :class:`Unreachable` (``sent=False``: the
  coordinator never saw the request, so falling back to local execution is safe)
* read timeout / connection dropped      -> :class:`Unreachable` (``sent=True``)
* 401, 403 forbidden                    -> :class:`~gpumesh.errors.AuthError`
* 429 locked_out                         -> :class:`~gpumesh.errors.LockedOut` (an AuthError
  with ``retry_after``, from the ``Retry-After`` header)
* 413                                    -> :class:`~gpumesh.errors.PayloadTooLarge`
* 409 version_mismatch                   -> :class:`~gpumesh.errors.VersionMismatch`
* other 4xx / 5xx                        -> :class:`~gpumesh.errors.RequestRejected`
* a TLS certificate that cannot be verified, or that does not match the pinned
  fingerprint                           -> :class:`~gpumesh.errors.AuthError` (never a
  silent local run: the coordinator may be an impostor)

**Pinning** (``fingerprint="SHA256:<hex>"``, for ``https://`` URLs, typically a coordinator
started with ``serve --tls``): on first use the transport opens one TLS connection
without verification, reads the certificate the server presents and compares its
SHA-256 with the pin. If they match, that certificate becomes the *only* trust anchor of
an ``ssl.SSLContext`` (hostname checks off: the pin, not the name, identifies the
server), and every later connection is verified by OpenSSL against it. A server that
presents another certificate later — a new one, or an impostor — fails the handshake,
which surfaces as an ``AuthError`` naming the pin. Without a pin, ``https://`` URLs are
verified against the system's CAs as usual.
"""

from __future__ import annotations

import contextlib
import json as _json
import re
import socket
import ssl
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from urllib.parse import urlencode, urlsplit

import urllib3
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.exceptions import (ConnectTimeoutError, HTTPError, NewConnectionError,
                                ProtocolError, ReadTimeoutError)

from . import handoff
from .errors import (AuthError, LockedOut, MeshUnavailable, PayloadTooLarge, RequestRejected,
                     VersionMismatch)
from .limits import (CONNECT_TIMEOUT_S, READ_TIMEOUT_S, TCP_KEEPCNT, TCP_KEEPIDLE_S,
                     TCP_KEEPINTVL_S)
from .protocol import ErrorCode

#: Connections kept open to the coordinator per Transport (a worker with many slots posts
#: many results at once; beyond this, extra connections are opened and closed after use).
POOL_SIZE = 64
#: Largest piece of a request body handed to the socket at once: at most 3 s
#: (CONNECT_TIMEOUT_S) per piece means links down to ~85 KB/s upload without a timeout.
SEND_PIECE_BYTES = 256 * 1024


class Unreachable(MeshUnavailable):
    """The coordinator did not answer. ``sent`` says whether the request may have arrived."""

    def __init__(self, message: str, sent: bool):
        super().__init__(message)
        self.sent = sent


class Response:
    """A finished response: ``status_code``, ``headers`` (lower-case names), ``content``."""

    __slots__ = ("status_code", "headers", "content")

    def __init__(self, status_code: int, headers: dict[str, str], content: bytes):
        self.status_code, self.headers, self.content = status_code, headers, content

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")

    def json(self) -> Any:
        """The body as JSON (``ValueError`` if it is not)."""
        return _json.loads(self.content)


#: OpenSSL's verify codes for a certificate outside its validity dates (X509_V_ERR_*).
_CERT_DATES = {9: "is not valid yet", 10: "has expired"}


class Transport:
    """Requests to one coordinator ``url`` with bearer ``token`` (may be None).

    ``fingerprint`` (``SHA256:<hex>``) pins the coordinator's TLS certificate (see the
    module docstring); it needs an ``https://`` URL (``ValueError`` otherwise).
    """

    def __init__(self, url: str, token: str | None, *, fingerprint: str | None = None):
        self.url = url.rstrip("/")
        self.fingerprint = None
        if fingerprint:
            from .tls import normalise_fingerprint
            self.fingerprint = normalise_fingerprint(fingerprint)
            if not url.lower().startswith("https://"):
                raise ValueError(f"a TLS fingerprint was given but {url} is not an https:// URL")
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s):// URL: {url!r}")
        self._prefix = parts.path  # a coordinator behind a path prefix
        from .versions import USER_AGENT
        self._headers = {"user-agent": USER_AGENT}  # the coordinator refuses other versions
        if handoff.fcntl is not None:  # this process maps store files under locks: see there
            self._headers[handoff.MAP_LOCKS_HEADER] = "1"
        if token is not None:
            # UTF-8 bytes: a token with non-Latin-1 characters is still sent (and refused
            # by the coordinator with a clear 401) instead of failing inside the client.
            auth = b"Bearer " + token.encode("utf-8", "surrogateescape")
            self._headers["authorization"] = auth  # type: ignore[assignment]  # sent as they are
        self._pool: urllib3.HTTPConnectionPool | None = None

    @property
    def pool(self) -> urllib3.HTTPConnectionPool:
        """The keep-alive pool, made on first use (a pinned one fetches the server's
        certificate first: :class:`Unreachable` or :class:`AuthError` if that fails)."""
        if self._pool is None:
            kwargs: dict[str, Any] = {}
            if self.url.lower().startswith("https://"):
                if self.fingerprint is not None:
                    kwargs.update(ssl_context=pinned_context(self.url, self.fingerprint),
                                  assert_hostname=False)
                else:
                    kwargs.update(cert_reqs="CERT_REQUIRED")
            pool = urllib3.connection_from_url(
                self.url, maxsize=POOL_SIZE, block=False, retries=False,
                timeout=urllib3.Timeout(connect=CONNECT_TIMEOUT_S, read=READ_TIMEOUT_S),
                socket_options=HTTPConnection.default_socket_options + keepalive_options(),
                **kwargs)
            pool.ConnectionCls = (_JoinedHTTPS if isinstance(pool, urllib3.HTTPSConnectionPool)
                                  else _JoinedHTTP)
            self._pool = pool
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def _cert_refused(self, e: BaseException | None) -> AuthError | None:
        """An AuthError if ``e`` was caused by a certificate that failed verification."""
        seen = set()
        while e is not None and id(e) not in seen:
            seen.add(id(e))
            if isinstance(e, ssl.SSLCertVerificationError):
                if self.fingerprint and e.verify_code in _CERT_DATES:
                    # The pinned certificate itself, outside its dates: not an impostor.
                    return AuthError(
                        f"the coordinator at {self.url} presents a certificate that "
                        f"{_CERT_DATES[e.verify_code]} ({e.verify_message}); if this machine's "
                        "clock is right, the coordinator needs a new one (a self-signed one: "
                        "delete the tls folder in its data directory and restart `gpumesh "
                        "serve --tls`; your own: a new --tls-cert), then pin the fingerprint "
                        "it prints")
                if self.fingerprint:
                    return AuthError(
                        f"the coordinator at {self.url} no longer presents the certificate pinned "
                        f"as {self.fingerprint} ({e.verify_message}): it made a new one, or "
                        "something is intercepting the connection. Pin a new fingerprint only "
                        "if it is the one `gpumesh serve --tls` printed on the coordinator's "
                        "machine")
                return AuthError(
                    f"cannot verify the TLS certificate of {self.url} ({e.verify_message}); for a "
                    "coordinator started with --tls pass the fingerprint it printed "
                    "(--fingerprint, GPUMesh(fingerprint=...) or $GPUMESH_FINGERPRINT)")
            e = e.__cause__ or e.__context__ or (e.args[0] if e.args and isinstance(
                e.args[0], BaseException) else None)
        return None

    def _open(self, method: str, path: str, *, json: Any, content: Any, params: dict | None,
              timeout: float | None, headers: dict | None):
        """Send a request; return the urllib3 response with its body not yet read."""
        url = self._prefix + path
        if params:
            url += "?" + urlencode(params)
        hdrs = dict(self._headers)
        body = content
        if json is not None:
            body = _json.dumps(json).encode()
            hdrs["content-type"] = "application/json"
        if headers:
            hdrs.update(headers)
        if body is not None:
            if isinstance(body, (bytes, bytearray, memoryview)):
                body = [body]
                hdrs["content-length"] = str(memoryview(body[0]).nbytes)
            elif "content-length" not in {k.lower() for k in hdrs}:
                body = [b"".join(body)]  # an iterable of unknown total size: send it whole
                hdrs["content-length"] = str(len(body[0]))
            body = _pieces(body)
        read = READ_TIMEOUT_S if timeout is None else timeout
        with self._network_errors():
            return self.pool.urlopen(method, url, body=body, headers=hdrs, redirect=False,
                                     preload_content=False, release_conn=False,
                                     timeout=urllib3.Timeout(connect=CONNECT_TIMEOUT_S, read=read))

    def request(self, method: str, path: str, *, json: Any = None,
                content: bytes | Iterable[bytes | memoryview] | None = None, params: dict | None = None,
                timeout: float | None = None, headers: dict | None = None) -> Response:
        """Send one request and return the (successful) response with its body read.
        ``content`` may be an iterable of bytes when ``headers`` give its Content-Length
        (it is then streamed). Raises as listed in the module docstring."""
        resp = self._open(method, path, json=json, content=content, params=params,
                          timeout=timeout, headers=headers)
        try:
            with self._network_errors():
                out = Response(resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read())
        except BaseException:
            resp.close()  # a half-read connection is never reused
            raise
        finally:
            resp.release_conn()
        check(out, self.url, "authorization" in self._headers)
        return out

    @contextlib.contextmanager
    def stream_lines(self, path: str, timeout: float) -> Iterator[tuple[int, Iterator[str]]]:
        """GET ``path`` and yield ``(status, lines)``, the lines arriving as the server sends
        them (a long-lived response such as the worker's pulse). ``timeout``: the longest
        silence tolerated, in seconds. Raises :class:`Unreachable` when it ends abnormally."""
        resp = self._open("GET", path, json=None, content=None, params=None,
                          timeout=timeout, headers=None)

        def lines() -> Iterator[str]:
            with self._network_errors():
                pending = b""
                for chunk in resp.stream(64 * 1024):
                    pending += chunk
                    *complete, pending = pending.split(b"\n")
                    for line in complete:
                        yield line.decode("utf-8", "replace")
        try:
            yield resp.status, lines()
        finally:
            resp.close()  # whatever is left unread: this connection is not reused
            resp.release_conn()

    @contextlib.contextmanager
    def _network_errors(self) -> Iterator[None]:
        """urllib3's network failures as :class:`Unreachable` (or the refused certificate)."""
        # The messages name the root cause ("[Errno 111] Connection refused"), and the
        # client library's own exception chain is dropped: it would only add its frames.
        try:
            yield
        except (NewConnectionError, ConnectTimeoutError) as e:
            raise Unreachable(f"cannot reach the coordinator at {self.url}: {_reason(e)}",
                              sent=False) from None
        except urllib3.exceptions.SSLError as e:
            cert = self._cert_refused(e)
            if cert is not None:
                raise cert from None
            raise Unreachable(f"no TLS connection to the coordinator at {self.url}: {_reason(e)}",
                              sent=False) from None
        except (ReadTimeoutError, ProtocolError, HTTPError, OSError) as e:
            raise Unreachable(f"the coordinator at {self.url} did not answer: {_reason(e)}",
                              sent=True) from None

    def stream_into(self, method: str, path: str, *, params: dict | None = None,
                    json: Any = None, content: Any = None, headers: dict | None = None,
                    timeout: float | None = None, buffer_for=bytearray,
                    on_head: Callable[[], None] | None = None):
        """Send a request and read the (successful) body straight into one writable
        buffer: ``buffer_for(size)`` for a body of a declared ``size`` in bytes (default a
        ``bytearray``; any writable object with the buffer protocol), a ``bytearray``
        otherwise. Returns that buffer, or ``None`` for 204. ``on_head()`` is called once
        a successful answer's head has arrived, before its body is read (which behind a
        slow link may take seconds).

        The socket reads straight into the preallocated buffer (no growing, no joining,
        no temporary copies), and NumPy arrays unpickled from it are writable views of it.
        """
        resp = self._open(method, path, json=json, content=content, params=params,
                          timeout=timeout, headers=headers)
        done = False
        try:
            with self._network_errors():
                if resp.status >= 400:
                    check(Response(resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read()),
                          self.url, "authorization" in self._headers)
                if resp.status == 204:
                    resp.read()
                    done = True
                    return None
                if on_head is not None:
                    on_head()
                declared = resp.headers.get("content-length")
                if declared is None:  # not sent by the coordinator, but be lenient
                    buf = bytearray(resp.read())
                    done = True
                    return buf
                size = int(declared)
                buf = buffer_for(size)
                view = memoryview(buf)
                # urllib3's own readinto reads into a temporary bytes object and copies it;
                # the http.client response under it reads from the socket straight into our
                # buffer (a 64 MiB result: one copy and one allocation fewer).
                raw: Any = getattr(resp, "_fp", None)
                readinto = raw.readinto if hasattr(raw, "readinto") else resp.readinto
                pos = 0
                while pos < size:
                    n = readinto(view[pos:])
                    if not n:
                        break
                    pos += n
                if pos != size:
                    raise Unreachable(f"response from {self.url} ended after {pos} of {size} bytes",
                                      sent=True)
                done = True
                return buf
        finally:
            if not done:
                resp.close()  # a half-read connection is never reused
            resp.release_conn()


class _Joined:
    """A connection that sends a request's head and the start of its body in one write.

    urllib3 writes the head, then each piece of the body, one ``sendall`` each: with
    TCP_NODELAY that is a segment each, and the coordinator reads and parses the head
    apart from the body (a turn of its event loop each). The writes of one request are
    held and joined (up to ``JOIN_BYTES``, one copy of them) and sent together; a piece
    that does not fit is sent as it is, after what was held. ``JOIN_BYTES`` takes a head
    and a whole body piece (``SEND_PIECE_BYTES``, a result post's payload up to the
    batch limit): under a limit of 64 KiB, a 64 KiB result's post sent its head apart,
    and the coordinator read it in a turn of its own (docs/performance.md, "Ninth
    session: where a small result's extra cost is")."""

    JOIN_BYTES = SEND_PIECE_BYTES + 64 * 1024
    _held: list[bytes | bytearray | memoryview] | None = None
    _held_n = 0

    def request(self, *args: Any, **kwargs: Any) -> None:
        self._held, self._held_n = [], 0
        try:
            super().request(*args, **kwargs)  # type: ignore[misc]
            self._send_held()
        finally:
            self._held = None

    def send(self, data: Any) -> None:
        held = self._held
        if held is None or not isinstance(data, (bytes, bytearray, memoryview)):
            return super().send(data)  # type: ignore[misc]
        n = memoryview(data).nbytes
        if self._held_n + n <= self.JOIN_BYTES:
            # Held as it is, not copied: it is joined (copied once) before request()
            # returns, while the body it belongs to is still the caller's to keep.
            held.append(data)
            self._held_n += n
            return None
        self._send_held()
        return super().send(data)  # type: ignore[misc]

    def _send_held(self) -> None:
        held = self._held
        if held:
            data = held[0] if len(held) == 1 else b"".join(held)  # (join takes views too)
            held.clear()
            self._held_n = 0
            # What this send writes itself (a connection opened now, a proxy's CONNECT)
            # goes straight out.
            self._held = None
            try:
                super().send(data)  # type: ignore[misc]
            finally:
                self._held = held


class _JoinedHTTP(_Joined, HTTPConnection):
    pass


class _JoinedHTTPS(_Joined, HTTPSConnection):
    pass


def _pieces(chunks: Iterable) -> Iterator[bytes | memoryview]:
    """A body as views of at most SEND_PIECE_BYTES, never copies. urllib3 sends a body
    under the *connect* timeout, one ``sendall`` per piece, so a piece must be small
    enough to leave within CONNECT_TIMEOUT_S even on a slow link."""
    for c in chunks:
        if isinstance(c, bytes) and len(c) <= SEND_PIECE_BYTES:
            yield c
            continue
        view = memoryview(c).cast("B")
        for i in range(0, view.nbytes, SEND_PIECE_BYTES):
            yield view[i:i + SEND_PIECE_BYTES]


def _reason(e: BaseException) -> str:
    """The innermost cause of a network error, as one short phrase."""
    if isinstance(e, (ReadTimeoutError, ConnectTimeoutError)) and not isinstance(e, NewConnectionError):
        return "timed out"
    while True:
        inner = e.__cause__ or e.__context__
        if inner is None and e.args and isinstance(e.args[-1], BaseException):
            inner = e.args[-1]  # urllib3 keeps the socket error as an argument
        if inner is None or inner is e:
            break
        e = inner
    text = str(e) or type(e).__name__
    if isinstance(e, ssl.SSLError) and getattr(e, "reason", None):
        text = e.reason
    return text.split(": ", 1)[1] if text.startswith("HTTPConnection") and ": " in text else text


def keepalive_options() -> list[tuple[int, int, int]]:
    """Socket options turning on TCP keepalive with the timings of ``limits``."""
    opts = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
    for name, value in (("TCP_KEEPIDLE", TCP_KEEPIDLE_S), ("TCP_KEEPINTVL", TCP_KEEPINTVL_S),
                        ("TCP_KEEPCNT", TCP_KEEPCNT)):
        if hasattr(socket, name):  # Linux has all three; macOS only some
            opts.append((socket.IPPROTO_TCP, getattr(socket, name), value))
    return opts


#: How to give a token, for an AuthError when none was sent.
GIVE_TOKEN = "pass --token, set $GPUMESH_TOKEN, or run gpumesh setup"


def check(resp: Response, url: str, token_sent: bool = True) -> None:
    """Raise the gpumesh error matching an HTTP error status; return for 2xx/3xx.
    ``token_sent``: the request carried a token (a 401 without one is no refusal of it)."""
    if resp.status_code < 400:
        return
    try:
        body = resp.json()
        code, message = body.get("error", ""), body.get("message", resp.text)
    except ValueError:  # not our API's JSON: a proxy's or another server's page, in one line
        # (an HTML page's texts, each once: its body often repeats its title)
        texts = [" ".join(t.split()) for t in re.split(r"<[^>]*>", resp.text[:2000])]
        words = ", ".join(dict.fromkeys(t for t in texts if t))[:200]
        code, message = "", (f"the server at {url} answered with a page that is not gpumesh's"
                             f" ({words or 'empty'}): check the URL, path prefix included")
    if resp.status_code == 401 and not token_sent:
        raise AuthError(f"no token is configured for the coordinator at {url}, which wants one "
                        f"({resp.status_code}: {message}); {GIVE_TOKEN}")
    if resp.status_code == 401 or (resp.status_code == 403 and code == ""):
        raise AuthError(f"the coordinator at {url} refused the token ({resp.status_code}: {message}); "
                        "check --token / $GPUMESH_TOKEN")
    if resp.status_code == 403 and code == ErrorCode.FORBIDDEN:  # a good token, another role's job
        # (the coordinator's text names the action and who can give a token that may)
        raise AuthError(f"the coordinator at {url} does not allow this: {message} (HTTP 403)")
    if resp.status_code == 429 and code == ErrorCode.LOCKED_OUT:
        try:
            wait = max(1.0, float((getattr(resp, "headers", None) or {}).get("retry-after", "")))
        except ValueError:
            wait = 60.0
        raise LockedOut(f"the coordinator at {url} refuses this address for now ({message}); "
                        f"the refused tokens may be another program's at the same address (a "
                        f"shared NAT or proxy): wait {wait:.0f}s, and if they were yours, check "
                        f"--token / $GPUMESH_TOKEN", wait)
    if resp.status_code == 413:
        raise PayloadTooLarge(message or "request over the coordinator's size limit")
    if code == ErrorCode.VERSION_MISMATCH:
        raise VersionMismatch(message)
    err = RequestRejected(f"{message} (HTTP {resp.status_code})", resp.status_code)
    err.code = code  # type: ignore[attr-defined]
    raise err


def fetch_certificate(url: str) -> bytes:
    """The DER certificate the TLS server at ``url`` presents (not verified). The connect
    and the handshake each get ``CONNECT_TIMEOUT_S`` (the socket's timeout holds for both).
    Raises :class:`Unreachable` (``sent=False``) if no TLS connection can be made."""
    parts = urlsplit(url)
    host, port = parts.hostname or "", parts.port or 443
    try:
        raw = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S)
    except OSError as e:
        raise Unreachable(f"cannot reach the coordinator at {url}: {e}", sent=False) from e
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    try:
        with ctx.wrap_socket(raw, server_hostname=host) as tls:
            der = tls.getpeercert(binary_form=True)
    except (OSError, ssl.SSLError) as e:
        raise Unreachable(f"no TLS handshake with the coordinator at {url} (is it serving "
                          f"https? start it with --tls): {e}", sent=False) from e
    finally:
        raw.close()
    if not der:
        raise Unreachable(f"the coordinator at {url} presented no certificate", sent=False)
    return der


def pinned_context(url: str, fingerprint: str) -> ssl.SSLContext:
    """An ``SSLContext`` that trusts only the certificate the server at ``url`` presents
    now, after checking that it matches ``fingerprint`` (``SHA256:<hex>``).
    Raises :class:`~gpumesh.errors.AuthError` on a mismatch, :class:`Unreachable` if the
    server cannot be reached."""
    from .tls import fingerprint_der, normalise_fingerprint
    want = normalise_fingerprint(fingerprint)
    der = fetch_certificate(url)
    got = fingerprint_der(der)
    if got != want:
        raise AuthError(f"the coordinator at {url} presents certificate {got}, not the pinned "
                        f"{want}: it made a new one, or something is intercepting the connection. "
                        "Pin the new one only if it is the one `gpumesh serve --tls` printed on "
                        "the coordinator's machine (read there, not from this message)")
    ctx = ssl.create_default_context(cadata=ssl.DER_cert_to_PEM_cert(der))
    ctx.check_hostname = False  # the pin identifies the server, whatever name was dialled
    ctx.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN  # a pinned CA-issued leaf anchors too
    return ctx
