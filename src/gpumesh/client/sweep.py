"""``f.imap(items)``: a sweep's results as they finish.

::

    it = train.imap(configs, return_exceptions=True)   # submitted now; returns at once
    for i, value in it:                                # (index, value) in completion order
        ...                                            # break, it.close(), or dropping the
                                                       # iterator cancels what is left

A :class:`Results` is an iterator over a generator of the caller's pipeline
(:meth:`gpumesh.client.mesh.GPUMesh.iter_calls`, or an engine's): closing it - ``break`` out
of a ``with`` block, :meth:`Results.close`, or the iterator being garbage-collected -
closes that generator, whose ``finally`` cancels the job's unfinished tasks on the
coordinator and releases what it stored. Local fallback runs the items one by one as
the iterator is read, so the same loop works without a mesh.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from typing import Any


class Results(Iterator[tuple[int, Any]]):
    """``(index, value)`` pairs of a ``.imap``, each as its task finishes (every index
    once). With ``return_exceptions=True`` a failed item's exception is its value;
    otherwise the first failure is raised from ``next()`` and the rest are cancelled (a
    task's ``StopIteration`` as the cause of a ``RuntimeError``: raised as itself, it
    would end the caller's ``for`` loop as if every result had come).

    ``job_id``: the mesh job behind it (None when the calls run locally or on an engine).
    Also a context manager: leaving the ``with`` block closes it.
    """

    def __init__(self, start: Callable[[dict], Generator], n: int):
        self.total = n
        # The generator gets a dict to note its job id in, not this object: holding this
        # object would make a cycle, and a dropped iterator would wait for the cyclic GC
        # (not its last reference) before it cancels its tasks.
        self._box: dict = {}
        self._gen = start(self._box)
        next(self._gen)  # submits (or decides to run locally); yields once before any result

    @property
    def job_id(self) -> str | None:
        return self._box.get("job_id")

    def __iter__(self) -> Results:
        return self

    def __next__(self) -> tuple[int, Any]:
        __tracebackhide__ = True  # (IPython shows the user's frames, not gpumesh's)
        return next(self._gen)

    def __len__(self) -> int:
        return self.total

    def close(self) -> None:
        """Stop: the tasks that have not finished are cancelled (their results are never
        delivered). Safe to call twice, or after the last result."""
        self._gen.close()

    def __enter__(self) -> Results:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        where = f"job {self.job_id}" if self.job_id else "local"
        return f"<gpumesh Results of {self.total} item(s), {where}>"
