"""``gpumesh radar``: the coordinators and workers on the local network (DNS-SD over mDNS)."""

from __future__ import annotations

import json
import sys
import time

import click

from .common import fail

ONCE_TIMEOUT_S = 3.0


def radar_table(entries: list[dict], elapsed: float | None = None):
    """A rich Table: host, role, device, score, address (and what a worker joined)."""
    from rich.table import Table
    title = "gpumesh radar" + (f" ({elapsed:.0f}s, {len(entries)} found)" if elapsed is not None else "")
    table = Table(title=title, title_justify="left")
    for col in ("host", "role", "device", "score", "address", "version"):
        table.add_column(col)
    for e in entries:
        device = " ".join(x for x in (e["device"], e["device_name"]) if x)
        address = e["url"] or e["address"]
        if e["role"] == "worker" and e["coordinator"]:
            address = f"{e['addresses'][0] if e['addresses'] else '?'} -> {e['coordinator']}"
        table.add_row(e["host"] or "?", e["role"], device or "-", e["score"] or "-", address,
                      e["version"] or "-")
    if not entries:
        table.caption = "nothing found yet (loopback-only coordinators are never advertised)"
    return table


@click.command()
@click.option("--timeout", type=click.FloatRange(0.5, 86400), default=None, metavar="S",
              help=f"Stop after S seconds [default: {ONCE_TIMEOUT_S:g} with --once/--json, "
                   "else run until Ctrl+C].")
@click.option("--once", is_flag=True,
              help="Listen for --timeout seconds, print the table once and exit [default: a live table].")
@click.option("--json", "as_json", is_flag=True,
              help="Print what was found as JSON (implies --once) [default: a table].")
def radar(timeout, once, as_json):
    """Discover gpumesh coordinators and workers on the local network (mDNS, no setup).

    Uses standard DNS-SD service _gpumesh._tcp, so avahi-browse and dns-sd see the mesh
    too. Nothing secret is advertised. Off when GPUMESH_DISCOVERY=0.
    """
    from .. import discovery
    from rich.console import Console
    console = Console()
    live = not (once or as_json) and console.is_terminal
    if timeout is None and not live:
        timeout = ONCE_TIMEOUT_S
    try:
        if not live:
            found = discovery.browse(timeout)
            if as_json:
                click.echo(json.dumps(found, indent=2))
            else:
                console.print(radar_table(found))
            return
        from rich.live import Live
        start = time.monotonic()
        browser = discovery.Browser()
        try:
            with Live(radar_table([], 0), console=console, refresh_per_second=4) as view:
                while timeout is None or time.monotonic() - start < timeout:
                    browser.poll(0.25)
                    view.update(radar_table(browser.snapshot(), time.monotonic() - start))
        except KeyboardInterrupt:
            pass
        finally:
            browser.close()
    except discovery.DiscoveryUnavailable as e:
        fail(str(e))
    except OSError as e:
        fail(f"cannot listen for mDNS on this network ({e}); is a network interface up?")
    sys.stdout.flush()
