"""``gpumesh token add | list | revoke``: one token per person, with a role."""

from __future__ import annotations

import json
import time

import click

from .common import endpoint_options, one_line_errors, resolve_endpoint

ROLES = ("admin", "submit", "worker", "view")


def _person(ctx, param, value):
    """NAME checked here, as the coordinator checks it: a bad one is a usage error (2)."""
    from ..coordinator.people import check_name
    try:
        return check_name(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def _mesh(url, token, fingerprint):
    from ..client.mesh import GPUMesh
    ep = resolve_endpoint(url, token, fingerprint)
    return GPUMesh(ep.url, token=ep.token, fingerprint=ep.fingerprint)


@click.group()
def token():
    """People's tokens: who may use this coordinator, and how (needs the main token or
    an admin's)."""


@token.command("add")
@click.argument("name", callback=_person)
@click.option("--role", type=click.Choice(ROLES), default="submit", show_default=True,
              help="admin: everything; submit: run jobs and manage their own; "
                   "worker: join as a worker only; view: look, never run or read results.")
@click.option("--max-running", type=click.IntRange(1, 1_000_000), default=None,
              help="Most tasks of this person's that may run at once [default: no cap].")
@endpoint_options
@click.option("--json", "as_json", is_flag=True, help="Print JSON [default: text].")
@one_line_errors
def add(name, role, max_running, url, token, fingerprint, as_json):
    """Give NAME their own token. It is printed once; the coordinator keeps only a hash."""
    row = _mesh(url, token, fingerprint).add_token(name, role, max_running)
    if as_json:
        click.echo(json.dumps(row))
        return
    cap = f", at most {row['max_running']} running" if row.get("max_running") else ""
    click.echo(f"[OK] token for {row['name']} ({row['role']}{cap}):")
    click.echo(f"   {row['token']}")
    click.echo("   Shown once: hand it to them now (the coordinator keeps only its SHA-256).")


@token.command("list")
@endpoint_options
@click.option("--json", "as_json", is_flag=True, help="Print JSON [default: text].")
@one_line_errors
def list_(url, token, fingerprint, as_json):
    """Everyone with a token (names, roles, caps; never the tokens)."""
    rows = _mesh(url, token, fingerprint).tokens()
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        click.echo("no tokens added (only the main token and any worker token)")
        return
    for r in rows:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(r["created"]))
        cap = f"max-running={r['max_running']}" if r.get("max_running") else "no cap"
        click.echo(f"{r['name']:<20} {r['role']:<7} {cap:<18} added {when}")


@token.command("revoke")
@click.argument("name")
@endpoint_options
@one_line_errors
def revoke(name, url, token, fingerprint):
    """Revoke NAME's token: refused from the next request on (no restart)."""
    revoked = _mesh(url, token, fingerprint).revoke_token(name)
    click.echo(f"[OK] revoked {revoked}'s token")
