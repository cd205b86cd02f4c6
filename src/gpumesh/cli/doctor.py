"""``gpumesh doctor [URL]``: check this machine's install and its connection to a coordinator.

Run on a worker machine with the coordinator's URL, it walks the path a worker takes, each
step with its own fix: name resolution, TCP reach, TLS (CA-verified, or the pinned
fingerprint), the coordinator's answer and version, the clock difference to it, and the
token.

Each check is ``ok``, ``warn`` (optional or worth knowing, never fails the run), ``fail``
(with what to do) or ``skip``. Exit code 1 if any check failed. The token is never
printed: only whether one is set, where it came from and its length.
"""

from __future__ import annotations

import ipaddress
import json
import os
import platform
import socket
import ssl
import stat
import sys
import time
from dataclasses import asdict, dataclass
from email.utils import parsedate_to_datetime
from typing import Any
from urllib.parse import urlsplit

import click

from .. import config, limits, protocol
from ..packages import installed
from .._version import __version__
from ..limits import CLOCK_SKEW_FAIL_S, CLOCK_SKEW_WARN_S, CONNECT_TIMEOUT_S
from .common import endpoint_options, given_url

#: The wall clock the coordinator's ``Date`` header is compared with (a seam for tests).
wall_clock = time.time
#: Tailscale's address range (CGNAT, RFC 6598): traffic there is already encrypted.
TAILNET = ipaddress.ip_network("100.64.0.0/10")


#: Characters the text output gives a check's name: the longest name's ("pool packages",
#: "pool versions") and one more, so that every detail starts in one column and even the
#: longest name stands two spaces from its detail (a test checks each name here fits).
NAME_WIDTH = 14


@dataclass
class Check:
    name: str
    status: str  # ok | warn | fail | skip
    detail: str
    fix: str = ""


def _install() -> Check:
    try:
        from importlib.metadata import PackageNotFoundError, version
        installed = version("gpumesh")
    except PackageNotFoundError:
        return Check("install", "warn", f"gpumesh {__version__} imported from "
                     f"{os.path.dirname(os.path.dirname(__file__))}, but not installed as a package",
                     "pip install . in the clone (another machine: the `pip install` line "
                     "`gpumesh serve --host 0.0.0.0` prints)")
    if installed != __version__:
        return Check("install", "fail", f"installed metadata says {installed}, the code is {__version__}",
                     "reinstall it the way it came: pip install --force-reinstall . in the clone, "
                     "or the coordinator's wheel")
    return Check("install", "ok", f"gpumesh {__version__} ({os.path.dirname(os.path.dirname(__file__))})")


def _python() -> Check:
    v = platform.python_version()
    if sys.version_info < (3, 10):
        return Check("python", "fail", f"Python {v}", "gpumesh needs Python 3.10 or newer")
    return Check("python", "ok", f"Python {v} ({sys.executable})")


def _cloudpickle() -> Check:
    try:
        import cloudpickle
    except ImportError:
        return Check("cloudpickle", "fail", "not installed", "pip install 'cloudpickle>=3.0'")
    ver = getattr(cloudpickle, "__version__", "?")
    try:
        major = int(ver.split(".")[0])
    except ValueError:
        major = 0
    if major < 3:
        return Check("cloudpickle", "fail", f"version {ver} is too old", "pip install -U 'cloudpickle>=3.0'")
    return Check("cloudpickle", "ok", f"version {ver} (every machine of a mesh should have the same)")


def _torch() -> Check:
    try:
        import torch
    except ImportError:
        return Check("torch", "skip", "not installed (optional: only tasks that use it need it)")
    except Exception as e:  # noqa: BLE001 - a broken torch install
        return Check("torch", "warn", f"import failed: {e}", "reinstall torch for this Python")
    try:
        cuda = torch.cuda.is_available()
        n = torch.cuda.device_count() if cuda else 0
    except Exception as e:  # noqa: BLE001
        return Check("torch", "warn", f"torch {torch.__version__}; CUDA check failed: {e}")
    if cuda:
        return Check("torch", "ok", f"torch {torch.__version__}, CUDA {torch.version.cuda}, {n} GPU(s)")
    return Check("torch", "ok", f"torch {torch.__version__}, CPU only (no CUDA device visible)")


def _gpus() -> Check:
    try:
        from ..worker.device import nvidia_gpus, visible
        gpus = visible(nvidia_gpus())
    except Exception as e:  # noqa: BLE001
        return Check("gpus", "warn", f"GPU detection failed: {e}")
    if not gpus:
        try:
            import pynvml  # noqa: F401
            how = "NVML loaded, no NVIDIA GPU found"
        except ImportError:
            how = "no NVIDIA GPU found (NVML not installed: pip install nvidia-ml-py on GPU machines)"
        return Check("gpus", "skip", how + "; a worker here offers CPU slots")
    names = ", ".join(f"{g['index']}: {g['name']} ({g['memory_total_mb']} MiB)" for g in gpus)
    return Check("gpus", "ok", f"{len(gpus)} GPU(s): {names}")


def _runtime() -> Check:
    from ..worker.procs import choose_runtime, fork_missing
    try:
        name, why = choose_runtime()
    except ValueError as e:
        return Check("runtime", "fail", str(e), "set GPUMESH_RUNTIME to fork or spawn, or unset it")
    other = "" if fork_missing() else "; fork and spawn both available"
    return Check("runtime", "ok", f"{name}: {why}{other} (gpumesh join --runtime)")


def _saved(url: str | None = None, token: str | None = None) -> Check:
    """The saved connection. ``url``, ``token``: what the command line gave; with both
    given there (or in $GPUMESH_URL and $GPUMESH_TOKEN), no saved config is needed."""
    path = config.config_path()
    saved = config.load_saved()
    if not path.exists():
        if (url or limits.setting("GPUMESH_URL")) and (token or os.environ.get("GPUMESH_TOKEN")):
            return Check("config", "ok", f"no saved connection at {path}; the URL and token "
                         "given (flags or GPUMESH_URL/GPUMESH_TOKEN) are used")
        return Check("config", "warn", f"no saved connection at {path}",
                     "run `gpumesh serve` on the coordinator machine (it saves one), or pass "
                     "--url/--token, or set GPUMESH_URL/GPUMESH_TOKEN")
    if not saved:
        return Check("config", "fail", f"{path} is not a JSON object",
                     f"delete {path} and run `gpumesh serve` again (or fix the file)")
    detail = f"{path}: url={saved.get('url', '?')}, token " + (
        f"set ({len(saved['token'])} characters)" if isinstance(saved.get("token"), str) else "missing")
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except OSError:
        mode = 0
    if os.name == "posix" and mode & 0o077:
        return Check("config", "fail", detail + f"; readable by others (mode {mode:o})",
                     f"chmod 600 {path} (it holds the token)")
    if "url" in saved:
        try:
            config.normalise_url(saved["url"])
        except ValueError as e:
            return Check("config", "fail", str(e), f"fix the url in {path}")
    return Check("config", "ok", detail)


def _network(url: str, fingerprint: str | None) -> tuple[list[Check], bool]:
    """Name resolution, TCP reach and TLS of ``url`` from here; the bool says all passed."""
    parts = urlsplit(url)
    host, https = parts.hostname or "", parts.scheme == "https"
    port = parts.port or (443 if https else 80)
    try:
        literal = ipaddress.ip_address(host)
    except ValueError:
        literal = None
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        fix = ("check the spelling, or use the coordinator's IP address (the `Join from ANOTHER "
               "machine` line `gpumesh serve` printed)")
        if host.endswith(".ts.net"):
            fix = "a MagicDNS name resolves on the tailnet only: run `sudo tailscale up` here, then retry"
        elif host.endswith(".local"):
            fix = "mDNS (.local) names need Avahi/Bonjour here; use the coordinator's IP address instead"
        return [Check("resolve", "fail", f"cannot resolve {host} ({getattr(e, 'strerror', None) or e})",
                      fix)], False
    addrs = list(dict.fromkeys(str(info[4][0]) for info in infos))
    checks = [Check("resolve", "ok", f"{host} is an IP address" if literal else
                    f"{host} -> {', '.join(addrs[:4])}")]
    loopback = all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs)
    problem = None
    for family, kind, proto, _, sockaddr in infos:
        sock = socket.socket(family, kind, proto)
        sock.settimeout(CONNECT_TIMEOUT_S)
        try:
            sock.connect(sockaddr)
            problem = None
            break
        except ConnectionRefusedError:
            problem = ("refused", sockaddr[0])
        except (TimeoutError, socket.timeout):
            problem = problem or ("timeout", sockaddr[0])
        except OSError as e:
            problem = problem or (e.strerror or str(e), sockaddr[0])
        finally:
            sock.close()
    if problem is not None:
        what, addr = problem
        if what == "refused":
            detail = f"{addr}:{port} refused the connection: nothing listens there"
            fix = ("start `gpumesh serve` on the coordinator machine with --host 0.0.0.0 (or "
                   "--tailscale), and check the port; a coordinator bound to 127.0.0.1 accepts "
                   "its own machine only")
            if loopback:
                fix = (f"{host} is this machine: start `gpumesh serve` here, or, on a worker "
                       "machine, use the coordinator's address (the `Join from ANOTHER machine` "
                       "line `gpumesh serve` printed)")
        elif what == "timeout":
            detail = f"no answer from {addr}:{port} within {CONNECT_TIMEOUT_S:.0f}s"
            fix = (f"a firewall drops the connection, or {addr} is on another network: allow TCP "
                   f"port {port} on the coordinator's firewall (Windows: run `gpumesh serve` as "
                   "Administrator once), or reach it through --tailscale or --public")
        else:
            detail = f"cannot connect to {addr}:{port} ({what})"
            fix = "this machine has no route there: check its network, or use --tailscale or --public"
        return checks + [Check("tcp", "fail", detail, fix)], False
    checks.append(Check("tcp", "ok", f"{host}:{port} accepts connections"))
    if not https:
        ip = ipaddress.ip_address(addrs[0].split("%")[0])
        if ip.is_loopback or ip in TAILNET or host.endswith(".ts.net"):
            checks.append(Check("tls", "skip", "plain HTTP on loopback or a tailnet (already private)"))
        else:
            checks.append(Check("tls", "warn", "plain HTTP: the token and every payload cross the "
                                "network unencrypted", "on a network you do not control use "
                                "`gpumesh serve --tls`, --tailscale or --public"))
        return checks, True
    checks.append(_tls(url, host, port, fingerprint))
    return checks, checks[-1].status != "fail"


def _tls(url: str, host: str, port: int, fingerprint: str | None) -> Check:
    from ..tls import fingerprint_der, normalise_fingerprint
    from ..transport import Unreachable, fetch_certificate
    if fingerprint:
        try:
            got = fingerprint_der(fetch_certificate(url))
        except Unreachable as e:
            return Check("tls", "fail", str(e), "the coordinator serves plain HTTP: use http:// "
                         "(or start it with --tls)")
        want = normalise_fingerprint(fingerprint)
        if got != want:
            return Check("tls", "fail", f"the certificate is {got}, not the pinned {want}",
                         "use the fingerprint `gpumesh serve --tls` printed; if it made a new "
                         "certificate, pin the new one; otherwise something intercepts the connection")
        return Check("tls", "ok", f"certificate matches the pinned {want[:19]}...")
    ctx = ssl.create_default_context()
    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S) as raw:
            with ctx.wrap_socket(raw, server_hostname=host) as tls:
                cert = tls.getpeercert() or {}
    except ssl.SSLCertVerificationError as e:
        return Check("tls", "fail", f"the certificate of {host} is not trusted here ({e.verify_message})",
                     "for a coordinator started with --tls pass the fingerprint it printed "
                     "(--fingerprint, $GPUMESH_FINGERPRINT); for a CA-issued one check its name, "
                     "expiry and this machine's clock")
    except ssl.SSLError as e:
        return Check("tls", "fail", f"no TLS handshake with {host}:{port} ({e.reason or e})",
                     "the coordinator serves plain HTTP: use http:// (or start it with --tls)")
    except OSError as e:
        return Check("tls", "fail", f"the TLS connection to {host}:{port} failed ({e})",
                     "retry; if it persists, check what listens on that port")
    rdns: Any = cert.get("issuer", ())  # ((("organizationName", "..."),), ...)
    issuer = dict(x[0] for x in rdns if x).get("organizationName", "a trusted CA")
    return Check("tls", "ok", f"certificate for {host} verified (issued by {issuer})")


def _clock(date: str | None, sent: float, answered: float) -> Check:
    """The coordinator's ``Date`` header against this machine's clock."""
    try:
        theirs = parsedate_to_datetime(date).timestamp() if date else None
    except (TypeError, ValueError):
        theirs = None
    if theirs is None:
        return Check("clock", "skip", "the coordinator sent no Date header")
    # Date has whole seconds: anything within the round trip plus one second is no skew
    skew = theirs - (sent + answered) / 2
    slack = (answered - sent) / 2 + 1.0
    shown = f"{abs(skew):.0f}s {'behind' if skew < 0 else 'ahead of'} this machine"
    fix = ("sync the clocks: `sudo timedatectl set-ntp true` on Linux; on Windows Settings > "
           "Time & language > Sync now; on macOS System Settings > Date & Time, set automatically")
    if abs(skew) > CLOCK_SKEW_FAIL_S:
        return Check("clock", "fail", f"the coordinator's clock is {shown}: TLS certificates "
                     "look expired or not yet valid to one side", fix)
    if abs(skew) > max(CLOCK_SKEW_WARN_S, slack):
        return Check("clock", "warn", f"the coordinator's clock is {shown}: logs and traces "
                     "of the two machines will not line up", fix)
    return Check("clock", "ok", f"within {max(CLOCK_SKEW_WARN_S, slack):.0f}s of the coordinator's")


def _version(theirs: str, url: str) -> Check:
    if theirs == __version__:
        return Check("version", "ok", f"gpumesh {theirs} on both machines")
    # The coordinator refuses every other version (gpumesh.versions); PyPI's "gpumesh" is
    # another project, so the fix is the coordinator's own wheel.
    from ..coordinator.dist import install_command
    return Check("version", "fail", f"the coordinator runs gpumesh {theirs}, this machine "
                 f"{__version__}: it refuses other versions",
                 f"install the coordinator's here: {install_command(url, theirs)}")


def _coordinator(url: str | None, token: str | None, fingerprint: str | None = None) -> list[Check]:
    from ..errors import AuthError, MeshError
    from ..transport import Transport, Unreachable
    try:
        ep = config.resolve(url, token, fingerprint)
    except ValueError as e:
        return [Check("coordinator", "fail", str(e), "pass --url http://HOST:PORT")]
    where = "as given" if url else ("from $GPUMESH_URL" if limits.setting("GPUMESH_URL")
                                      else "from the saved config" if config.load_saved().get("url")
                                      else "the default")
    try:
        http = Transport(ep.url, ep.token, fingerprint=ep.fingerprint)
    except ValueError as e:
        return [Check("coordinator", "fail", str(e), "use an https:// URL with --fingerprint")]
    checks, reachable = _network(ep.url, ep.fingerprint)
    if not reachable:  # the failed step above is the one to fix: what follows fails with it
        return checks + [Check("coordinator", "skip", f"{ep.url} ({where}): not tried, the way "
                               "there failed above"),
                         Check("token", "skip", "coordinator not reachable")]
    try:
        try:
            sent = wall_clock()
            resp = http.request("GET", protocol.HEALTH, timeout=5)
            answered = wall_clock()
            health = resp.json()
        except Unreachable as e:
            return checks + [
                Check("coordinator", "fail", f"{ep.url} ({where}) is not reachable: {e}",
                      "start it with `gpumesh serve`, check the URL and port, and that a "
                      "firewall lets this machine in (a coordinator bound to 127.0.0.1 "
                      "accepts this machine only)"),
                Check("token", "skip", "coordinator not reachable")]
        except (MeshError, ValueError) as e:
            return checks + [Check("coordinator", "fail", f"{ep.url}: {e}",
                                   "check the URL (a path prefix included) and --fingerprint"),
                             Check("token", "skip", "coordinator not reachable")]
        theirs = str(health.get("version", "?")) if isinstance(health, dict) else "?"
        checks += [Check("coordinator", "ok", f"{ep.url} ({where}) answers, gpumesh {theirs}"),
                   _version(theirs, ep.url), _clock(resp.headers.get("date"), sent, answered)]
        if theirs != __version__:  # every other request would be refused: say it once
            return checks + [Check("token", "skip", "another gpumesh version: the coordinator "
                                   "refuses this one")]
        if not ep.token:
            checks.append(Check("token", "fail", "no token set",
                                "pass --token, set GPUMESH_TOKEN, or run `gpumesh serve` here "
                                "(the coordinator printed it)"))
            return checks
        try:
            workers = http.request("GET", protocol.WORKERS, timeout=5).json()
        except AuthError as e:
            text = str(e)
            if "worker token" in text or "403" in text:
                checks.append(Check("token", "warn", "accepted as a worker token: it may join, "
                                    "but not submit jobs", "callers need the main token"))
            else:
                checks.append(Check("token", "fail", f"refused by the coordinator ({len(ep.token)} "
                                    "characters)", "use the token `gpumesh serve` printed "
                                    "(or its --token / $GPUMESH_TOKEN)"))
            return checks
        except MeshError as e:
            checks.append(Check("token", "fail", str(e), "see the coordinator's log"))
            return checks
        alive = sum(1 for w in workers if w.get("alive"))
        checks.append(Check("token", "ok", f"accepted; {alive} worker(s) alive"))
        # A safe-mode coordinator refuses a function job before it looks for workers:
        # with none alive, a call is refused too, not run locally (client/native.py
        # falls back on no_workers only).
        safe = isinstance(health, dict) and health.get("safe_mode") is True
        if safe:
            checks.append(Check("safe mode", "warn", "the coordinator runs with --safe-mode: it "
                                "refuses function calls (@mesh, GPUMesh.map) with RequestRejected "
                                "(HTTP 403), whether or not workers are connected; script jobs "
                                "(gpumesh submit) run",
                                "submit script jobs, or restart `gpumesh serve` without "
                                "--safe-mode to run functions"))
        if not alive:
            checks.append(Check("workers", "warn", "no worker is connected: " + (
                                "script jobs wait for one (function calls are refused: safe mode)"
                                if safe else "calls run locally"),
                                f"on each worker machine: gpumesh join {ep.url} --token ..."))
        checks += pool_checks([w for w in workers if w.get("alive")], ep.url)
        return checks
    finally:
        http.close()


#: Packages named per pool check at most (the rest are counted).
POOL_LIST = 8
#: Installers' own distributions: a difference in them never changes what a task sees.
POOL_IGNORED = frozenset({"pip", "setuptools", "wheel"})
#: Named first when they differ: the packages whose objects most often travel in pickles
#: (cloudpickle itself first: every machine should have the same one).
POOL_FIRST = ("cloudpickle", "numpy", "pandas", "torch", "pyarrow", "scipy", "scikit-learn",
              "jax", "polars", "xarray")


def _pool_order(name: str) -> tuple[int, str]:
    return (POOL_FIRST.index(name) if name in POOL_FIRST else len(POOL_FIRST), name)


def _who(w: dict) -> str:
    return f"{w.get('hostname') or '?'} ({str(w.get('id', '?'))[:8]})"


def pool_checks(workers: list[dict], url: str) -> list[Check]:
    """Compare the alive workers with each other and with this machine: Python minor
    versions (code shipped by value runs only on the caller's), gpumesh versions, and
    the Python packages some have and others lack or have in another version."""
    from ..coordinator.dist import install_command
    from ..hardware import python_minor
    if not workers:
        return []
    here = python_minor(platform.python_version())
    by_python: dict[str, list[str]] = {}
    by_version: dict[str, list[str]] = {}
    for w in workers:
        by_python.setdefault(python_minor(w.get("python")) or "?", []).append(_who(w))
        by_version.setdefault(str(w.get("version") or "?"), []).append(_who(w))
    py = "; ".join(f"Python {v}: {', '.join(ws)}" for v, ws in sorted(by_python.items()))
    checks = [Check("pool python", "ok" if set(by_python) == {here} else "warn", py,
                    "" if set(by_python) == {here} else
                    f"functions defined in __main__, a notebook or a closure on this machine "
                    f"(Python {here}) run only on workers of Python {here}; use the same Python "
                    f"minor version on every machine")]
    ver = "; ".join(f"gpumesh {v}: {', '.join(ws)}" for v, ws in sorted(by_version.items()))
    checks.append(Check("pool gpumesh", "ok" if set(by_version) == {__version__} else "fail", ver,
                        "" if set(by_version) == {__version__} else
                        f"on each of the others: {install_command(url)}"))
    checks += _module_checks(workers)
    checks += _version_gap_checks(workers)
    reported = [w for w in workers if isinstance(w.get("packages"), dict)]
    if len(reported) < 2:
        return checks
    names = set().union(*(w["packages"] for w in reported)) - POOL_IGNORED
    mine = installed()
    partial, versions = [], []
    for name in sorted(names, key=_pool_order):
        have = [w for w in reported if name in w["packages"]]
        theirs = {w["packages"][name] for w in have}
        here_too = f" (here {mine[name]})" if name in mine and {mine[name]} != theirs else ""
        if len(have) < len(reported):
            partial.append(f"{name} ({len(have)} of {len(reported)}: "
                           f"{', '.join(_who(w) for w in have)})")
        elif len(theirs) > 1 or here_too:
            versions.append(f"{name} " + "/".join(sorted(theirs)) + here_too)
    if not partial and not versions:
        checks.append(Check("pool packages", "ok", f"the {len(reported)} workers have the same "
                            f"{len(names)} Python packages"))
        return checks
    parts = []
    if partial:
        parts.append(f"only on some workers: {'; '.join(partial[:POOL_LIST])}"
                     + (f" and {len(partial) - POOL_LIST} more" if len(partial) > POOL_LIST else ""))
    if versions:
        parts.append(f"in different versions: {', '.join(versions[:POOL_LIST])}"
                     + (f" and {len(versions) - POOL_LIST} more" if len(versions) > POOL_LIST else ""))
    checks.append(Check("pool packages", "warn", "; ".join(parts),
                        "a task whose function imports a package some workers lack runs on those "
                        "that have it (tried there after a ModuleNotFoundError); install what your "
                        "functions import on every worker"))
    return checks


def _module_checks(workers: list[dict]) -> list[Check]:
    """The ``pool modules`` check: the modules recent jobs imported and did not find on
    some of the alive ``workers`` (their tasks ran on the others), or on every one of
    them (then no alive worker can run those tasks: they fail with ModuleNotFoundError)."""
    lacking: dict[str, list[dict]] = {}
    for w in workers:
        for module in w.get("lacks") or ():
            lacking.setdefault(str(module), []).append(w)
    if not lacking:
        return []
    alive = {str(w.get("id")) for w in workers}
    nowhere = {m: ws for m, ws in lacking.items() if {str(w.get("id")) for w in ws} >= alive}
    somewhere = {m: ws for m, ws in lacking.items() if m not in nowhere}

    def listed(modules: dict[str, list[dict]]) -> str:
        items = sorted(modules.items())
        return "; ".join(f"{m} (not on {', '.join(_who(w) for w in ws)})"
                         for m, ws in items[:POOL_LIST]) + \
            (f" and {len(items) - POOL_LIST} more" if len(items) > POOL_LIST else "")

    details, fixes = [], []
    if nowhere:
        details.append("recent jobs imported modules no alive worker has: " + listed(nowhere))
        fixes.append("no alive worker can run a task that imports them: it fails with "
                     "ModuleNotFoundError; install the package that provides each module on "
                     "the workers")
    if somewhere:
        details.append(("Modules some workers lack: " if nowhere else
                        "recent jobs imported modules some workers lack: ") + listed(somewhere))
        fixes.append(("for those some workers lack, " if nowhere else "")
                     + "their tasks ran on the other workers; install the package that "
                     "provides each module on these workers to use them too")
    return [Check("pool modules", "warn", ". ".join(details), "; ".join(fixes))]


def _version_gap_checks(workers: list[dict]) -> list[Check]:
    """The ``pool versions`` check: modules recent jobs needed (to unpickle a call's
    arguments, mostly) that some workers' versions of their package do not have, with
    this machine's version of each package beside the workers'. Not modules the workers
    lack: the callers and the workers run different versions of the package."""
    gaps: dict[tuple[str, str], list[str]] = {}
    for w in workers:
        for gap in w.get("version_gaps") or ():
            if isinstance(gap, dict):
                key = (str(gap.get("module")), str(gap.get("package")))
                gaps.setdefault(key, []).append(f"{gap.get('version')} on {_who(w)}")
    if not gaps:
        return []
    from importlib import metadata
    items = []
    for (module, package), where in sorted(gaps.items())[:POOL_LIST]:
        try:
            here = f"; {metadata.version(package)} here"
        except Exception:  # noqa: BLE001 - not installed here, or broken metadata
            here = ""
        items.append(f"{module} is not in {package} {', '.join(where)}{here}")
    more = f" and {len(gaps) - POOL_LIST} more" if len(gaps) > POOL_LIST else ""
    packages_named = sorted({p for _, p in gaps})
    return [Check("pool versions", "warn",
                  "recent calls needed modules that the workers' versions of their packages "
                  "do not have: " + "; ".join(items) + more,
                  f"the callers run another version of {', '.join(packages_named)} than these "
                  "workers (their tasks ran on workers whose version had the module, where "
                  "there were any); install the same version on the callers and the workers, "
                  "or call with requires= naming the callers' version on workers joined with "
                  "--allow-installs")]


@click.command()
@click.argument("target", metavar="[URL]", required=False)
@endpoint_options
@click.option("--json", "as_json", is_flag=True, help="Print the checks as JSON [default: text].")
def doctor(target, url, token, fingerprint, as_json):
    """Check this machine and its connection to the mesh; say how to fix each problem.

    Checks the install, Python, cloudpickle, torch/CUDA and NVIDIA GPUs (optional), the
    saved connection (the token is never printed), then the way to the coordinator at URL
    (default: --url, $GPUMESH_URL, the saved config): name resolution, TCP reach, TLS,
    that it answers, its version, the clock difference, and that it accepts the token;
    then it compares the pool: the workers' Python and gpumesh versions and the packages
    only some of them have. Run it on a worker machine or the coordinator's. Exit code 1 if any check failed.
    """
    from .secrecy import hide
    if target and url and target.rstrip("/") != url.rstrip("/"):
        raise click.UsageError(f"two different URLs: {target} and --url {url}; give one")
    if target or url:
        url = given_url(target or url, None if target else "--url")
    else:
        given_url(None)  # $GPUMESH_URL is checked as a flag is
    checks = [_install(), _python(), _cloudpickle(), _torch(), _gpus(), _runtime(), _saved(url, token)]
    checks += _coordinator(url, token, fingerprint)
    hide(token)
    failed = any(c.status == "fail" for c in checks)
    if as_json:
        click.echo(json.dumps({"ok": not failed, "checks": [asdict(c) for c in checks]}, indent=2))
    else:
        for line in text_lines(checks):
            click.echo(line)
        click.echo("")
        click.echo(summary(checks))
    if failed:
        sys.exit(1)


def text_lines(checks: list[Check]) -> list[str]:
    """The checks as doctor prints them: ``[OK]   name          detail``, every detail in
    one column, and under a warning or failure its ``-> fix`` in that column too."""
    tags = {"ok": "[OK]  ", "warn": "[WARN]", "fail": "[FAIL]", "skip": "[--]  "}
    lines = []
    for c in checks:
        lines.append(f"{tags[c.status]} {c.name:<{NAME_WIDTH}} {c.detail}")
        if c.fix and c.status in ("fail", "warn"):
            lines.append(f"{'':{NAME_WIDTH + 8}}-> {c.fix}")
    return lines


def summary(checks: list[Check]) -> str:
    """The last line: ``all checks passed`` or ``some checks failed``, and how many
    warned (``all checks passed, 2 warnings``): a warning does not fail the run."""
    warned = sum(c.status == "warn" for c in checks)
    line = "some checks failed" if any(c.status == "fail" for c in checks) else "all checks passed"
    return line + (f", {warned} warning{'s' * (warned != 1)}" if warned else "")
