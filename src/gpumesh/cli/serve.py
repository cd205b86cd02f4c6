"""``gpumesh serve``: run a coordinator (and, by default, a worker for this machine)."""

from __future__ import annotations

import getpass
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import click

from .. import config
from ..limits import DEFAULT_PORT
from .common import fail


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


def _device_line() -> str:
    from ..worker.device import detect
    d = detect()
    return f"{d['device']} {d['device_name']}"


def banner(host: str, port: int, token: str, show_token: bool) -> list[str]:
    """The lines ``serve`` prints once it listens (wording kept from the product README)."""
    local = f"http://127.0.0.1:{port}"
    tok = token if show_token else "<your token>"
    lines = [f"[OK] Coordinator listening on {host}:{port}"]
    if show_token:
        lines.append(f"   Token: {token}")
    lines += ["", f"   Join from THIS machine:   gpumesh join {local} --token={tok}"]
    if host in ("127.0.0.1", "localhost", "::1"):
        lines += [
            f"   Other machines CANNOT reach this coordinator (bound to {host} only).",
            "   That is the default now: a worker executes code as the user who started it.",
            f"   To let other machines join, re-run with: gpumesh serve --host 0.0.0.0 --port {port} --token=<your token>",
            "   (or set GPUMESH_HOST=0.0.0.0). Read the warning it prints before you do.",
        ]
    else:
        ip = _lan_ip() if host in ("0.0.0.0", "::") else host
        if ip:
            lines.append(f"   Join from ANOTHER machine: gpumesh join http://{ip}:{port} --token={tok}")
        lines += ["   (127.0.0.1 always works locally; the LAN IP is for other machines)", ""]
        bar = "  " + "!" * 62
        lines += [bar, "  !! NETWORK-EXPOSED COORDINATOR", bar,
                  f"   Bound to:      {host}:{port} (not loopback — other machines can connect)",
                  f"   Tasks run as:  {getpass.getuser()}",
                  f"   On device:     {_device_line()}", "",
                  "   Anyone who can reach this port AND has the token can run",
                  f"   arbitrary code on this machine as {getpass.getuser()}.",
                  "   Only do this on a network you trust, and keep the token secret.",
                  f"   Loopback-only (the default) is: gpumesh serve --port {port}", bar]
    lines.append("   Ctrl+C to stop")
    return lines


class _MeshLogFormat(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return f"[mesh] {record.getMessage()}"


@click.command()
@click.option("--host", default=None, metavar="ADDR",
              help="Address to bind [default: $GPUMESH_HOST, else 127.0.0.1 (this machine only)].")
@click.option("--port", type=click.IntRange(1, 65535), default=DEFAULT_PORT, show_default=True,
              help="TCP port to listen on.")
@click.option("--token", default=None, metavar="TOKEN",
              help="Token callers and workers must present [default: $GPUMESH_TOKEN, else a new one].")
@click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where jobs, tasks and results are stored [default: ~/.gpumesh].")
@click.option("--no-self-worker", is_flag=True, help="Do not join this machine as a worker.")
@click.option("--slots", type=click.IntRange(1, 1024), default=1, show_default=True,
              help="Tasks the self-worker runs at once.")
def serve(host, port, token, data_dir, no_self_worker, slots):
    """Run a coordinator: the job store and HTTP API of the mesh."""
    from ..coordinator.server import BindError, Server, bind

    host = host or os.environ.get("GPUMESH_HOST") or "127.0.0.1"
    token = token or os.environ.get("GPUMESH_TOKEN")
    generated = token is None
    if generated:
        token = config.generate_token()
    elif not token.strip():
        fail("the token is empty; generate one with: python -c \"import secrets; print(secrets.token_urlsafe(32))\"")
    data_dir = (data_dir or config.home_dir()).expanduser()
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        probe = data_dir / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        fail(f"cannot write to the data directory {data_dir} ({e.strerror or e}); "
             f"pass --data-dir with a writable directory")
    try:
        sock = bind(host, port)
    except BindError as e:
        fail(str(e))
    local_url = f"http://127.0.0.1:{port}" if host in ("0.0.0.0", "::", "127.0.0.1") else f"http://{host}:{port}"
    try:
        path = config.save(local_url, token)
        click.echo(f"[gpumesh] config saved to {path}")
    except OSError as e:
        click.echo(f"[gpumesh] warning: could not save the config ({e}); callers need --url/--token", err=True)

    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(_MeshLogFormat())
    mesh_log = logging.getLogger("gpumesh.coordinator")
    mesh_log.addHandler(handler)
    mesh_log.setLevel(logging.INFO)
    mesh_log.propagate = False

    try:
        server = Server(sock, data_dir, token)
    except Exception as e:  # noqa: BLE001 - e.g. a corrupt or locked database
        fail(f"cannot open the job store in {data_dir}: {e}")
    for line in banner(host, port, token, show_token=generated):
        click.echo(line)
    worker: list[subprocess.Popen] = []
    threading.Thread(target=_after_start, args=(server, local_url, token, not no_self_worker, slots, worker),
                     daemon=True).start()
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl+C it handled
        pass
    finally:
        for proc in worker:
            _stop_child(proc)
    click.echo("[gpumesh] coordinator stopped")


def _after_start(server, url: str, token: str, self_worker: bool, slots: int, out: list) -> None:
    server.ready.wait()
    import httpx
    try:
        httpx.get(f"{url}/v1/health", timeout=5).raise_for_status()
        click.echo("[OK] Self-check: server is up (tested on 127.0.0.1 only)")
    except httpx.HTTPError as e:
        click.echo(f"[!!] Self-check failed: {e}", err=True)
    if not self_worker:
        return
    env = dict(os.environ, GPUMESH_TOKEN=token)
    proc = subprocess.Popen([sys.executable, "-m", "gpumesh", "join", url, "--slots", str(slots)],
                            env=env, stdin=subprocess.DEVNULL)
    out.append(proc)
    click.echo("[OK] Self-worker started — this machine's CPU/GPU is part of the pool")
    click.echo("   (disable with --no-self-worker)")


def _stop_child(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
