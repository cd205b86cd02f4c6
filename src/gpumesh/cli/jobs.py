"""``gpumesh jobs | status JOB | cancel JOB``: look at and control jobs."""

from __future__ import annotations

import json
import time

import click

from .common import (endpoint_options, job_id_argument, one_line_errors, resolve_endpoint,
                     task_id_option)
from .views import color_enabled, counts_dict, counts_line, task_lines, where_ran


def _mesh(url, token):
    from ..client.mesh import GPUMesh
    ep = resolve_endpoint(url, token)
    return GPUMesh(ep.url, token=ep.token)


@click.command()
@endpoint_options
@click.option("--limit", type=click.IntRange(1, 1000), default=20, show_default=True,
              help="How many of the most recent jobs to list.")
@click.option("--before", metavar="JOB_ID",
              help="Only jobs older than this one: the next page after a listing whose last "
                   "job it is [default: from the newest].")
@click.option("--owner", metavar="NAME", help="Only this person's jobs [default: everyone's].")
@click.option("--state", type=click.Choice(["active", "finished", "cancelled"]),
              help="Only jobs in this state [default: any].")
@click.option("--json", "as_json", is_flag=True, help="Print JSON [default: text].")
@one_line_errors
def jobs(url, token, limit, before, owner, state, as_json):
    """Recent jobs, newest first."""
    found = _mesh(url, token).jobs(limit=limit, before=before, owner=owner, state=state)
    if as_json:
        click.echo(json.dumps(found, indent=2))
        return
    if not found:
        click.echo("no older jobs" if before else "no jobs" if owner or state else "no jobs yet")
        return
    rows = [(j["id"], time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(j["created"])),
             j["state"], plural(j["n_tasks"], "task"), counts_line(j["counts"]), j.get("owner") or "-", j["name"])
            for j in found]
    header = ("JOB", "CREATED", "STATE", "TASKS", "COUNTS", "OWNER", "NAME")
    widths = [max(len(r[k]) for r in [header, *rows]) for k in range(len(header) - 1)]
    for r in [header, *rows]:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])
    if len(found) == limit:  # (a full page: there may be older ones)
        same = "".join(f" --{k} {v}" for k, v in (("limit", limit if limit != 20 else None),
                                                   ("owner", owner), ("state", state)) if v)
        click.echo(f"older: gpumesh jobs --before {found[-1]['id']}{same}", err=True)


def plural(n: int, noun: str) -> str:
    """``1 task``, ``2 tasks``, ``0 tasks``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


@click.command()
@job_id_argument
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
        click.echo(f"  Counts: {counts_dict(view['counts'])}")
        if view.get("released"):
            click.echo("  Results: released (collected by the caller, or let go)")
        elif view.get("results_hidden"):
            click.echo(f"  Results: {view.get('owner')}'s (only they or an admin may read them)")
        if view.get("waiting"):  # every worker that could run it is closed by its owner
            click.echo(f"  Waiting: {view['waiting'].removeprefix('waiting: ')}")
        if view.get("preempted"):
            click.echo(f"  Preempted: {view['preempted']} (handed back by a worker's owner; run again)")
        for line in task_lines(view, color_enabled()):
            click.echo(line)
    if view["counts"].get("failed"):
        raise SystemExit(1)


@click.command()
@job_id_argument
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
@job_id_argument
@task_id_option
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
        attempts = t.get("attempts") or [t]
        for a in attempts:
            if len(attempts) > 1:  # retried or handed back: each attempt's output apart
                click.echo(f"--- attempt {a['attempt']} on {where_ran(a)}: {a.get('ended') or '?'}")
            if a["stdout"]:
                click.echo(a["stdout"], nl=not a["stdout"].endswith("\n"))
            if a["stderr"]:
                click.echo("--- stderr")
                click.echo(a["stderr"], nl=not a["stderr"].endswith("\n"))
