"""``gpumesh submit SCRIPT --payloads FILE.json [--wait]`` and ``gpumesh retry JOB``."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import click

from .common import endpoint_options, fail, job_id_argument, one_line_errors, resolve_endpoint
from .views import color_enabled, counts_dict, task_lines


def _mesh(url, token, fingerprint):
    from ..client.mesh import GPUMesh
    ep = resolve_endpoint(url, token, fingerprint)
    return GPUMesh(ep.url, token=ep.token, fingerprint=ep.fingerprint, output=False)


@click.command()
@click.argument("script", type=click.Path(exists=True, dir_okay=False))
@click.option("--payloads", "payloads_file", required=True, type=click.Path(exists=True, dir_okay=False),
              help="JSON file: an array with one payload per task, or JSON Lines: one payload "
                   "per line (a file of one line is one task, unless that line is an array: "
                   "then each element is one; a value over several lines is refused).")
@click.option("--name", default=None, help="Job name [default: the SCRIPT path as given].")
@click.option("--timeout", type=click.FloatRange(min=0.001), default=None,
              help="Seconds each task may run before it is killed [default: no limit].")
@click.option("--wait", is_flag=True,
              help="Wait for the job with a progress bar, then print each task's result; exit "
                   "code 1 if any task did not finish as done [default: return at once].")
@endpoint_options
@click.option("--json", "as_json", is_flag=True, help="Print JSON [default: text].")
@one_line_errors
def submit(script, payloads_file, name, timeout, wait, url, token, fingerprint, as_json):
    """Run SCRIPT once per payload on the mesh (a script job).

    Each task runs `python SCRIPT` on a worker with its payload as JSON on stdin; the
    task's result is the last line of its stdout that parses as JSON (print other
    lines before it freely). A non-zero exit status, or no JSON line, fails the task
    with the end of its stderr. Script jobs involve no pickle, so `serve --safe-mode`
    accepts them.
    """
    from ..client import scripts
    payloads = scripts.load_payloads(payloads_file)
    mesh = _mesh(url, token, fingerprint)
    job_id = mesh.submit(name=name or script, script=script, payloads=payloads, timeout=timeout)
    if not wait:
        if as_json:
            click.echo(json.dumps({"job_id": job_id, "n_tasks": len(payloads)}))
        else:
            click.echo(f"[OK] Submitted job {job_id}")
            click.echo(f"   follow it with: gpumesh status {job_id}")
        return
    if not as_json:
        click.echo(f"[OK] Submitted job {job_id}")
        click.echo(f"Job: {name or script} ({job_id})")
        click.echo("")
    _wait_or_say(mesh, job_id, len(payloads), quiet=as_json)
    view = mesh.status(job_id)  # each task with its result
    ok = view["counts"].get("done", 0) == view["n_tasks"]
    if as_json:
        for t in view.get("tasks", []):
            t.setdefault("result", None)
        click.echo(json.dumps(view, indent=2, ensure_ascii=False))
    else:
        click.echo("")
        click.echo(f"  Status: {view['state']}")
        click.echo(f"  Counts: {counts_dict(view['counts'])}")
        click.echo("")
        for line in task_lines(view, color_enabled()):
            click.echo(line)
    if not ok:
        sys.exit(1)


def _wait_or_say(mesh, job_id: str, total: int, quiet: bool) -> None:
    """:func:`_wait`; if Ctrl+C, SIGTERM or SIGHUP ends the wait, say on stderr that the
    job goes on (a script job is nobody's call: leaving does not cancel it) and how to
    follow or stop it, then end as that signal would (Ctrl+C: exit code 130)."""
    from ..client import stopsignals
    said = (f"interrupted: job {job_id} goes on running on the mesh (leaving does not cancel "
            f"a script job); follow it with: gpumesh status {job_id}; stop it with: "
            f"gpumesh cancel {job_id}")
    # (a stop signal ends the process from its handler, after the clean-ups: this one)
    unregister = stopsignals.at_stop(lambda: click.echo("\n" + said, err=True))
    try:
        _wait(mesh, job_id, total, quiet)
    except KeyboardInterrupt:
        click.echo("\n" + said, err=True)
        sys.exit(130)
    finally:
        unregister()


def _wait(mesh, job_id: str, total: int, quiet: bool) -> None:
    """Wait for every task; a live bar on a terminal, then the final bar line."""
    from ..client import scripts
    from ..client.progress import Progress, bar_text
    started = time.monotonic()
    done: list[Any] = [0, {}]  # tasks final, counts
    with Progress(total, "tasks", enabled=None if not quiet else False, delay=0) as bar:
        def on_progress(n_final: int, n_tasks: int, counts: dict) -> None:
            done[:] = n_final, counts
            bar.update(n_final, n_tasks, failed=counts.get("failed", 0),
                       cancelled=counts.get("cancelled", 0))
        scripts.wait(mesh, job_id, on_progress, as_json=True)  # (a script job's: JSON)
    if not quiet:
        click.echo("  " + bar_text(done[0], total, time.monotonic() - started,
                                   failed=done[1].get("failed", 0),
                                   cancelled=done[1].get("cancelled", 0)))


@click.command()
@job_id_argument
@endpoint_options
@click.option("--json", "as_json", is_flag=True, help="Print JSON [default: text].")
@one_line_errors
def retry(job_id, url, token, fingerprint, as_json):
    """Re-queue the failed tasks of a job (they run again from a fresh attempt).

    Exit code 1 if the job is unknown or its arguments were already released.
    """
    n = _mesh(url, token, fingerprint).retry(job_id)
    if as_json:
        click.echo(json.dumps({"job_id": job_id, "retried": n}))
    elif n:
        click.echo(f"[OK] re-queued {n} failed task(s) of job {job_id}")
    else:
        click.echo(f"job {job_id} has no failed task; nothing to retry")


__all__ = ["submit", "retry", "fail"]
