"""``gpumesh workers``: the pool as a table."""

from __future__ import annotations

import json

import click

from .common import endpoint_options, one_line_errors, resolve_endpoint

RULE = "  " + "-" * 54


def format_workers(workers: list[dict]) -> str:
    """The spec's table: kind, short id, host, score, state; one line per worker."""
    if not workers:
        return "\n  WORKERS\n" + RULE + "\n  (no workers connected: run `gpumesh join URL --token ...`)"
    lines = ["", "  WORKERS", RULE]
    for w in sorted(workers, key=lambda w: (not w.get("alive"), -float(w.get("score") or 0))):
        kind = str(w.get("device") or "CPU")[:4]
        state = "alive" if w.get("alive") else "dead"
        score = float(w.get("score") or 0)
        lines.append(f"  {kind:<4} {str(w.get('id', ''))[:8]:<10}  {str(w.get('hostname', '?'))[:16]:<16}  "
                     f"score={score:<9.3f} [{state}]")
    return "\n".join(lines)


@click.command()
@endpoint_options
@click.option("--json", "as_json", is_flag=True, help="Print the raw list as JSON.")
@one_line_errors
def workers(url, token, as_json):
    """List the workers of the mesh."""
    from ..client.mesh import GPUMesh
    ep = resolve_endpoint(url, token)
    found = GPUMesh(ep.url, token=ep.token).workers()
    click.echo(json.dumps(found, indent=2) if as_json else format_workers(found))
