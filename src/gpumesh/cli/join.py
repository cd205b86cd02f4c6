"""``gpumesh join URL``: make this machine a worker of a mesh."""

from __future__ import annotations

import os
import signal

import click

from .. import config
from ..errors import AuthError
from .common import fail
from .secrecy import hide


def _interrupt(signum, frame):
    raise KeyboardInterrupt


@click.command()
@click.argument("url")
@click.option("--token", default=None, metavar="TOKEN",
              help="The coordinator's main or worker token [default: $GPUMESH_WORKER_TOKEN, "
                   "then $GPUMESH_TOKEN, else the saved config].")
@click.option("--cpu-slots", "--slots", "slots", type=click.IntRange(0, 1024), default=1,
              show_default=True,
              help="CPU tasks this worker runs at once, besides one task per GPU "
                   "(--slots is the same option).")
@click.option("--fingerprint", default=None, metavar="SHA256:HEX",
              help="Pin the coordinator's TLS certificate (what `gpumesh serve --tls` printed) "
                   "[default: $GPUMESH_FINGERPRINT, else the saved config].")
def join(url, token, slots, fingerprint):
    """Join the mesh whose coordinator is at URL (e.g. http://192.0.2.10:8000)."""
    from ..worker.agent import WorkerAgent
    from ..worker.device import detect

    try:
        url = config.normalise_url(url)
    except ValueError as e:
        fail(str(e))
    token = token or os.environ.get("GPUMESH_WORKER_TOKEN") or os.environ.get("GPUMESH_TOKEN")
    fingerprint = fingerprint or os.environ.get("GPUMESH_FINGERPRINT") or None
    if token is None or fingerprint is None:
        saved = config.load_saved()
        if saved.get("url") == url:
            token = token or saved.get("token")
            fingerprint = fingerprint or saved.get("fingerprint")
    hide(token)  # out of ps and /proc/PID/environ from here on
    if not token:
        fail("no token: pass --token=TOKEN or set GPUMESH_TOKEN (the coordinator printed it)")
    if fingerprint is not None:
        from ..tls import normalise_fingerprint
        try:
            fingerprint = normalise_fingerprint(fingerprint)
        except ValueError as e:
            fail(str(e))
        if not url.startswith("https://"):
            fail(f"--fingerprint pins a TLS certificate, but {url} is not an https:// URL")

    info = detect()
    if slots == 0 and not (info["gpus"] or info["mps"]):
        fail("--cpu-slots 0 leaves this worker no slot: it has no GPU")
    offered = []
    if info["gpus"]:
        offered.append(f"{len(info['gpus'])} GPU (" + ", ".join(
            f"cuda:{g['index']} {g['name']} ({g['memory_total_mb']} MiB)" for g in info["gpus"]) + ")")
    if info["mps"]:
        offered.append("1 MPS (Apple GPU)")
    if slots:
        offered.append(f"{slots} CPU ({info['cpu']}, {info['cores']} cores)")
    click.echo(f"[worker] slots: {', '.join(offered)}")

    def on_event(kind: str, text: str) -> None:
        # "scored" lines (device=... score=...) come once the benchmark, which runs
        # after joining and only while no task runs, has measured every device.
        click.echo(f"[worker] {text}")

    agent = WorkerAgent(url, token, slots=slots, info=info, on_event=on_event, fingerprint=fingerprint)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        agent.run()
    except AuthError as e:
        fail(str(e))
    except KeyboardInterrupt:
        click.echo("[worker] stopped")
