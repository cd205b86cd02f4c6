"""Results as a pandas DataFrame (``GPUMesh.results_to_dataframe``)."""

from __future__ import annotations

from typing import Any

from .. import protocol
from ..errors import RemoteError


def error_text(exc: BaseException) -> str:
    """One line for a failed item: its exception's type name and message
    (``ValueError: diverged``); the remote type for a :class:`RemoteError` (an exception
    that could not travel as itself), the bare name for an exception without a message."""
    if isinstance(exc, RemoteError):
        name, message = exc.remote_type, exc.remote_message
    else:
        name, message = type(exc).__name__, str(exc)
    return f"{name}: {message}" if message else name


def record_error(error: dict[str, Any]) -> str:
    """:func:`error_text` for a task's error dict (a ``wait`` record's or a status view's
    ``error``): its ``type`` (``ValueError``, ``TaskTimeout``...; else the exception a
    call raises for its ``kind``) and ``message``. Someone else's job has no message:
    the type alone."""
    name = error.get("type")
    if not name:
        text = str(error.get("message") or "")
        name = type(protocol.failure_exception(error.get("kind"), text)).__name__
    return f"{name}: {error['message']}" if error.get("message") else str(name)


def results_to_dataframe(results: Any):
    """One row per result, in item order. A list of dicts becomes columns (keys missing
    in some rows are NaN); other values (numbers, lists...) become one ``result`` column.
    Exceptions in the list (``.map(..., return_exceptions=True)``) leave their row's
    values missing (NaN/None) and add an ``error`` column: ``"ValueError: diverged"``
    for a failed item, None for the others; there is no ``error`` column when no item
    failed. ``GPUMesh.wait`` records are flattened: their ``result`` dict's keys become
    columns beside ``index``, ``state`` and ``worker``, and a task that did not finish
    ``done`` (or whose result could not be decoded here, ``result_error``) fills the
    ``error`` column the same way; so are the tasks of a ``GPUMesh.status`` view. A
    result dict's own ``error`` key shares that column (for the rows that did not fail).
    Raises ``ImportError`` with the fix when pandas is missing."""
    try:
        import pandas as pd
    except ImportError:
        raise ImportError("results_to_dataframe needs pandas, which is not installed: "
                          "pip install pandas (or pip install 'gpumesh[notebook]')") from None
    if isinstance(results, dict) and isinstance(results.get("tasks"), list):
        # A GPUMesh.status view: one row per task, the same columns as wait() records.
        results = [{"task_id": t.get("id"), "index": t.get("index"), "state": t.get("state"),
                    "worker": t.get("worker_id"), "error": t.get("error"),
                    "result": t.get("result"), "result_error": t.get("result_error")}
                   for t in results["tasks"]]
    rows = list(results)
    flat: list[dict] = []
    errors: list[str | None] = []
    if rows and all(isinstance(r, dict) and {"task_id", "state", "result"} <= r.keys()
                    for r in rows):  # GPUMesh.wait records (or a status view's tasks)
        for r in rows:
            row = {"index": r.get("index"), "state": r["state"], "worker": r.get("worker")}
            # (a task without a value, failed or not finished yet, has missing ones, not a
            # None result; only a failed or cancelled one has an error)
            if r["state"] == "done" and not (r.get("error") or r.get("result_error")):
                value = r["result"]
                row.update(value if isinstance(value, dict) else {"result": value})
            flat.append(row)
            ended_badly = r["state"] in ("failed", "cancelled")
            errors.append(record_error(r["error"]) if r.get("error") else
                          r.get("result_error") or (r["state"] if ended_badly else None))
        frame = pd.DataFrame(flat)
    else:
        ok = [r for r in rows if not isinstance(r, BaseException)]
        errors = [error_text(r) if isinstance(r, BaseException) else None for r in rows]
        if ok and all(isinstance(r, dict) for r in ok):
            flat = [{} if isinstance(r, BaseException) else r for r in rows]
            frame = pd.DataFrame(flat, index=range(len(rows)))
        else:
            frame = pd.DataFrame({"result": [None if isinstance(r, BaseException) else r
                                             for r in rows]})
    if any(e is not None for e in errors):
        own = [f.get("error") for f in flat] if flat else [None] * len(errors)
        frame["error"] = pd.Series([e if e is not None else o for e, o in zip(errors, own)],
                                   index=frame.index, dtype=object)
    return frame
