"""HTTP to the coordinator, shared by callers and workers: auth, timeouts, error mapping.

One keep-alive ``httpx.Client`` per :class:`Transport` (TCP_NODELAY is set by httpcore).
Every failure becomes a :mod:`gpumesh.errors` exception:

* connection refused / connect timeout  -> :class:`Unreachable` (``sent=False``: the
  coordinator never saw the request, so falling back to local execution is safe)
* read timeout / connection dropped      -> :class:`Unreachable` (``sent=True``)
* 401, 403 forbidden, 429 locked_out     -> :class:`~gpumesh.errors.AuthError`
* 413                                    -> :class:`~gpumesh.errors.PayloadTooLarge`
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
import socket
import ssl
import sys
from collections.abc import Iterable, Iterator
from typing import Any
from urllib.parse import urlsplit

# httpx's package __init__ imports its command-line client (httpx._main) whenever rich,
# pygments and click are installed, as they are with gpumesh: ~6 MiB and 100+ modules
# in every worker agent that never uses them. A None entry makes that optional import
# fail, so httpx binds its stub ``httpx.main`` instead; nothing else in httpx uses it.
# (No effect if httpx was imported already, e.g. by the caller's own code.)
if "httpx" not in sys.modules:
    sys.modules.setdefault("httpx._main", None)

import httpx  # noqa: E402 - after the line above

from .errors import AuthError, MeshUnavailable, PayloadTooLarge, RequestRejected
from .limits import (CONNECT_TIMEOUT_S, READ_TIMEOUT_S, TCP_KEEPCNT, TCP_KEEPIDLE_S,
                     TCP_KEEPINTVL_S)


class Unreachable(MeshUnavailable):
    """The coordinator did not answer. ``sent`` says whether the request may have arrived."""

    def __init__(self, message: str, sent: bool):
        super().__init__(message)
        self.sent = sent


class Transport:
    """Requests to one coordinator ``url`` with bearer ``token`` (may be None).

    ``fingerprint`` (``SHA256:<hex>``) pins the coordinator's TLS certificate (see the
    module docstring); it needs an ``https://`` URL (``ValueError`` otherwise).
    """

    def __init__(self, url: str, token: str | None, *, verify: Any = True,
                 fingerprint: str | None = None):
        self.url = url
        self.fingerprint = None
        if fingerprint:
            from .tls import normalise_fingerprint
            self.fingerprint = normalise_fingerprint(fingerprint)
            if not url.lower().startswith("https://"):
                raise ValueError(f"a TLS fingerprint was given but {url} is not an https:// URL")
        self._headers = {}
        if token is not None:
            # UTF-8 bytes: a token with non-Latin-1 characters is still sent (and refused
            # by the coordinator with a clear 401) instead of failing inside the client.
            self._headers["authorization"] = b"Bearer " + token.encode("utf-8", "surrogateescape")
        self._verify = verify
        self._client: httpx.Client | None = None

    @property
    def client(self) -> httpx.Client:
        """The keep-alive client, made on first use (a pinned one fetches the server's
        certificate first: :class:`Unreachable` or :class:`AuthError` if that fails)."""
        if self._client is None:
            verify = self._verify
            if self.fingerprint is not None:
                verify = pinned_context(self.url, self.fingerprint)
            limits = httpx.Limits(max_connections=64, max_keepalive_connections=16)
            self._client = httpx.Client(
                base_url=self.url, headers=self._headers, trust_env=False,
                timeout=httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S),
                transport=httpx.HTTPTransport(verify=verify, limits=limits,
                                              socket_options=keepalive_options()))
        return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def _cert_refused(self, e: BaseException) -> AuthError | None:
        """An AuthError if ``e`` was caused by a certificate that failed verification."""
        seen = set()
        while e is not None and id(e) not in seen:
            seen.add(id(e))
            if isinstance(e, ssl.SSLCertVerificationError):
                if self.fingerprint:
                    return AuthError(
                        f"the coordinator at {self.url} no longer presents the certificate pinned "
                        f"as {self.fingerprint} ({e.verify_message}): it made a new one, or "
                        "something is intercepting the connection. Check the fingerprint "
                        "`gpumesh serve --tls` printed")
                return AuthError(
                    f"cannot verify the TLS certificate of {self.url} ({e.verify_message}); for a "
                    "coordinator started with --tls pass the fingerprint it printed "
                    "(--fingerprint, GPUMesh(fingerprint=...) or $GPUMESH_FINGERPRINT)")
            e = e.__cause__ or e.__context__
        return None

    def request(self, method: str, path: str, *, json: Any = None,
                content: bytes | Iterable[bytes] | None = None, params: dict | None = None,
                timeout: float | None = None, headers: dict | None = None) -> httpx.Response:
        """Send one request and return the (successful) response with its body read."""
        kwargs: dict[str, Any] = {}
        if timeout is not None:
            kwargs["timeout"] = httpx.Timeout(timeout, connect=CONNECT_TIMEOUT_S)
        with self._network_errors():
            resp = self.client.request(method, path, json=json, content=content, params=params,
                                       headers=headers, **kwargs)
        check(resp, self.url)
        return resp

    @contextlib.contextmanager
    def _network_errors(self) -> Iterator[None]:
        """httpx's network failures as :class:`Unreachable` (or the refused certificate)."""
        try:
            yield
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            cert = self._cert_refused(e)
            if cert is not None:
                raise cert from e
            raise Unreachable(f"cannot reach the coordinator at {self.url}: {e}", sent=False) from e
        except httpx.TransportError as e:
            raise Unreachable(f"the coordinator at {self.url} did not answer: "
                              f"{type(e).__name__}: {e}", sent=True) from e

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
        with self._network_errors(), \
                self.client.stream(method, path, params=params, json=json, content=content,
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
    if resp.status_code == 401 or (resp.status_code == 403 and code in ("", "forbidden")):
        raise AuthError(f"the coordinator at {url} refused the token ({resp.status_code}: {message}); "
                        "check --token / $GPUMESH_TOKEN")
    if resp.status_code == 429 and code == "locked_out":
        raise AuthError(f"the coordinator at {url} refused the token ({message}); "
                        "check --token / $GPUMESH_TOKEN")
    if resp.status_code == 413:
        raise PayloadTooLarge(message or "request over the coordinator's size limit")
    err = RequestRejected(f"{message} (HTTP {resp.status_code})", resp.status_code)
    err.code = code  # type: ignore[attr-defined]
    raise err


def fetch_certificate(url: str, timeout: float = CONNECT_TIMEOUT_S) -> bytes:
    """The DER certificate the TLS server at ``url`` presents (not verified).
    Raises :class:`Unreachable` (``sent=False``) if no TLS connection can be made."""
    parts = urlsplit(url)
    host, port = parts.hostname or "", parts.port or 443
    try:
        raw = socket.create_connection((host, port), timeout=timeout)
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
                        "Check the fingerprint `gpumesh serve --tls` printed")
    ctx = ssl.create_default_context(cadata=ssl.DER_cert_to_PEM_cert(der))
    ctx.check_hostname = False  # the pin identifies the server, whatever name was dialled
    ctx.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN  # a pinned CA-issued leaf anchors too
    return ctx
