"""Progress bars for batches (``.map``) and ``gpumesh submit --wait``.

A bar is shown only to a person: when stderr is a terminal (rich), or the caller runs in
a Jupyter kernel (:class:`NotebookBar`, one output updated in place); never in a pipe or
a log file. ``GPUMESH_PROGRESS=0`` turns bars off, ``GPUMESH_PROGRESS=1`` forces them
on: where stderr is no terminal, as plain lines (:class:`LineBar`, one every
:data:`LINE_EVERY_S` while the counts move), since rich's live bar draws nothing there
and its redraws would fill a log file with escape codes. ``.map`` shows its bar only
once the batch has taken longer than :data:`DELAY_S`, so short calls stay quiet.

A terminal bar hides the cursor while it draws. :meth:`Progress.close` shows it again, and
so does a SIGTERM or SIGHUP that ends the process while a bar is up (the bar registers
:meth:`Progress.abandon` with :func:`.stopsignals.at_stop`): the user's shell keeps its
cursor however the caller ended.
"""

from __future__ import annotations

import abc
import functools
import html
import sys
import threading
import time
from typing import Any

from .. import limits
from . import stopsignals

#: A batch shows its bar once it has run this long (seconds).
DELAY_S = 1.0
#: A notebook bar is redrawn at most this often (seconds): each redraw is a message to
#: the front end, and a batch of 10,000 fast tasks must not send 10,000 of them.
NOTEBOOK_REFRESH_S = 0.5
#: What a terminal bar writes (rich's ``show_cursor``) to show the cursor it hid.
SHOW_CURSOR = "\x1b[?25h"
#: A forced bar on a stderr that is no terminal (a pipe, a log file) writes a line this
#: often (seconds) when the counts changed since the last one, and at least every
#: :data:`LINE_QUIET_S` while nothing moves (the log shows the batch is still waiting).
LINE_EVERY_S = 10.0
LINE_QUIET_S = 60.0


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
    forced = limits.setting("GPUMESH_PROGRESS")
    if forced is not None:
        return forced
    if in_notebook():
        return True
    return _terminal()


def _terminal() -> bool:
    """Whether stderr is a terminal (rich's live bar draws there, and nowhere else)."""
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

    ``enabled``: draw at all (default :func:`wanted`). ``delay``: seconds after
    ``started`` (``time.monotonic()`` when the batch began; default now) before the bar
    appears (a timer shows it even while no result arrives). Thread-safe; call
    :meth:`update` with the number of final tasks (and how many of them failed or were
    cancelled: the bar then counts each apart, see :func:`outcome_text`) and
    :meth:`close` at the end (the bar disappears; ``keep=True`` leaves its last state on
    screen).
    """

    def __init__(self, total: int, description: str = "tasks", *, enabled: bool | None = None,
                 delay: float = DELAY_S, keep: bool = False, console=None,
                 started: float | None = None) -> None:
        self.total, self.description, self.keep = total, description, keep
        self.enabled = wanted() if enabled is None else enabled
        self.done = 0  # final tasks, whatever their outcome
        self.failed = self.cancelled = 0
        self.started = time.monotonic() if started is None else started
        # reentrant: abandon() runs in a signal handler, maybe inside update() in this thread
        self._lock = threading.RLock()
        self._bar: Any = None  # a rich Progress or a NotebookBar, made when first shown
        self._task: Any = None
        self._closed = False
        self._console = console
        self._timer: threading.Timer | None = None
        self._unregister: Any = None
        if self.enabled:
            if self._console is None and not in_notebook() and _terminal():
                # a terminal's cursor to give back (a LineBar hides none)
                self._unregister = stopsignals.at_stop(self.abandon)
            if delay <= 0:
                self._show()
            else:
                self._timer = threading.Timer(max(0.0, self.started + delay - time.monotonic()),
                                              self._show)
                self._timer.daemon = True
                self._timer.start()

    def _show(self) -> None:
        with self._lock:
            if self._closed or self._bar is not None:
                return
            from rich.console import Console
            from rich.progress import BarColumn, Progress as Bar, TextColumn, TimeRemainingColumn
            console = self._console or Console(stderr=True)
            # rich's live display in a notebook needs ipywidgets (without it: a warning
            # and no bar); the notebook bar needs only IPython's display
            make: Any = Bar
            if self._console is None and in_notebook():
                make = functools.partial(NotebookBar, started=self.started)
            elif self._console is None and not _terminal():  # forced on (GPUMESH_PROGRESS=1)
                make = functools.partial(LineBar, started=self.started)
            self._bar = make(TextColumn("[progress.description]{task.description}"), BarColumn(),
                             TextColumn("{task.fields[outcome]}"),
                             TextColumn("{task.fields[rate]}"), _elapsed_column(self.started),
                             TextColumn("ETA"), TimeRemainingColumn(),
                             console=console, transient=not self.keep)
            self._task = self._bar.add_task(self.description, total=self.total,
                                            completed=self.done, rate=self._rate(),
                                            outcome=self._outcome(), failed=self.failed,
                                            cancelled=self.cancelled)
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
                                 outcome=self._outcome(), failed=failed, cancelled=cancelled)

    @property
    def shown(self) -> bool:
        return self._bar is not None

    def close(self) -> None:
        with self._lock:
            self._stop()
        if self._unregister is not None:
            self._unregister()
            self._unregister = None

    def _stop(self) -> None:
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        if self._bar is not None:
            try:
                self._bar.stop()  # (rich's: shows the cursor again)
            except Exception:  # noqa: BLE001 - the console went away
                pass

    def abandon(self) -> None:
        """Take the bar down from a stop signal's handler (:mod:`.stopsignals`), cursor
        shown, without waiting long for a lock another thread holds (the timer drawing it
        for the first time): the process is about to end."""
        got = self._lock.acquire(timeout=1.0)
        try:
            shown = self._bar is not None
            self._stop()
        finally:
            if got:
                self._lock.release()
        if shown:
            # Again, past rich: a signal that came while rich was drawing (inside its
            # console's buffer) leaves what stop() wrote in that buffer, never flushed.
            stream = getattr(sys.stderr, "rich_proxied_file", sys.stderr)  # (its redirect)
            if stream.isatty():
                stream.write(SHOW_CURSOR)
                stream.flush()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _elapsed_column(started: float):
    """A rich column of the time since ``started`` (``time.monotonic()``), the batch's
    start. rich's own elapsed column counts from when the bar appears, :data:`DELAY_S`
    later, which would disagree with the rate beside it."""
    from rich.progress import ProgressColumn
    from rich.text import Text

    class SinceStart(ProgressColumn):
        def render(self, task) -> Text:
            s = int(max(time.monotonic() - started, 0))
            return Text(f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}", style="progress.elapsed")

    return SinceStart()


class TextBar(abc.ABC):
    """A bar drawn as text, driven like rich's ``Progress`` (``add_task``, ``update``,
    ``start``, ``stop``); rich's column arguments are accepted and not used, and of the
    task fields only ``failed`` and ``cancelled`` (counted apart from the done ones, as
    :func:`bar_text` does). ``started``: when the batch began (``time.monotonic()``),
    from which elapsed time, rate and ETA count. A daemon thread redraws it every
    ``every`` seconds (:meth:`_draw`, each subclass's), so the elapsed time moves between
    results, and :meth:`stop` draws its last state."""

    every = NOTEBOOK_REFRESH_S

    def __init__(self, *columns, started: float | None = None, **_rich_options) -> None:
        self.description, self.total, self.completed = "", 0, 0
        self.failed = self.cancelled = 0
        self.started = time.monotonic() if started is None else started
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add_task(self, description: str, total: int | None = None, completed: int = 0,
                 **fields) -> int:
        with self._lock:
            self.description, self.total, self.completed = description, total or 0, completed
            self.failed, self.cancelled = fields.get("failed", 0), fields.get("cancelled", 0)
        return 0

    def update(self, task_id: int, *, completed: int | None = None, total: int | None = None,
               **fields) -> None:
        with self._lock:
            if completed is not None:
                self.completed = completed
            if total is not None:
                self.total = total
            self.failed = fields.get("failed", self.failed)
            self.cancelled = fields.get("cancelled", self.cancelled)

    def start(self) -> None:
        self._draw()
        self._thread = threading.Thread(target=self._refresh, name="gpumesh-text-bar",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * NOTEBOOK_REFRESH_S)
        self._draw(final=True)

    def _refresh(self) -> None:
        while not self._stop.wait(self.every):
            self._draw()

    @abc.abstractmethod
    def _draw(self, final: bool = False) -> None:
        """Show the bar's present state (``final``: its last, when it stops)."""

    def counts(self) -> tuple[int, int, int, int]:
        with self._lock:
            return self.completed, self.total, self.failed, self.cancelled

    def text(self) -> str:
        """The bar as one line of text."""
        with self._lock:
            done, total, description = self.completed, self.total, self.description
            failed, cancelled = self.failed, self.cancelled
        elapsed = time.monotonic() - self.started
        line = f"{description} {bar_text(done, total, elapsed, failed=failed, cancelled=cancelled)}"
        if done and elapsed > 0:
            rate = done / elapsed
            line += f"  {rate:.1f}/s"
            if done < total:
                line += f"  ETA {(total - done) / rate:.0f}s"
        return line


class LineBar(TextBar):
    """The bar ``GPUMESH_PROGRESS=1`` forces on where stderr is no terminal (a pipe, a
    log file): plain lines on stderr, ``[gpumesh] tasks ####......  40%  4/10 done  (12s)
    0.3/s  ETA 18s``, one when it appears, then one every :data:`LINE_EVERY_S` when the
    counts changed (or :data:`LINE_QUIET_S` passed) since the last, and the last state
    when it stops. No escape codes, no carriage returns: each line stands in a log."""

    def __init__(self, *columns, started: float | None = None, **rich_options) -> None:
        super().__init__(*columns, started=started, **rich_options)
        self.every = LINE_EVERY_S
        self._said: tuple[int, int, int, int] | None = None
        self._said_at = 0.0

    def _draw(self, final: bool = False) -> None:
        now = time.monotonic()
        counts = self.counts()
        if not final and counts == self._said and now - self._said_at < LINE_QUIET_S:
            return
        self._said, self._said_at = counts, now
        try:
            sys.stderr.write(f"[gpumesh] {self.text()}\n")
            sys.stderr.flush()
        except (OSError, ValueError):  # stderr closed or gone: progress is not worth failing for
            pass


class NotebookBar(TextBar):
    """The bar in a Jupyter notebook: one output updated in place, an HTML ``<progress>``
    with the counts beside it (and the same line as text for plain front ends), e.g.
    ``slow ##########..........  50%  2/4 done  (1s)  1.9/s  ETA 1s``.

    Redrawn at most every :data:`NOTEBOOK_REFRESH_S`. Unlike the terminal bar it stays in
    the cell's output, at its last state.
    """

    def __init__(self, *columns, started: float | None = None, **rich_options) -> None:
        super().__init__(*columns, started=started, **rich_options)
        self._handle = None
        self._drawn: str | None = None

    def start(self) -> None:
        from IPython.display import display
        self._handle = display(self._bundle(), raw=True, display_id=True)
        self._thread = threading.Thread(target=self._refresh, name="gpumesh-notebook-bar",
                                        daemon=True)
        self._thread.start()

    def _draw(self, final: bool = False) -> None:
        bundle = self._bundle()
        with self._lock:
            if self._handle is None or bundle["text/plain"] == self._drawn:
                return
            self._drawn = bundle["text/plain"]
            self._handle.update(bundle, raw=True)

    def _bundle(self) -> dict[str, str]:
        line = self.text()
        with self._lock:
            done, total = self.completed, max(self.total, 1)
        return {"text/plain": line,
                "text/html": f'<progress value="{done}" max="{total}" style="width:16em">'
                             f'</progress> <code>{html.escape(line)}</code>'}
