"""``gpumesh serve``: run a coordinator (and, by default, a worker for this machine)."""

from __future__ import annotations

import getpass
import ipaddress
import logging
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import click

from .. import config, limits, protocol
from ..limits import DEFAULT_PORT, MIN_TOKEN_CHARS
from .common import fail
from .secrecy import hide

GENERATE_HINT = 'generate one with: python -c "import secrets; print(secrets.token_urlsafe(32))"'


def _lan_ip() -> str | None:
    """This machine's address on its default route, found without sending anything
    (a UDP connect only picks a route). None if there is no route."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("192.0.2.1", 9))  # TEST-NET-1: routed, never contacted
        return s.getsockname()[0]
    except OSError:
        return None
    finally:
        s.close()


#: One label of a DNS name: letters, digits and inner hyphens, at most 63 characters.
_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


def check_host_ip(value: str, what: str = "--host-ip") -> str:
    """``value`` (from the flag or variable ``what``) as the address other machines use:
    a bare IPv4 or IPv6 address (brackets dropped) or a DNS host name, nothing else (no
    scheme, port, path or spaces). Anything else, or a loopback address no other machine
    can use, is a usage error: one line, exit 2."""
    text = value.strip()
    bare = text[1:-1] if text.startswith("[") and text.endswith("]") else text
    try:
        addr = ipaddress.ip_address(bare)
    except ValueError:
        name = text.rstrip(".") if text.endswith(".") and not text.endswith("..") else text
        labels = name.split(".")
        if (not name or len(name) > 253 or not all(_LABEL.fullmatch(la) for la in labels)
                or labels[-1].isdigit()):  # (a last label of digits: a mistyped IPv4 address)
            fail(f"{what}: {value!r} is not an IP address or host name; give the bare address "
                 "other machines reach this coordinator at, e.g. --host-ip 192.0.2.10 or "
                 "--host-ip mesh.example.org (no scheme, port or path)", code=2)
        if name.lower() == "localhost" or name.lower().endswith(".localhost"):
            fail(f"{what}: {value!r} names this machine's loopback, which no other machine "
                 "can reach; give its LAN or public address", code=2)
        return name
    if addr.is_loopback or addr.is_unspecified:
        fail(f"{what}: {bare} is not an address other machines can reach this coordinator "
             "at; give its LAN or public address", code=2)
    return str(addr)


def _url_host(ip: str) -> str:
    """``ip`` as the host part of a URL: an IPv6 address in brackets."""
    return f"[{ip}]" if ":" in ip else ip


def _device_line() -> str:
    from ..worker.device import detect
    d = detect()
    return f"{d['device']} {d['device_name']}"


def check_token(token: str, what: str = "token") -> None:
    """Refuse a user-chosen token that is empty or shorter than MIN_TOKEN_CHARS: a bad
    flag (or variable) value, so a usage error (exit 2)."""
    if not token.strip():
        fail(f"the {what} is empty; {GENERATE_HINT}", code=2)
    if len(token) < MIN_TOKEN_CHARS:
        fail(f"the {what} is {len(token)} characters; at least {MIN_TOKEN_CHARS} are needed "
             f"(anyone who guesses it can run code here): {GENERATE_HINT}", code=2)


#: Flags whose value is a secret: the re-run line names them with a placeholder.
_SECRET_FLAGS = {"worker_token": "<your worker token>", "metrics_token": "<your metrics token>"}
#: Flags the re-run line sets itself (the address to open up, the port, the token).
_RERUN_OWN = {"host", "port", "token"}


def rerun_flags(ctx: click.Context) -> str:
    """The flags this ``serve`` was given on its command line, in the command's order,
    for the banner's re-run line: every one the user chose (a data directory, TLS, safe
    mode, a metrics token...) but the address, port and token, which the line sets, and
    with a placeholder for each secret value."""
    parts: list[str] = []
    for param in ctx.command.params:
        name = param.name or ""
        if (name in _RERUN_OWN or not isinstance(param, click.Option)
                or ctx.get_parameter_source(name) is not click.core.ParameterSource.COMMANDLINE):
            continue
        flag, value = param.opts[0], ctx.params.get(name)
        if param.is_flag:
            parts += [flag] if value else param.secondary_opts[:1]
            continue
        for v in (list(value or ()) if param.multiple else [value]):
            parts += [flag, _SECRET_FLAGS.get(name) or shlex.quote(str(v))]
    return " ".join(parts)


def in_container() -> bool:
    """Whether this process runs in a container (Docker's ``/.dockerenv``, podman's
    ``/run/.containerenv``): its own IP is not what other machines reach."""
    return os.path.exists("/.dockerenv") or os.path.exists("/run/.containerenv")


def banner(host: str, port: int, token: str, show_token: bool, *, fingerprint: str | None = None,
           worker_token: bool = False, safe_mode: bool = False, public: bool = False,
           rerun: str = "", proxied: bool = False, host_ip: str | None = None) -> list[str]:
    """The lines ``serve`` prints once it listens (wording kept from the product README).
    ``public``: an ngrok tunnel will be announced below (``--public``). ``rerun``: the
    flags the re-run line keeps (:func:`rerun_flags`). ``host_ip``: the address other
    machines use (``--host-ip``, checked by :func:`check_host_ip`) [default: the LAN
    address detected for ``0.0.0.0``/``::``, else ``host``]."""
    scheme = "https" if fingerprint else "http"
    loopback_answers = host in ("0.0.0.0", "::", "127.0.0.1", "localhost")
    # bound to one address (--host 192.0.2.10, --tailscale), 127.0.0.1 answers nothing
    local = f"{scheme}://127.0.0.1:{port}" if loopback_answers else f"{scheme}://{host}:{port}"
    tok = token if show_token else "<your token>"
    if worker_token:
        tok = "<your worker token>"
    pin = f" --fingerprint {fingerprint}" if fingerprint else ""
    lines = [f"[OK] Coordinator listening on {host}:{port}" + (" (TLS)" if fingerprint else "")]
    if show_token:
        lines.append(f"   Token: {token}")
    if fingerprint:
        lines.append(f"   TLS certificate fingerprint: {fingerprint}")
    if worker_token:
        lines.append("   Workers may join with the worker token (it cannot submit or read results)")
    if safe_mode:
        lines.append("   Safe mode: function (pickle) jobs are refused")
    lines += ["", f"   Join from THIS machine:   gpumesh join {local}{pin} --token={tok}"]
    if host in ("127.0.0.1", "localhost", "::1") and public:
        lines.append("   Other machines reach it only through the public URL below, not directly.")
    elif host in ("127.0.0.1", "localhost", "::1") and proxied:
        at = f"at {host_ip} (--host-ip)" if host_ip else "at the proxy's address"
        lines += ["   Other machines reach it through the proxy in front of it (--trusted-proxy),",
                  f"   {at}; binding it to 0.0.0.0 would go around the proxy."]
    elif host in ("127.0.0.1", "localhost", "::1"):
        lines += [
            f"   Other machines CANNOT reach this coordinator (bound to {host} only).",
            "   That is the default now: a worker executes code as the user who started it.",
            # the re-run keeps every flag given (TLS, safe mode, the data directory...):
            # opening up must not also drop a protection, or start an empty store
            f"   To let other machines join, re-run with: gpumesh serve --host 0.0.0.0 --port {port}"
            + (f" {rerun}" if rerun else "") + " --token=<your token>",
            "   (or set GPUMESH_HOST=0.0.0.0). Read the warning it prints before you do.",
        ]
    else:
        ip = host_ip or (_lan_ip() if host in ("0.0.0.0", "::") else host)
        if ip:
            from ..coordinator.dist import wheel_url
            there = f"{scheme}://{_url_host(ip)}:{port}"
            trust = f"--trusted-host {ip} " if fingerprint else ""  # pip cannot pin a certificate
            lines.append(f"   Install on ANOTHER machine: pip install {trust}{wheel_url(there)}")
            lines.append(f"   Join from ANOTHER machine: gpumesh join {there}{pin} --token={tok}")
        if host in ("0.0.0.0", "::") and in_container():
            lines.append("   (in a container: other machines use the host's address and the port it "
                         "publishes, not this container's own IP)")
        elif host in ("0.0.0.0", "::") and host_ip:
            lines.append(f"   (127.0.0.1 always works locally; {host_ip}, from --host-ip, is for "
                         "other machines)")
        elif host in ("0.0.0.0", "::"):
            lines.append("   (127.0.0.1 always works locally; the LAN IP is for other machines)")
        lines.append("")
        bar = "  " + "!" * 62
        lines += [bar, "  !! NETWORK-EXPOSED COORDINATOR", bar,
                  f"   Bound to:      {host}:{port} (not loopback — other machines can connect)",
                  f"   Tasks run as:  {getpass.getuser()}",
                  f"   On device:     {_device_line()}", "",
                  "   Anyone who can reach this port AND has the token can run",
                  f"   arbitrary code on this machine as {getpass.getuser()}.",
                  "   Only do this on a network you trust, and keep the token secret.",
                  f"   Loopback-only (the default) is: gpumesh serve --port {port}", bar, ""]
        # The self-check only tries 127.0.0.1: a firewall or NAT in the way shows up
        # only when a worker from elsewhere joins (or does not).
        where = f"{scheme}://{_url_host(ip)}:{port}" if ip else f"port {port}"
        lines.append(f"   Reachability of {where} from other machines is not tested here"
                     " — a worker joining confirms it.")
    lines.append("   Ctrl+C to stop")
    return lines


class _MeshLogFormat(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text = f"[mesh] {record.getMessage()}"
        if record.exc_info:  # a bug's traceback must reach the log, not vanish
            text += "\n" + self.formatException(record.exc_info)
        return text


def _save_config(url: str, token: str, fingerprint: str | None) -> None:
    """Save this coordinator as the one callers and ``gpumesh join`` find without a URL,
    unless the config names another coordinator that answers: a second coordinator (its
    own data dir, a test, a notebook's) must not take that over, or once it stops every
    ``from gpumesh import mesh`` would run locally and a restart of the first would have
    lost its saved token. A saved coordinator that does not answer is stale: replaced.
    Either way one line says what happened."""
    path = config.config_path()
    other = config.saved_elsewhere(url)
    if other is not None and _answers(*other):
        click.echo(f"[gpumesh] config left as it is: {path} names the coordinator at {other[0]}, "
                   f"which is running; callers of this one need --url {url} (or $GPUMESH_URL) "
                   f"and its token")
        return
    try:
        path = config.save(url, token, fingerprint)
        click.echo(f"[gpumesh] config saved to {path}")
    except OSError as e:
        click.echo(f"[gpumesh] warning: could not save the config ({e}); callers need --url/--token", err=True)


def _answers(url: str, fingerprint: str | None) -> bool:
    """Whether a coordinator answers its health probe at ``url`` (within 2 s)."""
    from ..transport import Transport
    http = Transport(url, None, fingerprint=fingerprint)
    try:
        http.request("GET", protocol.HEALTH, timeout=2)
        return True
    except Exception:  # noqa: BLE001 - refused, timed out, a TLS mismatch: not answering
        return False
    finally:
        http.close()


@click.command()
@click.option("--host", default=None, metavar="ADDR",
              help="Address to bind [default: $GPUMESH_HOST, else 127.0.0.1 (this machine only)].")
@click.option("--host-ip", default=None, metavar="ADDR",
              help="The address other machines reach this coordinator at, for its join lines "
                   "and LAN announcement: behind port forwarding, with several network cards, "
                   "or when the detected one is wrong; an IP address or host name "
                   "[default: $GPUMESH_HOST_IP, else the detected LAN address].")
@click.option("--port", type=click.IntRange(1, 65535), default=DEFAULT_PORT, show_default=True,
              help="TCP port to listen on.")
@click.option("--token", default=None, metavar="TOKEN",
              help="Token callers and workers must present [default: $GPUMESH_TOKEN, else the one the "
                   "saved config holds for this URL, else a new one].")
@click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where jobs, tasks and results are stored [default: ~/.gpumesh; on macOS "
                   "~/Library/Application Support/gpumesh, on Windows %LOCALAPPDATA%\\gpumesh, "
                   "unless an older ~/.gpumesh there holds a job store].")
@click.option("--no-self-worker", is_flag=True, help="Do not join this machine as a worker [default: it joins].")
@click.option("--slots", type=click.IntRange(1, limits.MAX_SLOTS), default=1, show_default=True,
              help="Tasks the self-worker runs at once.")
@click.option("--worker-token", default=None, metavar="TOKEN",
              help="A second token that may only act as a worker (register, lease, post results), "
                   "never submit or read results [default: $GPUMESH_WORKER_TOKEN, else none].")
@click.option("--tls", is_flag=True,
              help="Serve HTTPS with a self-signed certificate kept in the data directory; "
                   "prints its SHA-256 fingerprint for clients to pin [default: plain HTTP].")
@click.option("--tls-cert", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Serve HTTPS with this PEM certificate (chain) instead (implies --tls) [default: none].")
@click.option("--tls-key", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="The PEM private key for --tls-cert [default: none].")
@click.option("--safe-mode", is_flag=True,
              help="Refuse function (pickle) jobs; accept script jobs only [default: off].")
@click.option("--metrics-token", default=None, metavar="TOKEN",
              help="A token that may read GET /metrics and nothing else, for a Prometheus "
                   "scraper [default: $GPUMESH_METRICS_TOKEN, else none: the API tokens].")
@click.option("--no-advertise", is_flag=True,
              help="Do not announce this coordinator on the LAN (mDNS, seen by `gpumesh radar`) "
                   "[default: announced when bound to a non-loopback address, unless "
                   "GPUMESH_DISCOVERY=0].")
@click.option("--tailscale", is_flag=True,
              help="Bind to this machine's Tailscale address only and print the tailnet join "
                   "line; needs a logged-in `tailscale` [default: off].")
@click.option("--public", is_flag=True,
              help="Open a public https:// URL through an ngrok tunnel (pip install "
                   "'gpumesh[tunnel]', authtoken in $NGROK_AUTHTOKEN) [default: off].")
@click.option("--trusted-proxy", "trusted_proxy", multiple=True, metavar="CIDR",
              help="A reverse proxy whose X-Forwarded-For names the client (repeatable); "
                   "turns the loopback lockout exemption off [default: $GPUMESH_TRUSTED_PROXIES "
                   "(comma-separated), else none: clients are judged by socket address].")
@click.option("--no-save-config", is_flag=True,
              help="Leave the saved config (what callers and `gpumesh join` use without a URL) "
                   "as it is [default: saved, unless it names another coordinator that is running].")
def serve(host, host_ip, port, token, data_dir, no_self_worker, slots, worker_token, tls, tls_cert, tls_key,
          safe_mode, no_advertise, tailscale, public, trusted_proxy, metrics_token, no_save_config):
    """Run a coordinator: the job store and HTTP API of the mesh."""
    from ..coordinator.server import BindError, Server, bind
    from . import reach

    given = click.get_current_context().get_parameter_source("slots")
    _check_flags(tls, tls_cert, tls_key, public, tailscale,
                 slots_given=given is not click.core.ParameterSource.DEFAULT,
                 self_worker=not no_self_worker)
    host = host or limits.setting("GPUMESH_HOST")
    token = token or os.environ.get("GPUMESH_TOKEN")
    worker_token = worker_token or os.environ.get("GPUMESH_WORKER_TOKEN") or None
    metrics_token = metrics_token or os.environ.get("GPUMESH_METRICS_TOKEN") or None
    hide(token, worker_token, metrics_token)  # out of ps and /proc/PID/environ from here on
    if token is not None:
        check_token(token)
    trusted, net = reach.plan(host, tailscale, public, trusted_proxy)
    if net is not None:
        host = net.ip  # the tailnet address, not 0.0.0.0: the LAN stays out
    host_ip = _host_ip(host_ip, host, proxied=bool(trusted))
    scheme = "https" if (tls or tls_cert is not None) else "http"
    local_url = (f"{scheme}://127.0.0.1:{port}" if host in ("0.0.0.0", "::", "127.0.0.1")
                 else f"{scheme}://{host}:{port}")
    generated = False  # a new token, which the banner shows (never one given or reused)
    if token is None:
        # A restart without --token must keep the token its workers joined with: a new
        # one would lock every joined worker out (401) although the spec promises they
        # reconnect on their own.
        token = config.saved_token(local_url)
        if token is not None:
            click.echo(f"[gpumesh] reusing the token saved for {local_url} in {config.config_path()} "
                       f"(pass --token or $GPUMESH_TOKEN to choose another)")
        else:
            token, generated = config.generate_token(), True
    if worker_token is not None:
        check_token(worker_token, "worker token")
        if worker_token == token:
            fail("the worker token must differ from the main token", code=2)
    if metrics_token is not None:
        check_token(metrics_token, "metrics token")
        if metrics_token in (token, worker_token):
            fail("the metrics token must differ from the main and worker tokens", code=2)
    # The port first: a port in use must not leave an empty data directory behind.
    try:
        sock = bind(host, port)
    except BindError as e:
        fail(str(e))
    data_dir = (data_dir or config.home_dir()).expanduser()
    try:
        # Jobs' arguments, results and output are nobody else's business: what serve
        # creates (data dir, database, payload files, logs) is readable by this user only.
        os.umask(0o077)
        data_dir.mkdir(parents=True, exist_ok=True)
        probe = data_dir / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        fail(f"cannot write to the data directory {data_dir} ({e.strerror or e}); "
             f"pass --data-dir with a writable directory")
    # Before anything is written there or to the config: one coordinator per data dir.
    from ..coordinator.datalock import DataDirLocked, acquire
    try:
        dir_lock = acquire(data_dir)  # noqa: F841 - held (file open) until this process exits
    except DataDirLocked as e:
        fail(str(e))
    except OSError as e:
        fail(f"cannot lock the data directory {data_dir} ({e.strerror or e})")
    fingerprint = None
    if tls or tls_cert is not None:
        from ..tls import TLSSetupError, check_pair, self_signed
        try:
            if tls_cert is None:
                tls_cert, tls_key, created = self_signed(data_dir, host)
                if created:
                    click.echo(f"[gpumesh] new self-signed TLS certificate: {tls_cert}")
            fingerprint = check_pair(tls_cert, tls_key)
        except TLSSetupError as e:
            fail(str(e))
    if not no_save_config:
        _save_config(local_url, token, fingerprint)

    handler = logging.StreamHandler(sys.stdout)
    from .. import logs
    handler.setFormatter(logs.formatter() or _MeshLogFormat())  # --log-json: JSON lines
    mesh_log = logging.getLogger("gpumesh.coordinator")
    mesh_log.addHandler(handler)
    mesh_log.setLevel(min(logging.INFO, logs.level()))  # -vv: debug
    mesh_log.propagate = False

    try:
        server = Server(sock, data_dir, token, worker_token=worker_token, safe_mode=safe_mode,
                        tls_cert=tls_cert, tls_key=tls_key, trusted_proxies=trusted,
                        fronted=tailscale or public, metrics_token=metrics_token)
    except Exception as e:  # noqa: BLE001 - e.g. a corrupt or locked database
        fail(f"cannot open the job store in {data_dir}: {e}")
    for line in banner(host, port, token, show_token=generated, fingerprint=fingerprint,
                       worker_token=worker_token is not None, safe_mode=safe_mode, public=public,
                       rerun=rerun_flags(click.get_current_context()), proxied=bool(trusted_proxy),
                       host_ip=host_ip):
        click.echo(line)
    from ..winplat import firewall_lines
    for line in firewall_lines(host, port):  # Windows only: the inbound rule (spec: as Administrator)
        click.echo(line)
    tok = "<your worker token>" if worker_token else (token if generated else "<your token>")
    tunnel = reach.announce(net, public, host, port, fingerprint, tok)
    # mDNS does not cross a tailnet, and announcing a tailnet address on the LAN says nothing useful
    advert = None if (no_advertise or net is not None) else _advertise(host, port, fingerprint is not None,
                                                                       host_ip)
    worker: list[subprocess.Popen] = []
    # The self-worker needs no more than a worker's rights: with a worker token it gets that.
    threading.Thread(target=_after_start,
                     args=(server, local_url, worker_token or token, not no_self_worker, slots, worker,
                           fingerprint),
                     daemon=True).start()
    # uvicorn handles SIGINT/SIGTERM itself, then re-raises the signal with the handler it
    # found: make SIGTERM end like Ctrl+C, so the self-worker is stopped below either way.
    signal.signal(signal.SIGTERM, _as_keyboard_interrupt)
    # The self-worker leaves first, while the API can still take its goodbye: its tasks are
    # re-queued in the store now, not after a restarted coordinator's lease timeout.
    server.uvicorn.before_shutdown = lambda: [_stop_child(p) for p in worker]
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl+C it handled
        pass
    finally:
        for proc in worker:
            _stop_child(proc)
        if advert is not None:
            advert.close()
        if tunnel is not None:
            tunnel.close()
    click.echo("[gpumesh] coordinator stopped")


def _check_flags(tls: bool, tls_cert, tls_key, public: bool, tailscale: bool, *,
                 slots_given: bool, self_worker: bool) -> None:
    """Flags that do not go together, or one that the others would make do nothing: a
    usage error (one line naming them, exit 2), before any other check and before
    anything is written."""
    if slots_given and not self_worker:
        fail("--slots sets how many tasks the self-worker runs, and --no-self-worker starts "
             "none: drop one (a worker joined with `gpumesh join` takes --cpu-slots)", code=2)
    if (tls_cert is None) != (tls_key is None):
        given, missing = ("--tls-cert", "--tls-key") if tls_key is None else ("--tls-key", "--tls-cert")
        fail(f"{given} needs {missing} too: --tls-cert FILE --tls-key FILE serve HTTPS with "
             "your certificate and its key (or --tls alone, a self-signed one)", code=2)
    if tailscale and public:
        fail("--tailscale and --public are two different ways in: pick one", code=2)
    if public and (tls or tls_cert is not None):
        fail("--public serves https:// at ngrok's edge already; drop --tls (the tunnel "
             "reaches this coordinator over loopback)", code=2)


def _host_ip(given: str | None, host: str, *, proxied: bool) -> str | None:
    """``--host-ip`` (else ``$GPUMESH_HOST_IP``) checked: see :func:`check_host_ip`. Bound
    to loopback with no proxy in front (``--trusted-proxy``, ``--public``), no other
    machine can reach the coordinator at any address: a usage error naming what to pass."""
    what = "--host-ip"
    if given is None:
        given, what = limits.setting("GPUMESH_HOST_IP"), "GPUMESH_HOST_IP"
        if given is None:
            return None
    host_ip = check_host_ip(given, what)
    if host in ("127.0.0.1", "localhost", "::1") and not proxied:
        fail(f"{what} {host_ip} is the address other machines use, but this coordinator is "
             f"bound to {host}, which no other machine can reach: add --host 0.0.0.0 (or the "
             "address of one network card), or --trusted-proxy CIDR when a proxy on this "
             "machine forwards to it", code=2)
    return host_ip


def _advertise(host: str, port: int, tls: bool, host_ip: str | None = None):
    """Announce this coordinator on the LAN (never for loopback, never a token), at
    ``host_ip`` (``--host-ip``) when that is an IP address."""
    from .. import discovery
    if not discovery.enabled():
        return None
    addresses = discovery.advertise_addresses(host, host_ip)
    if host_ip and addresses and host_ip not in addresses:  # a host name: mDNS needs addresses
        click.echo(f"[gpumesh] --host-ip {host_ip} is a host name; the LAN announcement (mDNS) "
                   f"carries IP addresses only, so it names the detected ones ({', '.join(addresses)})")
    if not addresses:
        return None
    from .._version import __version__
    from ..worker.device import detect
    d = detect()
    advert = discovery.advertise("coordinator", addresses, port, version=__version__,
                                 device=d["device"], device_name=d["device_name"],
                                 hostname=d["hostname"], scheme="https" if tls else "http")
    if advert is not None:
        click.echo(f"[OK] Announced on the LAN as a gpumesh coordinator ({', '.join(addresses)}; "
                   "no token) - disable with --no-advertise")
    return advert


def _after_start(server, url: str, token: str, self_worker: bool, slots: int, out: list,
                 fingerprint: str | None = None) -> None:
    server.ready.wait()
    problem = _self_check(url, fingerprint)
    if problem is None:
        from urllib.parse import urlsplit
        click.echo(f"[OK] Self-check: server is up (tested on {urlsplit(url).hostname} only)")
    else:
        click.echo(f"[!!] Self-check failed: {problem}", err=True)
    if not self_worker:
        return
    # Credentials travel in the environment, never on a command line (ps shows those).
    env = dict(os.environ, GPUMESH_TOKEN=token, GPUMESH_EXIT_WITH_PARENT="1")
    env.pop("GPUMESH_WORKER_TOKEN", None)
    if fingerprint:
        env["GPUMESH_FINGERPRINT"] = fingerprint
    proc = subprocess.Popen([sys.executable, "-m", "gpumesh", "join", url, "--slots", str(slots)],
                            env=env, stdin=subprocess.DEVNULL)
    out.append(proc)
    click.echo("[OK] Self-worker started — this machine's CPU/GPU is part of the pool")
    click.echo("   (disable with --no-self-worker)")


def _self_check(url: str, fingerprint: str | None, timeout: float = 5.0) -> str | None:
    """GET ``url``/v1/health once; None if it answers 200, else what went wrong.

    Standard library only: the coordinator process never needs an HTTP client otherwise,
    and httpx would stay loaded (~15 MiB) for this one request. With TLS, the
    certificate presented must be the one ``fingerprint`` names."""
    import http.client
    import json
    import ssl
    from urllib.parse import urlsplit
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    try:
        if parts.scheme == "https":
            ctx = ssl.create_default_context()
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE  # checked below against the pin instead
            conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                host, parts.port or 443, timeout=timeout, context=ctx)
        else:
            conn = http.client.HTTPConnection(host, parts.port or 80, timeout=timeout)
        try:
            conn.request("GET", protocol.HEALTH)
            if fingerprint and parts.scheme == "https":
                from ..tls import fingerprint_der, normalise_fingerprint
                der = conn.sock.getpeercert(binary_form=True)  # type: ignore[union-attr]
                got = fingerprint_der(der) if der else "none"
                if got != normalise_fingerprint(fingerprint):
                    return f"the server at {url} presents certificate {got}, not {fingerprint}"
            resp = conn.getresponse()
            body = resp.read()
        finally:
            conn.close()
    except (OSError, http.client.HTTPException, ssl.SSLError) as e:
        return f"the coordinator at {url} did not answer ({e})"
    if resp.status != 200:
        return f"GET {url}{protocol.HEALTH} answered HTTP {resp.status}"
    try:
        json.loads(body)
    except ValueError:
        return f"GET {url}{protocol.HEALTH} did not answer JSON"
    return None


def _as_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt


def _stop_child(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
