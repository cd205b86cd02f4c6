"""``gpumesh radar``: the coordinators and workers on the local network (DNS-SD over mDNS).

Three ways to show them, like the usual browse tools:

* a terminal: a live table until Ctrl+C;
* a pipe or file (``gpumesh radar | grep worker``): like ``avahi-browse`` and ``dns-sd -B``,
  it runs until Ctrl+C (or ``--timeout``) and prints one line per service as it appears
  (``+``) and goes away (``-``), tab-separated;
* ``--once``/``--json``: listen ``--timeout`` seconds and print a snapshot.
"""

from __future__ import annotations

import json
import sys
import time

import click

from ..limits import DISCOVERY_BROWSE_S
from .common import fail

#: Seconds one poll of the browser waits for news (a new line or table at most this late).
POLL_S = 0.25


def _columns(e: dict) -> tuple[str, str, str, str, str, str]:
    """(host, role, device, score, address, version) of a discovered service."""
    device = " ".join(x for x in (e["device"], e["device_name"]) if x)
    address = e["url"] or e["address"]
    if e["role"] == "worker" and e["coordinator"]:
        address = f"{e['addresses'][0] if e['addresses'] else '?'} -> {e['coordinator']}"
    return (e["host"] or "?", e["role"], device or "-", e["score"] or "-", address,
            e["version"] or "-")


def radar_table(entries: list[dict], elapsed: float | None = None):
    """A rich Table: host, role, device, score, address (and what a worker joined)."""
    from rich.table import Table
    title = "gpumesh radar" + (f" ({elapsed:.0f}s, {len(entries)} found)" if elapsed is not None else "")
    table = Table(title=title, title_justify="left")
    # Narrower than the table wants (a small terminal; a pipe or file is drawn 80 columns
    # wide unless the caller sizes the console), rich shrinks the columns and cuts what does
    # not fit with "…". The address, the value a user copies into `gpumesh join`, keeps its
    # whole width on one line (no_wrap: the other columns give way first), and where even
    # that cannot fit it folds onto the next line instead of losing characters.
    for col in ("host", "role", "device", "score", "address", "version"):
        address = col == "address"
        table.add_column(col, no_wrap=address, overflow="fold" if address else "ellipsis")
    for e in entries:
        table.add_row(*_columns(e))
    if not entries:
        table.caption = "nothing found yet (loopback-only coordinators are never advertised)"
    return table


def radar_line(change: str, e: dict) -> str:
    """One line of the piped form: ``+`` (appeared) or ``-`` (gone), then role, host,
    address, device, score and version, separated by tabs."""
    host, role, device, score, address, version = _columns(e)
    return "\t".join((change, role, host, address, device, score, version))


def _stream(browser, timeout: float | None) -> None:
    """Print a line per service as it appears or goes, until Ctrl+C or ``timeout`` s."""
    start = time.monotonic()
    shown: dict[str, dict] = {}
    reader_gone = _reader_watch()
    while timeout is None or time.monotonic() - start < timeout:
        browser.poll(POLL_S)
        if reader_gone():  # `| head -1` has its line: stop now, not at the next service
            _quiet_stdout()
            return
        now = {e["name"]: e for e in browser.snapshot()}
        lines = [radar_line("+", e) for name, e in now.items() if name not in shown]
        lines += [radar_line("-", e) for name, e in shown.items() if name not in now]
        if lines:
            sys.stdout.write("".join(f"{ln}\n" for ln in lines))
            sys.stdout.flush()  # a pipe is block-buffered: each line must leave now
        shown = now


@click.command()
@click.option("--timeout", type=click.FloatRange(0.5, 86400), default=None, metavar="S",
              help=f"Stop after S seconds [default: {DISCOVERY_BROWSE_S:g} with --once/--json, "
                   "else run until Ctrl+C].")
@click.option("--once", is_flag=True,
              help="Listen for --timeout seconds, print the table once and exit [default: a live "
                   "table on a terminal, else a line per service as it appears].")
@click.option("--json", "as_json", is_flag=True,
              help="Print what was found as JSON (implies --once) [default: a table].")
def radar(timeout, once, as_json):
    """Discover gpumesh coordinators and workers on the local network (mDNS, no setup).

    Uses standard DNS-SD service _gpumesh._tcp, so avahi-browse and dns-sd see the mesh
    too. Nothing secret is advertised. Off when GPUMESH_DISCOVERY=0. Piped, it runs
    until Ctrl+C and prints one tab-separated line per service as it appears (+) or
    goes (-): role, host, address, device, score, version.
    """
    from .. import discovery
    from rich.console import Console
    console = Console()
    snapshot = once or as_json
    if timeout is None and snapshot:
        timeout = DISCOVERY_BROWSE_S
    try:
        if snapshot:
            found = discovery.browse(timeout)
            if as_json:
                click.echo(json.dumps(found, indent=2))
            else:
                table = radar_table(found)
                if not console.is_terminal:  # a pipe or file has no width: draw it whole
                    wide = console.options.update_width(10_000)
                    console = Console(width=max(console.width, console.measure(table, options=wide).maximum))
                console.print(table)
            return
        browser = discovery.Browser()
        try:
            if console.is_terminal:
                _live(console, browser, timeout)
            else:
                click.echo("[gpumesh] browsing _gpumesh._tcp on the local network "
                           "(Ctrl+C to stop)", err=True)
                _stream(browser, timeout)
        except KeyboardInterrupt:
            pass
        except BrokenPipeError:  # `gpumesh radar | head -1`: the reader is done
            _quiet_stdout()
            return
        finally:
            browser.close()
    except discovery.DiscoveryUnavailable as e:
        fail(str(e))
    except OSError as e:
        fail(f"cannot listen for mDNS on this network ({e}); is a network interface up?")
    sys.stdout.flush()


def _live(console, browser, timeout: float | None) -> None:
    from rich.live import Live
    start = time.monotonic()
    with Live(radar_table([], 0), console=console, refresh_per_second=4) as view:
        while timeout is None or time.monotonic() - start < timeout:
            browser.poll(POLL_S)
            view.update(radar_table(browser.snapshot(), time.monotonic() - start))


def _reader_watch():
    """A check that is true once nobody reads our stdout any more (the pipe's reader
    exited: poll reports an error on the write end). Always false where it cannot tell."""
    import select
    try:
        p = select.poll()
        p.register(sys.stdout.fileno(), select.POLLERR | select.POLLHUP)
    except (AttributeError, OSError, ValueError):  # no poll(), or stdout has no descriptor
        return lambda: False
    return lambda: any(ev & (select.POLLERR | select.POLLHUP) for _, ev in p.poll(0))


def _quiet_stdout() -> None:
    """After a broken pipe: point stdout at /dev/null so the interpreter's final flush
    does not print a second error."""
    import os
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except OSError:
        pass
