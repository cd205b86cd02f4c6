"""``gpumesh jobs | status JOB | cancel JOB``: look at and control jobs."""

from __future__ import annotations

import json
import time

import click

from .common import (before_option, endpoint_options, fail, job_id_argument, one_line_errors,
                     resolve_endpoint, task_id_option)
from .views import color_enabled, counts_dict, counts_line, task_lines, where_ran


def _mesh(url, token, fingerprint):
    from ..client.mesh import GPUMesh
    ep = resolve_endpoint(url, token, fingerprint)
    return GPUMesh(ep.url, token=ep.token, fingerprint=ep.fingerprint)


@click.command()
@endpoint_options
@click.option("--limit", type=click.IntRange(1, 1000), default=20, show_default=True,
              help="How many of the most recent jobs to list.")
@before_option
@click.option("--owner", metavar="NAME", help="Only this person's jobs [default: everyone's].")
@click.option("--state", type=click.Choice(["active", "finished", "cancelled"]),
              help="Only jobs in this state [default: any].")
@click.option("--json", "as_json", is_flag=True, help="Print JSON [default: text].")
@one_line_errors
def jobs(url, token, fingerprint, limit, before, owner, state, as_json):
    """Recent jobs, newest first."""
    from ..errors import RequestRejected
    try:
        found = _mesh(url, token, fingerprint).jobs(limit=limit, before=before, owner=owner, state=state)
    except RequestRejected as e:
        if before is None or getattr(e, "status", None) != 400 or "'before'" not in str(e):
            raise
        # (the API's words name its query parameter; the user gave a flag)
        fail(f"--before {before}: no such job on this coordinator (it may have been purged, "
             f"or never existed): start from the newest with `gpumesh jobs`")
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


#: Above this many tasks ``status`` lists only the failed ones (at most
#: :data:`SUMMARY_FAILED_SHOWN`) and says how to see the rest: a 20,000-task sweep's
#: every task is a megabyte of text.
SUMMARY_ABOVE_TASKS = 100
SUMMARY_FAILED_SHOWN = 20
#: A task's states, as ``status --state`` takes them (``pending``: queued; ``leased``: running).
TASK_STATES = ("pending", "leased", "done", "failed", "cancelled")


@click.command()
@job_id_argument
@endpoint_options
@click.option("--state", "states", multiple=True, type=click.Choice(TASK_STATES),
              help="Only the tasks in this state; repeat for more (e.g. --state failed "
                   "--state cancelled). With --json too [default: every state].")
@click.option("--all", "show_all", is_flag=True,
              help=f"Every task, however many [default: above {SUMMARY_ABOVE_TASKS} tasks, "
                   f"only the first {SUMMARY_FAILED_SHOWN} failed ones, and how to see the rest].")
@click.option("--json", "as_json", is_flag=True, help="Print JSON [default: text].")
@one_line_errors
def status(job_id, url, token, fingerprint, states, show_all, as_json):
    """State of one job and each task with its result (for a job of more than one task,
    item=N: its index in the .map or payload list). Exit code 1 if the job failed or is
    unknown."""
    from ..client.jobview import jsonable
    if show_all and states:
        fail("--all lists every task and --state only some: drop one", code=2)
    view = _mesh(url, token, fingerprint).status(job_id)
    n_tasks = view.get("n_tasks", len(view.get("tasks", [])))
    footer: list[str] = []
    if states:
        view["tasks"] = [t for t in view.get("tasks", []) if t["state"] in states]
    elif not as_json and not show_all and n_tasks > SUMMARY_ABOVE_TASKS:
        view["tasks"], footer = _summary(view, n_tasks)
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
        if states and not view["tasks"]:
            click.echo(f"  (no task is {' or '.join(states)})")
        for line in task_lines(view, color_enabled(), items=n_tasks > 1):
            click.echo(line)
        for line in footer:
            click.echo(line)
    if view["counts"].get("failed"):
        raise SystemExit(1)


def _summary(view: dict, n_tasks: int) -> tuple[list[dict], list[str]]:
    """The tasks a big job's ``status`` lists by default (its first failed ones), and the
    lines that say what was left out and how to see it."""
    failed = [t for t in view.get("tasks", []) if t["state"] == "failed"]
    shown = failed[:SUMMARY_FAILED_SHOWN]
    job = view.get("id", "JOB_ID")
    if not failed:
        what = f"  {n_tasks} tasks, none failed: not listed"
    elif len(shown) < len(failed):
        what = (f"  listed: the first {len(shown)} of the {len(failed)} failed tasks "
                f"(all of them: gpumesh status {job} --state failed)")
    else:
        what = f"  listed: the {len(failed)} failed of {n_tasks} tasks"
    return shown, ["", f"{what}; every task: gpumesh status {job} --all, or one state: "
                       f"--state STATE ({', '.join(TASK_STATES)})"]


@click.command()
@job_id_argument
@endpoint_options
@click.option("--json", "as_json", is_flag=True, help="Print JSON [default: text].")
@one_line_errors
def cancel(job_id, url, token, fingerprint, as_json):
    """Cancel a job: queued tasks are dropped, running ones killed. Exit code 1 if the
    job is unknown."""
    answer = _mesh(url, token, fingerprint).cancel_job(job_id)
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
def logs(job_id, task_id, url, token, fingerprint, as_json):
    """What each task of a job printed to stdout and stderr (in text, only the tasks that
    printed something; one line counts the others). Each stream keeps its first 8 MiB per
    attempt."""
    tasks = _mesh(url, token, fingerprint).logs(job_id, task_id)
    if as_json:
        click.echo(json.dumps(tasks, indent=2))
        return
    silent = 0
    for t in tasks:
        attempts = t.get("attempts") or [t]
        if not any(a.get("stdout") or a.get("stderr") for a in attempts):
            silent += 1
            continue
        click.echo(f"=== task {t['id']} (#{t['index']}, {t['state']})")
        for a in attempts:
            if len(attempts) > 1:  # retried or handed back: each attempt's output apart
                click.echo(f"--- attempt {a['attempt']} on {where_ran(a)}: {a.get('ended') or '?'}")
            if a["stdout"]:
                click.echo(a["stdout"], nl=not a["stdout"].endswith("\n"))
            if a["stderr"]:
                click.echo("--- stderr")
                click.echo(a["stderr"], nl=not a["stderr"].endswith("\n"))
    if silent:
        if silent == len(tasks) == 1:
            t = tasks[0]
            click.echo(f"(task {t['id']} (#{t['index']}, {t['state']}) printed nothing)")
        else:
            click.echo(f"({silent} of {len(tasks)} task(s) printed nothing"
                       + (")" if silent == len(tasks) else "; not shown)"))
