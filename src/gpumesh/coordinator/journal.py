"""Memory kept as the store has it across one commit: :meth:`Journalled.atomic`.

The coordinator's memory (leases, queues, counts) moves with each write it makes, so
that what follows in the same transaction sees it; the store commits once at the end.
When that commit fails (a full disk, an I/O error), each change is undone, last first,
by what registered it (:meth:`Journalled._on_rollback`); what others could see (a
woken caller, an answered long-poll, the metrics) waits for the commit
(:meth:`Journalled._once_stored`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

from .diskfull import note
from .store import Store

log = logging.getLogger("gpumesh.coordinator")


class Journalled:
    """A mixin for the coordinator: its ``store`` and the journal of one transaction."""

    store: Store
    #: Inside :meth:`atomic`: how to put memory back if its commit fails (run last
    #: first), and what may happen only once it committed; None outside.
    _undo: list[Callable[[], None]] | None = None
    _after: list[Callable[[], None]] | None = None

    @contextlib.contextmanager
    def atomic(self) -> Iterator[None]:
        """The store's writes made inside in one commit (:meth:`Store.transaction`), and
        memory kept as the store has it. Memory moves with each write, so that what
        follows in the block sees it (a result frees the slot its grant fills); what
        others may see — a caller woken with a result, a long-polling worker answered
        with a grant, the metrics — waits for the commit. When the commit fails (a full
        disk, an I/O error), every change the block made to memory is undone, last
        first: the leases it ended hold again, its grants' tasks are pending again, its
        jobs' counts are as stored; then the store's error (``sqlite3.Error``) is raised.
        When the block raises, the writes it made before commit as usual (each change
        either landed or never happened) and the exception goes on. Nested: part of the
        outer one."""
        if self._undo is not None:
            yield
            return
        undo: list[Callable[[], None]] = []
        after: list[Callable[[], None]] = []
        self._undo, self._after = undo, after
        raised: BaseException | None = None
        try:
            with self.store.transaction():
                try:
                    yield
                except BaseException as e:
                    raised = e
                    raise
        except BaseException as e:
            self._undo = self._after = None
            if e is raised:
                self._run_after(after)
                raise
            if not note(self.store.full, e):  # (a full disk: logged once per spell)
                log.error("a commit failed (%s: %s); %d change(s) to memory undone",
                          type(e).__name__, e, len(undo))
            for fn in reversed(undo):
                fn()
            raise
        self._undo = self._after = None
        self._run_after(after)

    @staticmethod
    def _run_after(after: list[Callable[[], None]]) -> None:
        # Each runs: one that fails (a store that fails again, granting to a waiting
        # worker) must not keep the callers of the others from being woken.
        for fn in after:
            try:
                fn()
            except Exception:
                log.exception("after a commit")

    def _on_rollback(self, fn: Callable[[], None]) -> None:
        """Inside :meth:`atomic`: ``fn`` puts back what was just changed in memory, should
        the commit fail. Outside, the write has committed already."""
        if self._undo is not None:
            self._undo.append(fn)

    def _once_stored(self, fn: Callable[[], None]) -> None:
        """``fn`` now, or, inside :meth:`atomic`, once the commit has succeeded."""
        if self._after is None:
            fn()
        else:
            self._after.append(fn)
