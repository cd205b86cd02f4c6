"""How machines on other networks reach a coordinator: ``serve --tailscale`` and ``--public``.

Workers dial out to the coordinator, so only the coordinator has to be reachable. Two
ways, both opt-in:

* **Tailscale** (``--tailscale``): this machine's tailnet address, asked of the
  ``tailscale`` CLI (``tailscale ip -4``; the MagicDNS name from ``tailscale status
  --json``), becomes the bind address. Only devices on the tailnet can connect; the LAN
  cannot (nothing listens on the LAN address), and nothing is announced over mDNS, which
  does not cross a tailnet anyway.
* **ngrok** (``--public``): the ngrok Agent SDK (PyPI ``ngrok``, the ``[tunnel]`` extra;
  no binary) runs inside ``serve`` and forwards a public ``https://`` endpoint to the
  bound port. Connections then arrive from loopback, with the caller's address in
  ``X-Forwarded-For`` as ngrok's edge writes it: that header is believed from loopback
  only, so refused tokens are counted per caller (see :mod:`gpumesh.coordinator.auth`).

Either way the coordinator counts as *fronted*: no client, loopback included, is exempt
from the refused-token lockout.

Failures a user can fix (Tailscale missing or logged out, no authtoken, the SDK missing,
ngrok refusing the session) raise :class:`ReachError` with one line saying what to run;
:func:`plan` and :func:`announce`, what ``serve`` calls, print that line and exit.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

import click

from .. import limits
from .common import fail

log = logging.getLogger(__name__)

#: Seconds a ``tailscale`` CLI call may take (it only asks the local tailscaled).
TAILSCALE_TIMEOUT_S = 10.0
#: The environment variable the ngrok authtoken is read from.
NGROK_TOKEN_ENV = "NGROK_AUTHTOKEN"
#: Where a user gets an ngrok authtoken.
NGROK_TOKEN_PAGE = "https://dashboard.ngrok.com/get-started/your-authtoken"
#: Addresses ``--public`` trusts to write ``X-Forwarded-For`` (with the bound address when
#: that is a specific one): the ngrok agent runs in this process and connects from there.
LOOPBACK_SOURCES = ("127.0.0.1/32", "::1/128")

TAILSCALE_UP = "sudo tailscale up"
#: Where the macOS app keeps its CLI when it is not on PATH.
MACOS_TAILSCALE = "/Applications/Tailscale.app/Contents/MacOS/Tailscale"


class ReachError(Exception):
    """A tunnel or tailnet could not be set up; the message is one line saying what to do."""


@dataclass(frozen=True)
class Tailnet:
    """This machine on its tailnet: ``ip`` (IPv4 text), ``name`` (MagicDNS, or None)."""

    ip: str
    name: str | None


def _tailscale(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("tailscale")
    if exe is None and sys.platform == "darwin" and os.access(MACOS_TAILSCALE, os.X_OK):
        exe = MACOS_TAILSCALE
    if exe is None:
        raise ReachError("--tailscale: the tailscale command was not found on PATH; install "
                         f"Tailscale (https://tailscale.com/download), then run: {TAILSCALE_UP}")
    try:
        return subprocess.run([exe, *args], capture_output=True, text=True,
                              timeout=TAILSCALE_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise ReachError(f"--tailscale: `tailscale {' '.join(args)}` did not answer within "
                         f"{TAILSCALE_TIMEOUT_S:.0f}s; check tailscaled is running "
                         "(sudo systemctl start tailscaled)") from None
    except OSError as e:
        raise ReachError(f"--tailscale: cannot run {exe} ({e.strerror or e})") from None


def _why_not(text: str) -> str:
    """What to run, given the CLI's complaint (``text``: its stderr/stdout)."""
    low = text.lower()
    if "doesn't appear to be running" in low or "failed to connect" in low:
        return "start it (sudo systemctl start tailscaled), then run: " + TAILSCALE_UP
    return "log in and connect with: " + TAILSCALE_UP


def tailnet() -> Tailnet:
    """This machine's tailnet IPv4 address and MagicDNS name. Raises :class:`ReachError`
    when Tailscale is missing, not running, logged out or stopped."""
    ip_run = _tailscale("ip", "-4")
    said = " ".join((ip_run.stderr or ip_run.stdout or "").split())[:200]
    if ip_run.returncode != 0:
        # e.g. "no current Tailscale IPs; state: NeedsLogin" (logged out), exit 1
        raise ReachError(f"--tailscale: Tailscale is not connected ({said or 'no address'}); "
                         + _why_not(said))
    ip = None
    for line in ip_run.stdout.splitlines():
        try:
            ip = str(ipaddress.IPv4Address(line.strip()))
            break
        except ValueError:
            continue
    if ip is None:
        raise ReachError("--tailscale: `tailscale ip -4` printed no IPv4 address; "
                         f"check `tailscale status`, then run: {TAILSCALE_UP}")
    name = None
    st = _tailscale("status", "--json")
    if st.returncode == 0:
        try:
            status = json.loads(st.stdout)
        except ValueError:
            status = None
        if isinstance(status, dict):
            state = status.get("BackendState")
            if isinstance(state, str) and state != "Running":
                raise ReachError(f"--tailscale: Tailscale is {state}, not Running; "
                                 + _why_not(state))
            me = status.get("Self")
            dns = me.get("DNSName") if isinstance(me, dict) else None
            tailnet_info = status.get("CurrentTailnet")
            if isinstance(tailnet_info, dict) and tailnet_info.get("MagicDNSEnabled") is False:
                dns = None  # the name exists but resolves nowhere
            if isinstance(dns, str) and dns.strip("."):
                name = dns.strip().rstrip(".")
    else:
        log.info("tailscale status --json failed (%s): no MagicDNS name", st.returncode)
    return Tailnet(ip, name)


def tailnet_lines(net: Tailnet, port: int, scheme: str, tok: str, pin: str = "") -> list[str]:
    """What ``serve --tailscale`` adds to the banner."""
    lines = [f"[OK] Tailscale: bound to this machine's tailnet address {net.ip} only "
             "(the LAN cannot connect; not announced over mDNS)"]
    if net.name:
        lines.append(f"   Join by MagicDNS name:     gpumesh join {scheme}://{net.name}:{port}{pin} "
                     f"--token={tok}")
    return lines


# ---------------------------------------------------------------- ngrok ------------

def check_ngrok() -> None:
    """Raise :class:`ReachError` now, before anything binds, if ``--public`` cannot work:
    no authtoken in the environment, or the SDK is not installed."""
    missing = []  # (both at once: one try tells everything to fix)
    try:
        import ngrok  # noqa: F401
    except ImportError:
        missing.append("the ngrok Agent SDK: pip install ngrok")
    if not os.environ.get(NGROK_TOKEN_ENV, "").strip():
        missing.append(f"an ngrok authtoken in ${NGROK_TOKEN_ENV}: get one at {NGROK_TOKEN_PAGE}, "
                       f"then: export {NGROK_TOKEN_ENV}=<your authtoken>")
    if missing:
        raise ReachError("--public needs " + "; and ".join(missing))


class Tunnel:
    """A public ngrok endpoint forwarding to the coordinator: ``url`` (``https://...``).
    :meth:`close` ends it (idempotent)."""

    def __init__(self, listener, url: str):
        self._listener, self.url = listener, url

    def close(self) -> None:
        if self._listener is None:
            return
        self._listener = None
        import ngrok
        try:
            # disconnect() is the SDK's synchronous way out (Listener.close() is a coroutine)
            ngrok.disconnect(self.url)
        except Exception as e:  # noqa: BLE001 - the process is stopping anyway
            log.info("closing the ngrok tunnel failed: %s", e)


def forward_address(host: str, port: int) -> str:
    """Where the tunnel delivers connections: the bound address, loopback for a wildcard."""
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def tunnel_sources(host: str) -> tuple[str, ...]:
    """The addresses the tunnel's connections come from, for ``host`` as bound."""
    if host in ("0.0.0.0", "::", "", "127.0.0.1", "::1", "localhost"):
        return LOOPBACK_SOURCES
    return (*LOOPBACK_SOURCES, host)


def open_tunnel(host: str, port: int) -> Tunnel:
    """Start an ngrok HTTP endpoint forwarding to ``host:port`` (the bound socket) with the
    authtoken from ``$NGROK_AUTHTOKEN``. Raises :class:`ReachError`."""
    check_ngrok()
    import ngrok
    try:
        listener = ngrok.forward(forward_address(host, port), authtoken_from_env=True)
        url = listener.url()
    except Exception as e:  # noqa: BLE001 - the SDK raises plain exceptions for every refusal
        text = " ".join(str(e).split())[:300] or type(e).__name__
        raise ReachError(f"--public: ngrok did not open a tunnel ({text}); check "
                         f"${NGROK_TOKEN_ENV} (see {NGROK_TOKEN_PAGE}) and that this machine "
                         "can reach ngrok") from None
    if not isinstance(url, str) or not url.startswith("https://"):
        Tunnel(listener, str(url)).close()
        raise ReachError(f"--public: ngrok answered an unexpected URL {url!r} (expected https://...)")
    return Tunnel(listener, url.rstrip("/"))


def public_lines(url: str, tok: str) -> list[str]:
    """What ``serve --public`` adds to the banner."""
    return [f"[OK] Public URL (ngrok tunnel): {url}",
            f"   Join from ANYWHERE:        gpumesh join {url} --token={tok}",
            '   "Anywhere" includes people you did not invite; the token is the only thing',
            "   keeping them out. Refused tokens through the tunnel lock out the sender's address."]


# ---------------------------------------------------------------- for serve ---------

def plan(host: str, tailscale: bool, public: bool, trusted_proxy) -> tuple[tuple, Tailnet | None]:
    """What ``serve`` checks before anything binds: the networks whose ``X-Forwarded-For``
    is believed (``--trusted-proxy``, else ``$GPUMESH_TRUSTED_PROXIES``; with ``--public``
    also where the tunnel connects from), and the tailnet (``--tailscale``) or None.
    Exits with one line on a problem (code 2 for a usage error; flags that do not go
    together were refused before, by ``serve``)."""
    from ..coordinator.auth import parse_networks
    wanted = list(trusted_proxy) or [
        *limits.setting("GPUMESH_TRUSTED_PROXIES")]
    try:
        trusted = parse_networks(wanted)
    except ValueError as e:
        fail(f"--trusted-proxy: {e}", code=2)
    net = None
    try:
        if tailscale:
            net = tailnet()
            # The default (loopback) and "every address" (the spec's own --host 0.0.0.0
            # --tailscale) both mean "bind where tailscale says"; any other address would
            # be ignored, so it is a usage error rather than a note the user may miss.
            if host not in ("127.0.0.1", "localhost", "::1", "0.0.0.0", "::", net.ip):
                fail(f"--tailscale binds to this machine's tailnet address {net.ip}, not {host} "
                     "(from --host or $GPUMESH_HOST): drop one of them", code=2)
        if public:
            check_ngrok()
            trusted += parse_networks(tunnel_sources(host))
    except ReachError as e:
        fail(str(e))
    return trusted, net


def announce(net: Tailnet | None, public: bool, host: str, port: int, fingerprint: str | None,
             tok: str) -> Tunnel | None:
    """Print the tailnet lines, or open the ngrok tunnel and print its lines (the tunnel is
    returned: close it at the end). ``tok`` is the token as the join lines show it."""
    scheme = "https" if fingerprint else "http"
    pin = f" --fingerprint {fingerprint}" if fingerprint else ""
    tunnel = None
    try:
        if net is not None:
            for line in tailnet_lines(net, port, scheme, tok, pin):
                click.echo(line)
        if public:
            tunnel = open_tunnel(host, port)
            for line in public_lines(tunnel.url, tok):
                click.echo(line)
    except ReachError as e:
        fail(str(e))
    return tunnel
