"""``gpumesh jobs | status JOB | cancel JOB``: look at and control jobs."""

from __future__ import annotations

import json
import time

import click

from .common import endpoint_options, one_line_errors, resolve_endpoint
from .views import color_enabled, counts_line, task_lines


def _mesh(url, token):
    from ..client.mesh import GPUMesh
    ep = resolve_endpoint(url, token)
    return GPUMesh(ep.url, token=ep.token)


@click.command()
@endpoint_options
@click.option("--limit", type=click.IntRange(1, 1000), default=20, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print JSON [default: text].")
@one_line_errors
def jobs(url, token, limit, as_json):
    """Recent jobs, newest first."""
    found = _mesh(url, token).jobs(limit=limit)
    if as_json:
        click.echo(json.dumps(found, indent=2))
        return
    if not found:
        click.echo("no jobs yet")
        return
    for j in found:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(j["created"]))
        click.echo(f"{j['id']}  {when}  {j['state']:<9}  {j['n_tasks']:>6} tasks  "
                   f"{counts_line(j['counts'])}  {j.get('owner', '-')}  {j['name']}")


@click.command()
@click.argument("job_id")
@endpoint_options
@click.option("--json", "as_json", is_flag=True, help="Print JSON [default: text].")
@one_line_errors
def status(job_id, url, token, as_json):
    """State of one job and each task with its result. Exit code 1 if the job failed or
    is unknown."""
    from ..client.jobview import jsonable
    view = _mesh(url, token).status(job_id)
    if as_json:
        click.echo(json.dumps(jsonable(view), indent=2, ensure_ascii=False))
    else:
        click.echo(f"Job: {view['name']} ({view['id']})")
        click.echo(f"  Owner: {view.get('owner', '-')}")
        click.echo(f"  Status: {view['state']}")
        click.echo(f"  Counts: {counts_line(view['counts'])}")
        if view.get("released"):
            click.echo("  Results: released (collected by the caller, or let go)")
        elif view.get("results_hidden"):
            click.echo(f"  Results: {view.get('owner')}'s (only they or an admin may read them)")
        for line in task_lines(view, color_enabled()):
            click.echo(line)
    if view["counts"].get("failed"):
        raise SystemExit(1)


@click.command()
@click.argument("job_id")
@endpoint_options
@click.option("--json", "as_json", is_flag=True, help="Print JSON [default: text].")
@one_line_errors
def cancel(job_id, url, token, as_json):
    """Cancel a job: queued tasks are dropped, running ones killed. Exit code 1 if the
    job is unknown."""
    answer = _mesh(url, token).cancel_job(job_id)
    n, state = answer["cancelled"], answer.get("state")
    if as_json:
        click.echo(json.dumps({"job_id": job_id, "cancelled": n, "state": state}))
        return
    if n == 0 and state in ("finished", "cancelled"):
        what = "finished" if state == "finished" else "been cancelled"
        click.echo(f"[OK] job {job_id} had already {what}: nothing to cancel")
        return
    click.echo(f"[OK] cancelled {n} task(s) of job {job_id}")


@click.command()
@click.argument("job_id")
@click.option("--task", "task_id", default=None, help="Only this task's output [default: every task].")
@endpoint_options
@click.option("--json", "as_json", is_flag=True, help="Print JSON [default: text].")
@one_line_errors
def logs(job_id, task_id, url, token, as_json):
    """What each task of a job printed to stdout and stderr."""
    tasks = _mesh(url, token).logs(job_id, task_id)
    if as_json:
        click.echo(json.dumps(tasks, indent=2))
        return
    for t in tasks:
        click.echo(f"=== task {t['id']} (#{t['index']}, {t['state']})")
        if t["stdout"]:
            click.echo(t["stdout"], nl=not t["stdout"].endswith("\n"))
        if t["stderr"]:
            click.echo("--- stderr")
            click.echo(t["stderr"], nl=not t["stderr"].endswith("\n"))
