"""Who may call the coordinator: token verification, roles and the failed-auth lockout.

Checking a request::

    Authorization: Bearer <token>
        │ address locked out? ──────────────────────────────► 429 locked_out (no token check)
        ▼
    tag = HMAC-SHA256(per-process random key, token)
        │ tag equals the tag of a token verified before? ───► role (main or worker)
        │ tag of a token refused recently? ─────────────────► 401 (counted as a failure)
        ▼
    scrypt(token, per-start random salt) == stored hash?  (in a thread, one at a time)
        yes ► remember the tag ► role          no ► remember the tag ► 401 (a failure)

**What is kept.** The coordinator keeps, per role, only ``scrypt(token, salt)`` with a
salt drawn at each start; the token string itself is dropped once hashed. A token is
verified with the KDF the first time it is presented; after that a keyed hash of it (an
HMAC under a key drawn at each start, never written anywhere) is recognised with one HMAC
and a dictionary lookup, so the per-request cost stays low. Every comparison is constant-time
(:func:`hmac.compare_digest`). The trade-off, stated plainly: someone who can read the
coordinator's memory gets the HMAC key and tag, and with them a fast test of guesses —
which is why a token's entropy stays the real defence and ``serve`` refuses short ones.
(Such a reader can usually read ``~/.gpumesh/config.json`` as well.)

**Roles.** The main token may do everything. The optional worker token
(``serve --worker-token``) may only do what a worker does: register, heartbeat, hold its
pulse, lease, post results and output, download function blobs. It cannot submit, cancel,
list or read jobs, results or logs, nor upload blobs: a 403 names the action.

**People.** Tokens added with ``gpumesh token add`` (:mod:`.people`) are recognised by
their SHA-256 digest before the KDF path is tried; :meth:`Authenticator.identity` says
which person and role a request comes from (the main token is person ``admin``, role
``admin``; the worker token person and role ``worker``).

**Lockout.** ``AUTH_FAIL_MAX`` refused tokens from one client address within
``AUTH_FAIL_WINDOW_S`` lock that address out for ``AUTH_LOCKOUT_S`` (429 with
``Retry-After``); a success clears the count. Loopback clients are exempt only while the
coordinator is bound to loopback, *no* tunnel or proxy is declared to front it
(``serve --public``, ``--tailscale`` or ``--trusted-proxy``: ``fronted``), *and* the
request carries no proxy header (``Forwarded``, ``X-Forwarded-For``, ...): a proxy or
tunnel agent on the same machine makes remote clients look local, so its requests are
counted like anyone's. A plain TCP tunnel adds no header: set
``GPUMESH_LOOPBACK_EXEMPT=0`` when you use one.

**Which address is counted.** The socket's peer, unless that peer is a *trusted proxy*
(``serve --trusted-proxy CIDR``; ``--public`` trusts loopback, where the in-process ngrok
agent connects from). Then ``X-Forwarded-For`` is read from the right: each proxy appends
the address it saw, so the first hop, from the right, that is not itself a trusted proxy
is the client. Entries to its left were written by the client and are never believed, so
a guesser cannot dodge the count by inventing a new ``X-Forwarded-For`` per request; a
malformed entry ends the walk at the last trusted hop. uvicorn's own proxy-header
rewriting stays off: this is the one place a header may name the client. Behind an
untrusted proxy all clients share the proxy's address, which can lock them out together
but never lets one escape the count.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import ipaddress
import os
import threading
import time
from collections import OrderedDict, deque

from . import people
from ..limits import (AUTH_FAIL_MAX, AUTH_FAIL_WINDOW_S, AUTH_LOCKOUT_S, AUTH_LOOPBACK_EXEMPT,
                      AUTH_TRACKED_ADDRESSES, MAX_FORWARDED_HOPS, MAX_TOKEN_CHARS)

ROLE_MAIN = "main"
ROLE_WORKER = "worker"

#: scrypt cost: N (CPU/memory), r (block size), p (parallelism): 128 * N * r = 32 MiB per
#: derivation, slow enough to make guessing costly (its time: docs/performance.md) and paid
#: once per distinct token presented, not per request.
KDF_N, KDF_R, KDF_P = 2**15, 8, 1
KDF_MAXMEM_BYTES = 64 * 2**20
#: Bytes of random salt drawn at each start.
SALT_BYTES = 16
#: Recently refused tokens remembered (as keyed hashes) so a repeated wrong token costs
#: no second KDF run.
REFUSED_CACHE = 1024

#: Request headers that a proxy or tunnel adds: their presence means "not a local caller".
PROXY_HEADERS = ("forwarded", "x-forwarded-for", "x-forwarded-host", "x-forwarded-proto",
                 "x-real-ip", "via", "cf-connecting-ip", "true-client-ip")
_PROXY_HEADER_NAMES = frozenset(h.encode("latin-1") for h in PROXY_HEADERS)


def kdf(token: bytes, salt: bytes) -> bytes:
    """``scrypt(token, salt)`` with the cost parameters above (32 bytes)."""
    return hashlib.scrypt(token, salt=salt, n=KDF_N, r=KDF_R, p=KDF_P, maxmem=KDF_MAXMEM_BYTES,
                          dklen=32)


class AuthRefused(Exception):
    """A request that may not proceed: ``status`` (401, 403 or 429), ``code``, ``message``,
    and ``retry_after`` (seconds, for 429)."""

    def __init__(self, status: int, code: str, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.retry_after = status, code, message, retry_after


class TokenCheck:
    """Tells which role a presented token belongs to, keeping only salted KDF hashes.

    ``tokens`` maps a role to its token (UTF-8 encoded for hashing). Thread-safe.
    """

    def __init__(self, tokens: dict[str, str]):
        self._salt = os.urandom(SALT_BYTES)
        self._key = os.urandom(32)
        self._hashes = [(role, kdf(tok.encode("utf-8"), self._salt)) for role, tok in tokens.items()]
        self._known: list[tuple[bytes, str]] = []  # (tag, role) of tokens verified before
        self._refused: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()

    def _tag(self, presented: bytes) -> bytes:
        return hmac.new(self._key, presented, hashlib.sha256).digest()

    def cached(self, presented: bytes) -> tuple[bool, str | None]:
        """``(True, role or None)`` when the answer is known without the KDF, else
        ``(False, None)``."""
        tag = self._tag(presented)
        role = None
        for known, r in self._known:  # at most one entry per role: compare them all
            if hmac.compare_digest(known, tag):
                role = r
        if role is not None:
            return True, role
        with self._lock:
            if tag in self._refused:
                self._refused.move_to_end(tag)
                return True, None
        return False, None

    def verify(self, presented: bytes) -> str | None:
        """The role of ``presented`` (raw token bytes), or None. Runs the KDF on a miss."""
        hit, role = self.cached(presented)
        if hit:
            return role
        derived = kdf(presented, self._salt)
        role = None
        for r, stored in self._hashes:
            if hmac.compare_digest(derived, stored):
                role = r
        tag = self._tag(presented)
        with self._lock:
            if role is not None:
                if all(r != role for _, r in self._known):
                    self._known.append((tag, role))
            else:
                self._refused[tag] = None
                while len(self._refused) > REFUSED_CACHE:
                    self._refused.popitem(last=False)
        return role


class FailureLimiter:
    """Counts failed authentications per client address and locks noisy ones out.

    Numbers: ``AUTH_FAIL_MAX`` failures within ``AUTH_FAIL_WINDOW_S`` seconds lock an
    address out for ``AUTH_LOCKOUT_S`` seconds (settings of :mod:`gpumesh.limits`); at
    most ``max_tracked`` addresses are remembered (the least recently seen are forgotten).
    ``clock`` is injectable for tests.
    """

    def __init__(self, max_tracked: int = AUTH_TRACKED_ADDRESSES, clock=time.monotonic):
        self.max_tracked, self.clock = max_tracked, clock
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()
        self._locked: dict[str, float] = {}

    def locked_for(self, addr: str) -> float:
        """Seconds ``addr`` is still locked out (0.0 when it is not)."""
        until = self._locked.get(addr)
        if until is None:
            return 0.0
        left = until - self.clock()
        if left <= 0:
            del self._locked[addr]
            return 0.0
        return left

    def failed(self, addr: str) -> bool:
        """Record a failure of ``addr``; True if it is now locked out."""
        now = self.clock()
        times = self._failures.pop(addr, None) or deque()
        times.append(now)
        while times and now - times[0] > AUTH_FAIL_WINDOW_S:
            times.popleft()
        if len(times) >= AUTH_FAIL_MAX:
            self._locked[addr] = now + AUTH_LOCKOUT_S
            return True
        self._failures[addr] = times
        while len(self._failures) > self.max_tracked:
            self._failures.popitem(last=False)
        if len(self._locked) > self.max_tracked:  # drop expired lockouts
            for a in [a for a, t in self._locked.items() if t <= now]:
                del self._locked[a]
        return False

    def succeeded(self, addr: str) -> None:
        """A right token from ``addr``: its earlier failures are forgiven."""
        self._failures.pop(addr, None)


@functools.lru_cache(maxsize=4096)  # asked on every request, for few distinct peers
def is_loopback(host: str | None) -> bool:
    """Whether ``host`` (an address or ``localhost``) is a loopback address."""
    if not host:
        return False
    if host == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host.strip("[]").split("%")[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_networks(values) -> tuple[Network, ...]:
    """``values`` (CIDR strings such as ``10.0.0.0/8``, or single addresses) as networks.
    Raises ``ValueError`` naming the first one that is not an address or a CIDR range."""
    out = []
    for v in values:
        v = str(v).strip()
        try:
            out.append(ipaddress.ip_network(v, strict=False))
        except ValueError:
            raise ValueError(f"{v!r} is not an IP address or CIDR range (e.g. 10.0.0.0/8, "
                             "127.0.0.1/32, fd00::/8)") from None
    return tuple(out)


def _address(text: str | None) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``text`` as an IP address (IPv4-mapped IPv6 as IPv4); None if it is not one. Some
    proxies write a port too: ``192.0.2.1:4711`` and ``[2001:db8::1]:4711`` are read."""
    if not text:
        return None
    text = text.strip()
    if text.startswith("["):
        text = text[1:].partition("]")[0]
    elif text.count(":") == 1:
        text = text.partition(":")[0]
    try:
        ip = ipaddress.ip_address(text.split("%")[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip


def forwarded_client(peer: str | None, headers, trusted: tuple[Network, ...]) -> str | None:
    """The address a request is judged by: ``peer`` (the socket's), or, when ``peer`` is in
    ``trusted``, the rightmost ``X-Forwarded-For`` hop that is not (module docstring)."""
    here = _address(peer)
    if here is None or not any(here in net for net in trusted):
        return peer
    getlist = getattr(headers, "getlist", None)
    lines = getlist("x-forwarded-for") if getlist else [headers.get("x-forwarded-for", "")]
    hops = [h for line in lines for h in line.split(",") if h.strip()]
    for hop in reversed(hops[-MAX_FORWARDED_HOPS:]):
        ip = _address(hop)
        if ip is None:  # not written by a proxy we trust: stop at the last one that was
            break
        here = ip
        if not any(ip in net for net in trusted):
            break
    return str(here)


class Authenticator:
    """Checks every request's bearer token: role, lockout, loopback exemption.

    ``token`` is the main token, ``worker_token`` the optional worker-only one;
    ``loopback_bound`` says the coordinator listens on a loopback address only.
    ``trusted_proxies``: networks whose ``X-Forwarded-For`` is believed; ``fronted``: a
    tunnel or proxy fronts the coordinator (either turns the loopback exemption off).
    """

    def __init__(self, token: str, worker_token: str | None = None, *, loopback_bound: bool = False,
                 limiter: FailureLimiter | None = None, loopback_exempt: bool = AUTH_LOOPBACK_EXEMPT,
                 trusted_proxies=(), fronted: bool = False, people=None):
        tokens = {ROLE_MAIN: token}
        if worker_token:
            tokens[ROLE_WORKER] = worker_token
        self.tokens = TokenCheck(tokens)
        self.limiter = limiter or FailureLimiter()
        self.loopback_bound = loopback_bound
        self.trusted_proxies = parse_networks(trusted_proxies)
        self.fronted = fronted or bool(self.trusted_proxies)
        self.loopback_exempt = loopback_exempt and not self.fronted
        self._kdf_gate: asyncio.Semaphore | None = None
        self.people = people  # a people.People, or None: only the serve tokens

    def client(self, peer: str | None, headers) -> str | None:
        """The address this request's failures are counted against (module docstring)."""
        if not self.trusted_proxies:
            return peer
        return forwarded_client(peer, headers, self.trusted_proxies)

    def exempt(self, client_host: str | None, headers) -> bool:
        """Whether failures from this client are not counted (see the module docstring)."""
        if not (self.loopback_exempt and self.loopback_bound and is_loopback(client_host)):
            return False
        raw = getattr(headers, "raw", None)  # Starlette's: one pass over the names
        if raw is not None:
            return not any(name.lower() in _PROXY_HEADER_NAMES for name, _ in raw)
        return not any(h in headers for h in PROXY_HEADERS)

    async def role(self, client_host: str | None, headers) -> str:
        """The caller's role (``main``, ``worker``, or a person's role); raises
        :class:`AuthRefused` (401 or 429). ``client_host`` is the socket's peer address."""
        who = await self.identity(client_host, headers)
        return ROLE_MAIN if who.admin else who.role

    async def identity(self, client_host: str | None, headers) -> people.Identity:
        """Who the caller is (:class:`.people.Identity`); raises :class:`AuthRefused`
        (401 or 429). ``client_host`` is the socket's peer address."""
        exempt = self.exempt(client_host, headers)
        addr = self.client(client_host, headers) or "unknown"
        if not exempt:
            left = self.limiter.locked_for(addr)
            if left > 0:
                raise AuthRefused(429, "locked_out",
                                  f"too many refused tokens from {addr}: locked out for another "
                                  f"{left:.0f}s", retry_after=left)
        scheme, _, presented = headers.get("authorization", "").partition(" ")
        presented = presented.strip()
        if scheme.lower() != "bearer" or not presented:
            raise AuthRefused(401, "unauthorized",
                              "missing bearer token (Authorization: Bearer <token>)")
        role = None
        who = None
        if len(presented) <= MAX_TOKEN_CHARS:
            raw = presented.encode("latin-1", "replace")  # the header's raw bytes
            if self.people is not None:
                who = self.people.lookup(raw)
            hit, role = (True, None) if who is not None else self.tokens.cached(raw)
            if not hit:
                if self._kdf_gate is None:
                    self._kdf_gate = asyncio.Semaphore(1)
                async with self._kdf_gate:  # one KDF at a time: a flood costs one core
                    role = await asyncio.to_thread(self.tokens.verify, raw)
        if who is None and role is not None:
            who = people.MAIN if role == ROLE_MAIN else people.WORKER_IDENTITY
        if who is None:
            if not exempt and self.limiter.failed(addr):
                raise AuthRefused(429, "locked_out",
                                  f"too many refused tokens from {addr}: locked out for "
                                  f"{AUTH_LOCKOUT_S:.0f}s", retry_after=AUTH_LOCKOUT_S)
            raise AuthRefused(401, "unauthorized", "the token was refused")
        if not exempt:
            self.limiter.succeeded(addr)
        return who
