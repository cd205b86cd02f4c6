"""``gpumesh doctor``: check this machine's install and its connection to a coordinator.

Each check is ``ok``, ``warn`` (optional or worth knowing, never fails the run), ``fail``
(with what to do) or ``skip``. Exit code 1 if any check failed. The token is never
printed: only whether one is set, where it came from and its length.
"""

from __future__ import annotations

import json
import os
import platform
import stat
import sys
from dataclasses import asdict, dataclass

import click

from .. import config
from .._version import __version__
from .common import endpoint_options


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
                     "pip install -e . (or pip install gpumesh)")
    if installed != __version__:
        return Check("install", "fail", f"installed metadata says {installed}, the code is {__version__}",
                     "reinstall: pip install --force-reinstall gpumesh")
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
            how = "no NVIDIA GPU found (NVML not installed: pip install 'gpumesh[gpu]' on GPU machines)"
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


def _saved() -> Check:
    path = config.config_path()
    saved = config.load_saved()
    if not path.exists():
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


def _coordinator(url: str | None, token: str | None) -> list[Check]:
    from ..errors import AuthError, MeshError
    from ..transport import Transport, Unreachable
    try:
        ep = config.resolve(url, token)
    except ValueError as e:
        return [Check("coordinator", "fail", str(e), "pass --url http://HOST:PORT")]
    where = "from --url" if url else ("from $GPUMESH_URL" if os.environ.get("GPUMESH_URL")
                                      else "from the saved config" if config.load_saved().get("url")
                                      else "the default")
    try:
        http = Transport(ep.url, ep.token, fingerprint=ep.fingerprint)
    except ValueError as e:
        return [Check("coordinator", "fail", str(e), "use an https:// URL with --fingerprint")]
    try:
        try:
            health = http.request("GET", "/v1/health", timeout=5).json()
        except Unreachable as e:
            return [Check("coordinator", "fail", f"{ep.url} ({where}) is not reachable: {e}",
                          "start it with `gpumesh serve`, check the URL and port, and that a "
                          "firewall lets this machine in (a coordinator bound to 127.0.0.1 "
                          "accepts this machine only)"),
                    Check("token", "skip", "coordinator not reachable")]
        except MeshError as e:
            return [Check("coordinator", "fail", f"{ep.url}: {e}", "check the URL and --fingerprint"),
                    Check("token", "skip", "coordinator not reachable")]
        theirs = health.get("version", "?")
        checks = [Check("coordinator", "ok" if theirs == __version__ else "warn",
                        f"{ep.url} ({where}) answers, gpumesh {theirs}",
                        "" if theirs == __version__ else
                        f"this machine has gpumesh {__version__}: install the same version everywhere")]
        if not ep.token:
            checks.append(Check("token", "fail", "no token set",
                                "pass --token, set GPUMESH_TOKEN, or run `gpumesh serve` here "
                                "(the coordinator printed it)"))
            return checks
        try:
            workers = http.request("GET", "/v1/workers", timeout=5).json()
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
        if not alive:
            checks.append(Check("workers", "warn", "no worker is connected: calls run locally",
                                f"on each worker machine: gpumesh join {ep.url} --token ..."))
        return checks
    finally:
        http.close()


@click.command()
@endpoint_options
@click.option("--json", "as_json", is_flag=True, help="Print the checks as JSON [default: text].")
def doctor(url, token, as_json):
    """Check this machine and its connection to the mesh; say how to fix each problem.

    Checks the install, Python, cloudpickle, torch/CUDA and NVIDIA GPUs (optional), the
    saved connection (the token is never printed), and that the coordinator answers and
    accepts the token. Exit code 1 if any check failed.
    """
    from .secrecy import hide
    checks = [_install(), _python(), _cloudpickle(), _torch(), _gpus(), _runtime(), _saved()]
    checks += _coordinator(url, token)
    hide(token)
    failed = any(c.status == "fail" for c in checks)
    if as_json:
        click.echo(json.dumps({"ok": not failed, "checks": [asdict(c) for c in checks]}, indent=2))
    else:
        tags = {"ok": "[OK]  ", "warn": "[WARN]", "fail": "[FAIL]", "skip": "[--]  "}
        for c in checks:
            click.echo(f"{tags[c.status]} {c.name:<12} {c.detail}")
            if c.fix and c.status in ("fail", "warn"):
                click.echo(f"{'':20}-> {c.fix}")
        click.echo("")
        click.echo("some checks failed" if failed else "all checks passed")
    if failed:
        sys.exit(1)
