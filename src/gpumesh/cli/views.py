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


def task_lines(view: dict, color: bool = False) -> list[str]:
    """One job's tasks (a ``GPUMesh.status`` view) as the spec shows them:
    ``✓ task ID [done]  cost=1.0  worker=W``, then ``result: {...}`` (or ``error: ...``)."""
    from ..client.jobview import result_text
    lines = []
    for t in view.get("tasks", []):
        mark, fg = MARKS.get(t["state"], ("…", None))
        if color and fg:
            mark = click.style(mark, fg=fg)
        lines.append(f"  {mark} task {t['id']} [{t['state']}]  cost={t['cost']}  "
                     f"worker={t['worker_id'] or '-'}"
                     + (f"  attempts={t['attempts']}" if (t.get("attempts") or 0) > 1 else ""))
        for h in t.get("history") or ():  # attempts that ended without a result
            who = h.get("hostname") or h.get("worker") or "?"
            err = h.get("error") or {}
            what = f"{err.get('type')}: {err.get('message', '')}; " if err.get("type") else ""
            lines.append(f"    attempt {h.get('attempt', '?')} on {who}: {what}{h.get('ended', '')}")
        text = result_text(t, view.get("released", False))
        if text is not None:
            lines.append("    result: " + text)
        if t.get("error"):
            lines.append(f"    error: {t['error'].get('message', '')}")
    return lines


def counts_line(counts: dict) -> str:
    """``done=4, failed=1`` (``-`` for none)."""
    return ", ".join(f"{k}={v}" for k, v in sorted(counts.items())) or "-"
