"""A test double of the ngrok Agent SDK (PyPI ``ngrok``) at its boundary, for ``serve --public``.

The real SDK opens a session to ngrok's cloud and returns a listener whose public
``https://`` endpoint ngrok's edge forwards to ``addr``; the edge terminates TLS and adds
``X-Forwarded-For`` with the caller's address. This double does the same on loopback:
:func:`forward` starts an "edge", a small TLS reverse proxy on 127.0.0.1 whose certificate
is ``$FAKE_NGROK_CERT``/``$FAKE_NGROK_KEY`` (the test makes clients trust it, as the
system's CAs trust ngrok's), and returns a :class:`Listener` with ``url()``;
:func:`disconnect` (``url``) ends it. Signatures as in the SDK (1.x; checked against it by
``test_the_sdk_double_has_the_sdks_signatures`` where the SDK is installed).

Put the directory holding this file first on ``PYTHONPATH`` to use it. The authtoken is
taken as the SDK takes it (``authtoken=`` or, with ``authtoken_from_env=True``,
``$NGROK_AUTHTOKEN``); the token ``refused`` fails the way a revoked token does.
Each client connection carries one request (the edge answers ``Connection: close``).
"""

from __future__ import annotations

import os
import socket
import ssl
import threading

_OPEN: dict[str, "_Edge"] = {}


def forward(addr=None, proto=None, **options):
    token = options.get("authtoken") or (
        os.environ.get("NGROK_AUTHTOKEN") if options.get("authtoken_from_env") else None)
    if not token:
        raise ValueError("failed to connect session: authentication failed: no authtoken")
    if token == "refused":
        raise ValueError("failed to connect session: The authtoken you specified does not look "
                         "like a proper ngrok authtoken. ERR_NGROK_105")
    host, _, port = str(addr).rpartition(":")
    listener = Listener(_Edge((host.strip("[]") or "127.0.0.1", int(port))))
    _OPEN[listener.url()] = listener._edge
    return listener


def disconnect(url=None):
    for u in [url] if url else list(_OPEN):
        edge = _OPEN.pop(u, None)
        if edge is not None:
            edge.close()


class Listener:
    def __init__(self, edge):
        self._edge = edge

    def url(self) -> str:
        return f"https://localhost:{self._edge.port}"


class _Edge:
    def __init__(self, upstream: tuple[str, int]):
        self.upstream = upstream
        self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.ctx.load_cert_chain(os.environ["FAKE_NGROK_CERT"], os.environ["FAKE_NGROK_KEY"])
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self.closed = True
        self.sock.close()

    def _accept(self) -> None:
        while not self.closed:
            try:
                conn, peer = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn, peer[0]), daemon=True).start()

    def _serve(self, raw: socket.socket, client: str) -> None:
        try:
            conn = self.ctx.wrap_socket(raw, server_side=True)
        except (OSError, ssl.SSLError):
            raw.close()
            return
        up = None
        try:
            buf = b""
            while b"\r\n\r\n" not in buf:
                piece = conn.recv(65536)
                if not piece:
                    return
                buf += piece
            head, _, rest = buf.partition(b"\r\n\r\n")
            lines = head.split(b"\r\n")
            kept, forwarded, length = [lines[0]], None, 0
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                low = name.strip().lower()
                if low == b"x-forwarded-for":
                    forwarded = value.strip()
                elif low == b"content-length":
                    length = int(value.strip())
                    kept.append(line)
                elif low not in (b"connection", b"keep-alive", b"x-forwarded-proto"):
                    kept.append(line)
            # as ngrok's edge: the caller's address appended to what the caller claimed
            xff = (forwarded + b", " if forwarded else b"") + client.encode()
            kept += [b"X-Forwarded-For: " + xff, b"X-Forwarded-Proto: https", b"Connection: close"]
            up = socket.create_connection(self.upstream, timeout=10)
            up.settimeout(None)  # worker sessions stay open as long as the worker does
            up.sendall(b"\r\n".join(kept) + b"\r\n\r\n" + rest)
            left = length - len(rest)
            while left > 0:
                piece = conn.recv(min(65536, left))
                if not piece:
                    return
                up.sendall(piece)
                left -= len(piece)
            while True:  # the answer, as it comes (streams, long-polls), until the coordinator closes
                piece = up.recv(65536)
                if not piece:
                    break
                conn.sendall(piece)
        except OSError:
            pass
        finally:
            for s in (up, conn):
                if s is not None:
                    try:
                        s.close()
                    except OSError:
                        pass
