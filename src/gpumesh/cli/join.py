"""``gpumesh join URL``: make this machine a worker of a mesh."""

from __future__ import annotations

import os
import signal

import click

from .. import config
from ..errors import AuthError
from .common import fail


def _interrupt(signum, frame):
    raise KeyboardInterrupt


@click.command()
@click.argument("url")
@click.option("--token", default=None, metavar="TOKEN",
              help="The coordinator's token [default: $GPUMESH_TOKEN, else the saved config].")
@click.option("--slots", type=click.IntRange(1, 1024), default=1, show_default=True,
              help="Tasks this worker runs at once.")
def join(url, token, slots):
    """Join the mesh whose coordinator is at URL (e.g. http://192.0.2.10:8000)."""
    from ..worker.agent import WorkerAgent
    from ..worker.bench import score
    from ..worker.device import detect

    try:
        url = config.normalise_url(url)
    except ValueError as e:
        fail(str(e))
    token = token or os.environ.get("GPUMESH_TOKEN")
    if token is None:
        saved = config.load_saved()
        if saved.get("url") == url:
            token = saved.get("token")
    if not token:
        fail("no token: pass --token=TOKEN or set GPUMESH_TOKEN (the coordinator printed it)")

    info = detect()
    bench = score()
    info["score"] = bench["score"]
    click.echo(f"[worker] device={info['device']} {info['device_name']} score={bench['score']:.3f} GFLOP/s")

    def on_event(kind: str, text: str) -> None:
        click.echo(f"[worker] {text}")

    agent = WorkerAgent(url, token, slots=slots, info=info, on_event=on_event)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        agent.run()
    except AuthError as e:
        fail(str(e))
    except KeyboardInterrupt:
        click.echo("[worker] stopped")
