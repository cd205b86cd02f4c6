"""How jobs and tasks look in the terminal: shared by ``status`` and ``submit --wait``."""

from __future__ import annotations

import os
import sys

import click


def color_enabled() -> bool:
    """Colours only on a terminal and never with NO_COLOR / --no-color."""
    if os.environ.get("NO_COLOR"):
        return False
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):
        return False


MARKS = {"done": ("✓", "green"), "failed": ("✗", "red"), "cancelled": ("-", "yellow")}


def where_ran(attempt: dict) -> str:
    """An attempt's worker as ``status`` and ``logs`` name it: ``HOST (ID)`` (host names
    are not unique: two workers on one machine, or two machines called ``vm``)."""
    who = attempt.get("hostname") or attempt.get("worker") or "?"
    if attempt.get("hostname") and attempt.get("worker"):
        who += f" ({attempt['worker']})"
    return who


def task_lines(view: dict, color: bool = False, items: bool = False) -> list[str]:
    """One job's tasks (a ``GPUMesh.status`` view) as the spec shows them:
    ``✓ task ID [done]  cost=1.0  worker=W``, then ``result: {...}`` (or ``error: ...``).
    ``items``: end each task's line with ``item=N``, its index in the ``.map`` (or
    payload list) that made it (``status`` of a job of more than one task: which point of
    a sweep failed; ``submit --wait`` keeps the spec's line)."""
    from ..client.jobview import result_text
    lines = []
    for t in view.get("tasks", []):
        mark, fg = MARKS.get(t["state"], ("…", None))
        if color and fg:
            mark = click.style(mark, fg=fg)
        lines.append(f"  {mark} task {t['id']} [{t['state']}]  cost={t['cost']}  "
                     f"worker={t['worker_id'] or '-'}"
                     + (f"  attempts={t['attempts']}" if (t.get("attempts") or 0) > 1 else "")
                     + (f"  item={t['index']}" if items and t.get("index") is not None else ""))
        for h in t.get("history") or ():  # attempts that ended without a result
            who = where_ran(h)
            err = h.get("error") or {}
            what = "" if not err.get("type") else f"{err['type']}: {err['message']}; " \
                if "message" in err else f"{err['type']}; "
            lines.append(f"    attempt {h.get('attempt', '?')} on {who}: {what}{h.get('ended', '')}")
        text = result_text(t, view.get("released", False))
        if text is not None:
            lines.append("    result: " + text)
        err = t.get("error")
        if err:
            # What the function raised is named by its type, as a traceback would
            # (``KeyError: 'missing 2'``); gpumesh's own failures read as sentences.
            kind = err.get("type") if err.get("kind") == "raised" and err.get("type") else None
            if "message" not in err:  # someone else's job: the coordinator sent no text
                lines.append(f"    error: {err.get('type') or err.get('kind') or 'failed'} "
                             f"(its message is shown to the job's owner only)")
            else:
                lines.append(f"    error: {kind + ': ' if kind else ''}{err['message']}")
    if any("message" in (t.get("error") or {}) for t in view.get("tasks", [])):
        # (an error line is a message's last line; where it came from is elsewhere)
        lines.append("")
        lines.append(f"  whole output of each task, tracebacks included: gpumesh logs {view.get('id', 'JOB_ID')}"
                     if view.get("kind") == "script" else
                     f"  each failure's remote traceback: gpumesh status {view.get('id', 'JOB_ID')} --json")
    return lines


def counts_line(counts: dict) -> str:
    """``done=4, failed=1`` (``-`` for none): the COUNTS column of ``gpumesh jobs``."""
    return ", ".join(f"{k}={v}" for k, v in sorted(counts.items())) or "-"


def counts_dict(counts: dict) -> str:
    """``{'done': 4, 'failed': 1}``: the ``Counts:`` line of ``status`` and ``submit --wait``,
    written as the spec's README shows it."""
    return repr(dict(sorted(counts.items())))
