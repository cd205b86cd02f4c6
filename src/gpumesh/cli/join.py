"""``gpumesh join URL``: make this machine a worker of a mesh."""

from __future__ import annotations

import os
import signal

import click

from .. import config, limits
from ..errors import AuthError, RequestRejected, VersionMismatch
from .common import fail, fingerprint_option, given_url
from .owner import owner_options
from .secrecy import hide


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _exit_with_parent() -> None:
    """Stop this process (as if by Ctrl+C) once the process that started it is gone."""
    import _thread
    import threading
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            threading.Event().wait(0.5)
        _thread.interrupt_main()
    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


@click.command()
@click.argument("url", required=False)
@click.option("--token", default=None, metavar="TOKEN",
              help="The coordinator's main or worker token [default: $GPUMESH_WORKER_TOKEN, "
                   "then $GPUMESH_TOKEN, else the saved config].")
@click.option("--cpu-slots", "--slots", "slots", type=click.IntRange(0, limits.MAX_SLOTS), default=None,
              help="CPU tasks this worker runs at once, besides one task per GPU "
                   "(--slots is the same option) [default: 1].")
@fingerprint_option
@click.option("--runtime", type=click.Choice(["fork", "spawn"]), default=None,
              help="How task processes start: fork (a warm host forks one per task; Linux) "
                   "or spawn (fresh interpreters started ahead of need; Windows, macOS) "
                   "[default: $GPUMESH_RUNTIME, else the platform's].")
@owner_options
@click.option("--allow-installs", is_flag=True,
              help="Let tasks with requires=[...] run here in environments that uv builds "
                   "and caches ($GPUMESH_ENV_DIR, capped at $GPUMESH_ENV_CACHE_MB) "
                   "[default: off: such a task runs here only if its packages are installed].")
def join(url, token, slots, fingerprint, runtime, allow_installs, **owner_flags):
    """Join the mesh whose coordinator is at URL (e.g. http://192.0.2.10:8000).

    Without URL, looks for coordinators on the LAN for a few seconds (mDNS, as
    `gpumesh radar` does) and joins the one found; several or none is an error.

    What is shared, when, and when the machine's owner comes first: the flags below, or
    the same settings kept in ~/.gpumesh/worker.toml (on macOS in ~/Library/Application
    Support/gpumesh, on Windows in %LOCALAPPDATA%\\gpumesh), named as the flags with _
    for - (cpu_slots = 2, hours = ["mon-fri 19:00-23:30"]); a flag wins over the file,
    which must be yours and writable by no one else. `gpumesh pause` / `resume` at any
    time. More in docs/owner.md, in the gpumesh source tree and its sdist."""
    from ..worker.agent import WorkerAgent
    from ..worker.device import detect
    from ..worker.procs import choose_runtime

    from . import owner as owner_cli
    try:
        policy, file_slots = owner_cli.build_policy(
            dict(owner_flags, cpu_slots=slots), owner_cli.load_worker_config())
    except ValueError as e:
        fail(str(e), code=2)
    slots = 1 if file_slots is None else file_slots
    if url is not None:
        url = given_url(url, None)  # a bad one is a usage error
    else:
        try:
            url = config.normalise_url(_discover_url())
        except ValueError as e:  # announced by a coordinator that is not ours
            fail(str(e))
    token = token or os.environ.get("GPUMESH_WORKER_TOKEN") or os.environ.get("GPUMESH_TOKEN")
    fingerprint = fingerprint or limits.setting("GPUMESH_FINGERPRINT")
    if fingerprint is not None:  # typed by the user: a malformed one is a usage error
        fingerprint = _fingerprint(fingerprint, code=2)
    if (token is None or fingerprint is None) and config.saved_token(url) is not None:
        # the saved config names this coordinator (compared as URLs: "...:8000/" too)
        token = token or config.saved_token(url)
        fingerprint = fingerprint or config.load_saved().get("fingerprint")
    hide(token)  # out of ps and /proc/PID/environ from here on
    if not token:
        fail("no token: pass --token=TOKEN or set GPUMESH_TOKEN (the coordinator printed it)")
    if fingerprint is not None:
        fingerprint = _fingerprint(fingerprint, code=1)  # (a saved one: the file is wrong)
        if not url.startswith("https://"):  # (a wrong combination: a usage error)
            fail(f"--fingerprint pins a TLS certificate, but {url} is not an https:// URL", code=2)

    try:
        runtime, runtime_why = choose_runtime(runtime)
    except ValueError as e:
        fail(str(e), code=2)
    if allow_installs:
        from ..worker.envs import find_uv
        if find_uv() is None:
            fail("--allow-installs builds environments with uv, which is not installed here: "
                 "pip install uv")
    info = detect()
    from ..worker.owner import share_gpus
    try:
        info["gpus"] = share_gpus(info["gpus"], policy, "--gpus" if owner_flags.get("gpus")
                                  else f"gpus in {owner_cli.worker_config_path()}")
    except ValueError as e:
        fail(str(e), code=2)
    if policy.gpus == ():  # "none": CPU slots only, the Apple GPU too stays the owner's
        info["mps"] = False
    if not info["gpus"] and not info["mps"]:
        info["device"], info["device_name"] = "CPU", info["cpu"]
    if slots == 0 and not (info["gpus"] or info["mps"]):
        fail("--cpu-slots 0 leaves this worker no slot: it has no GPU", code=2)
    offered = []
    if info["gpus"]:
        offered.append(f"{len(info['gpus'])} GPU (" + ", ".join(
            f"cuda:{g['index']} {g['name']} ({g['memory_total_mb']} MiB)" for g in info["gpus"]) + ")")
    if info["mps"]:
        offered.append("1 MPS (Apple GPU)")
    if slots:
        offered.append(f"{slots} CPU ({info['cpu']}, {info['cores']} cores)")
    click.echo(f"[worker] slots: {', '.join(offered)}")
    click.echo(f"[worker] runtime: {runtime} ({runtime_why})")

    def on_event(kind: str, text: str) -> None:
        # "scored" lines (device=... score=...) come once the benchmark, which runs
        # after joining and only while no task runs, has measured every device.
        click.echo(f"[worker] {text}")

    inactive = owner_cli.gpu_rules_inactive(policy, info["gpus"])
    no_memory = owner_cli.gpu_memory_inactive(policy, info["gpus"])
    for line in owner_cli.describe_policy(policy, gpu_rules=inactive is None,
                                          gpu_memory=no_memory is None):
        click.echo(f"[worker] {line}")
    for warning in (inactive, no_memory):
        if warning:
            click.echo(f"[worker] {warning}", err=True)
    from ..worker.owner import OwnerState
    agent = WorkerAgent(url, token, slots=slots, info=info, on_event=on_event, fingerprint=fingerprint,
                        owner=OwnerState(policy), allow_installs=allow_installs,
                        runtime=runtime)
    if allow_installs:
        click.echo(f"[worker] installs allowed: requires= environments in {agent.envs.root}")
    control = _control_channel(agent)
    advert = _advertise(url, info)
    if advert is not None:
        def and_advertise(kind: str, text: str) -> None:  # the radar shows the score too
            on_event(kind, text)
            if kind == "scored":
                advert.update(score=f"{float(agent.info.get('score') or 0):.3f}")
        agent.on_event = and_advertise
    signal.signal(signal.SIGTERM, _interrupt)
    # A SIGINT that a non-interactive shell told us to ignore (`cmd &`) still means stop.
    signal.signal(signal.SIGINT, _interrupt)
    if os.environ.pop("GPUMESH_EXIT_WITH_PARENT", None) == "1":
        _exit_with_parent()  # serve's self-worker: never outlive its coordinator process
    try:
        agent.run()
    except AuthError as e:
        # join reads $GPUMESH_WORKER_TOKEN before $GPUMESH_TOKEN: say which one to check.
        fail(str(e).replace("check --token / $GPUMESH_TOKEN",
                            "check --token / $GPUMESH_WORKER_TOKEN / $GPUMESH_TOKEN"))
    except (VersionMismatch, RequestRejected) as e:
        fail(str(e))
    except KeyboardInterrupt:
        click.echo("[worker] stopped")
    finally:
        if advert is not None:
            advert.close()
        if control is not None:
            control.close()


def _fingerprint(given: str, code: int) -> str:
    """``given`` as ``SHA256:hex``; a malformed one ends the command (exit ``code``)."""
    from ..tls import normalise_fingerprint
    try:
        return normalise_fingerprint(given)
    except ValueError as e:
        fail(f"--fingerprint: {e}" if code == 2 else str(e), code=code)


def _control_channel(agent):
    """Open the owner's local channel (gpumesh pause/resume); None, with a warning, when
    its directory is not safe to use."""
    from ..worker import control
    try:
        return control.ControlServer(agent.control).start()
    except (control.ControlError, OSError) as e:
        click.echo(f"[worker] warning: `gpumesh pause` cannot reach this worker: {e}", err=True)
        return None


def _discover_url() -> str:
    """The one coordinator announced on the LAN, else a one-line error."""
    from .. import discovery
    if not discovery.enabled():
        fail(f"no URL given and LAN discovery is off ({discovery.ENV}=0); "
             "pass the coordinator's URL: gpumesh join URL")
    click.echo(f"[worker] no URL given: looking for coordinators on the LAN ({limits.DISCOVERY_BROWSE_S:g} s)...")
    try:
        found = discovery.coordinators(discovery.browse(limits.DISCOVERY_BROWSE_S))
    except discovery.DiscoveryUnavailable as e:
        fail(f"{e}; or pass the coordinator's URL: gpumesh join URL")
    except OSError as e:
        fail(f"cannot look for coordinators on this network ({e}); pass the URL: gpumesh join URL")
    if len(found) != 1:
        listed = "; ".join(f"{c['url']} ({c['host'] or '?'})" for c in found)
        what = f"{len(found)} coordinators found ({listed})" if found else "no coordinator found on the LAN"
        fail(f"{what}; pass the coordinator's URL: gpumesh join URL")
    c = found[0]
    click.echo(f"[worker] found coordinator {c['url']} ({c['host'] or '?'})")
    return c["url"]


def _advertise(url: str, info: dict):
    """Announce this worker on the LAN when its coordinator is not on loopback."""
    from .. import discovery
    if not discovery.enabled():
        return None
    address = discovery.worker_address(url)
    if address is None:
        return None
    from urllib.parse import urlsplit
    from .._version import __version__
    port = urlsplit(url).port or (443 if url.startswith("https://") else 80)
    return discovery.advertise("worker", [address], port, version=__version__,
                               device=info.get("device"), device_name=info.get("device_name"),
                               hostname=info.get("hostname"), score="pending", coordinator=url)
