"""``gpumesh workers`` and ``gpumesh devices``: the pool as tables."""

from __future__ import annotations

import json

import click

from ..availability import labels
from ..hardware import python_minor
from .common import endpoint_options, one_line_errors, resolve_endpoint

RULE = "  " + "-" * 54


def slots_text(w: dict) -> str:
    """``slots: 1 GPU, 2 CPU`` (``(1 busy)`` while an alive worker runs tasks), from the
    slots the worker registered (``slot_list``: CUDA and MPS slots are GPU slots)."""
    kinds = [str(s.get("kind", "cpu")) for s in w.get("slot_list") or ()]
    if not kinds:  # (a description without its list: that many CPU slots)
        kinds = ["cpu"] * int(w.get("slots") or 0)
    gpu = sum(k != "cpu" for k in kinds)
    parts = ([f"{gpu} GPU"] if gpu else []) + ([f"{len(kinds) - gpu} CPU"] if len(kinds) > gpu else [])
    busy = len(w.get("busy_slots") or ()) if w.get("alive") else 0
    return "slots: " + (", ".join(parts) or "none") + (f" ({busy} busy)" if busy else "")


def format_workers(workers: list[dict]) -> str:
    """The spec's table: kind, short id, host, score, state; one line per worker, then
    what the owner's rules close (``[paused: owner]``, ``[hot 83C]``...), its slots
    (:func:`slots_text`), ``installs`` for a worker joined with --allow-installs and, in a
    pool of several Python minor versions, each worker's (``python 3.10``)."""
    if not workers:
        return "\n  WORKERS\n" + RULE + "\n  (no workers connected: run `gpumesh join URL --token ...`)"
    lines = ["", "  WORKERS", RULE]
    # A pool of several Python minor versions names each worker's: code shipped by value
    # runs only on the caller's (README, "Python"), so it says where such calls can go.
    mixed = len({python_minor(w.get("python")) for w in workers if w.get("alive")}) > 1
    for w in sorted(workers, key=lambda w: (not w.get("alive"), -float(w.get("score") or 0))):
        kind = str(w.get("device") or "CPU")[:4]
        state = "alive" if w.get("alive") else "dead"
        score = float(w.get("score") or 0)
        shown = f"{score:<9.3f}" if score or w.get("scores") else "pending  "  # measured after joining
        owner = "".join(f" [{label}]" for label in labels(w)) if w.get("alive") else ""
        lines.append(f"  {kind:<4} {str(w.get('id', ''))[:8]:<10}  {str(w.get('hostname', '?'))[:16]:<16}  "
                     f"score={shown} [{state}]{owner}  {slots_text(w)}"
                     + ("  installs" if w.get("allow_installs") else "")
                     + (f"  python {python_minor(w.get('python')) or '?'}" if mixed else ""))
    return "\n".join(lines)


def format_devices(devices: list[dict]) -> str:
    """One line per device of the alive workers (strongest first): kind, device, model,
    memory, score, host and worker, how many of its slots are busy."""
    rule = "  " + "-" * 96
    if not devices:
        return "\n  DEVICES\n" + rule + "\n  (no alive worker: run `gpumesh join URL --token ...`)"
    lines = ["", "  DEVICES", rule]
    for d in devices:
        kind = "CPU" if d["kind"] == "cpu" else "GPU"
        if d["kind"] == "cpu":
            memory = f"{d.get('cores', '?')} cores, {d.get('memory_total_mb', 0)} MiB RAM"
        elif d.get("memory_free_mb") is not None:
            memory = f"{d['memory_free_mb']}/{d.get('memory_total_mb', 0)} MiB free"
        else:
            memory = f"{d.get('memory_total_mb', 0)} MiB"
        score = "pending" if d.get("score") is None else f"{float(d['score']):.3f}"
        lines.append(f"  {kind:<4} {d['device']:<7} {str(d.get('name', '?'))[:30]:<30} {memory:<26} "
                     f"score={score:<11} {str(d.get('hostname', '?'))[:14]} ({str(d.get('worker', ''))[:8]})  "
                     f"[{d.get('busy', 0)}/{d.get('slots', 1)} busy]"
                     + (f" [{d['state']['label']}]" if d.get("state") else ""))
    return "\n".join(lines)


@click.command()
@endpoint_options
@click.option("--json", "as_json", is_flag=True, help="Print the raw list as JSON [default: a table].")
@one_line_errors
def workers(url, token, fingerprint, as_json):
    """List the workers of the mesh."""
    from ..client.mesh import GPUMesh
    ep = resolve_endpoint(url, token, fingerprint)
    found = GPUMesh(ep.url, token=ep.token, fingerprint=ep.fingerprint).workers()
    click.echo(json.dumps(found, indent=2) if as_json else format_workers(found))


@click.command()
@endpoint_options
@click.option("--json", "as_json", is_flag=True, help="Print the raw list as JSON [default: a table].")
@one_line_errors
def devices(url, token, fingerprint, as_json):
    """List every device of the pool: each GPU and each CPU of the alive workers."""
    from ..client.mesh import GPUMesh
    ep = resolve_endpoint(url, token, fingerprint)
    found = GPUMesh(ep.url, token=ep.token, fingerprint=ep.fingerprint).devices()
    click.echo(json.dumps(found, indent=2) if as_json else format_devices(found))
