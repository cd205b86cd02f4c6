"""Progress bars for batches (``.map``) and ``gpumesh submit --wait``.

A bar is shown only to a person: when stderr is a terminal, or the caller runs in a
Jupyter kernel; never in a pipe or a log file. ``GPUMESH_PROGRESS=0`` turns bars off,
``GPUMESH_PROGRESS=1`` forces them on. ``.map`` shows its bar only once the batch has
taken longer than :data:`DELAY_S`, so short calls stay quiet.
"""

from __future__ import annotations

import os
import sys
import threading
import time

#: A batch shows its bar once it has run this long (seconds).
DELAY_S = 1.0


def in_notebook() -> bool:
    """Whether this process is a Jupyter kernel (ipykernel's shell)."""
    if "ipykernel" not in sys.modules:
        return False
    try:
        from IPython import get_ipython
        shell = get_ipython()
    except Exception:  # noqa: BLE001 - IPython missing or broken: not a notebook
        return False
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


def wanted() -> bool:
    """Should a progress bar be drawn here? (see the module docstring)"""
    env = os.environ.get("GPUMESH_PROGRESS")
    if env in ("0", "1"):
        return env == "1"
    if in_notebook():
        return True
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def outcome_text(final: int, total: int, failed: int = 0, cancelled: int = 0) -> str:
    """How many of ``total`` tasks ended, and how: ``6/6 done`` when every final task
    succeeded, else each outcome counted apart: ``4/4 final: 3 done, 1 failed``."""
    if not failed and not cancelled:
        return f"{final}/{total} done"
    parts = [f"{final - failed - cancelled} done"]
    if failed:
        parts.append(f"{failed} failed")
    if cancelled:
        parts.append(f"{cancelled} cancelled")
    return f"{final}/{total} final: " + ", ".join(parts)


def bar_text(done: int, total: int, elapsed: float, width: int = 20, *, failed: int = 0,
             cancelled: int = 0) -> str:
    """The plain-text bar the CLI prints: ``#####...  50%  3/6 done  (4s)``; ``done`` is
    the number of final tasks, of which ``failed`` and ``cancelled`` did not succeed
    (then ``4/4 final: 3 done, 1 failed``)."""
    frac = done / total if total else 1.0
    filled = int(round(frac * width))
    return (f"{'#' * filled}{'.' * (width - filled)} {frac * 100:3.0f}%  "
            f"{outcome_text(done, total, failed, cancelled)}  ({elapsed:.0f}s)")


class Progress:
    """A live bar for ``total`` tasks: final/total, rate, elapsed and ETA (rich).

    ``enabled``: draw at all (default :func:`wanted`). ``delay``: seconds before the bar
    appears (a timer shows it even while no result arrives). Thread-safe; call
    :meth:`update` with the number of final tasks (and how many of them failed or were
    cancelled: the bar then counts each apart, see :func:`outcome_text`) and
    :meth:`close` at the end (the bar disappears; ``keep=True`` leaves its last state on
    screen).
    """

    def __init__(self, total: int, description: str = "tasks", *, enabled: bool | None = None,
                 delay: float = DELAY_S, keep: bool = False, console=None) -> None:
        self.total, self.description, self.keep = total, description, keep
        self.enabled = wanted() if enabled is None else enabled
        self.done = 0  # final tasks, whatever their outcome
        self.failed = self.cancelled = 0
        self.started = time.monotonic()
        self._lock = threading.Lock()
        self._bar = None
        self._task = None
        self._closed = False
        self._console = console
        self._timer: threading.Timer | None = None
        if self.enabled:
            if delay <= 0:
                self._show()
            else:
                self._timer = threading.Timer(delay, self._show)
                self._timer.daemon = True
                self._timer.start()

    def _show(self) -> None:
        with self._lock:
            if self._closed or self._bar is not None:
                return
            from rich.console import Console
            from rich.progress import (BarColumn, Progress as Bar, TextColumn,
                                       TimeElapsedColumn, TimeRemainingColumn)
            console = self._console or Console(stderr=True)
            self._bar = Bar(TextColumn("[progress.description]{task.description}"), BarColumn(),
                            TextColumn("{task.fields[outcome]}"),
                            TextColumn("{task.fields[rate]}"), TimeElapsedColumn(),
                            TextColumn("ETA"), TimeRemainingColumn(),
                            console=console, transient=not self.keep)
            self._task = self._bar.add_task(self.description, total=self.total,
                                            completed=self.done, rate=self._rate(),
                                            outcome=self._outcome())
            try:
                self._bar.start()
            except Exception:  # noqa: BLE001 - a console that cannot draw: no bar
                self._bar = None

    def _rate(self) -> str:
        elapsed = time.monotonic() - self.started
        return f"{self.done / elapsed:.1f}/s" if elapsed > 0 and self.done else "-/s"

    def _outcome(self) -> str:
        return outcome_text(self.done, self.total, self.failed, self.cancelled)

    def update(self, done: int, total: int | None = None, *, failed: int = 0,
               cancelled: int = 0) -> None:
        """``done`` tasks of ``total`` are final; ``failed`` and ``cancelled`` of them
        did not succeed."""
        with self._lock:
            self.done, self.failed, self.cancelled = done, failed, cancelled
            if total is not None:
                self.total = total
            if self._bar is not None:
                self._bar.update(self._task, completed=done, total=self.total, rate=self._rate(),
                                 outcome=self._outcome())

    @property
    def shown(self) -> bool:
        return self._bar is not None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._timer is not None:
                self._timer.cancel()
            if self._bar is not None:
                try:
                    self._bar.stop()
                except Exception:  # noqa: BLE001 - the console went away
                    pass

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
