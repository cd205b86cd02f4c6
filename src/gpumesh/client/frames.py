"""Results as a pandas DataFrame (``GPUMesh.results_to_dataframe``)."""

from __future__ import annotations

from typing import Any


def results_to_dataframe(results: Any):
    """One row per result. A list of dicts becomes columns (keys missing in some rows are
    NaN); other values (numbers, lists...) become one ``result`` column. ``GPUMesh.wait``
    records are flattened: their ``result`` dict's keys become columns beside ``index``,
    ``state`` and ``worker``; so are the tasks of a ``GPUMesh.status`` view. Raises ``ImportError`` with the fix when pandas is missing."""
    try:
        import pandas as pd
    except ImportError:
        raise ImportError("results_to_dataframe needs pandas, which is not installed: "
                          "pip install pandas (or pip install 'gpumesh[notebook]')") from None
    if isinstance(results, dict) and isinstance(results.get("tasks"), list):
        # A GPUMesh.status view: one row per task, the same columns as wait() records.
        results = [{"task_id": t.get("id"), "index": t.get("index"), "state": t.get("state"),
                    "worker": t.get("worker_id"), "result": t.get("result")} for t in results["tasks"]]
    rows = list(results)
    if rows and all(isinstance(r, dict) for r in rows):
        if all({"task_id", "state", "result"} <= r.keys() for r in rows):  # GPUMesh.wait records
            flat = []
            for r in rows:
                row = {"index": r.get("index"), "state": r["state"], "worker": r.get("worker")}
                value = r["result"]
                row.update(value if isinstance(value, dict) else {"result": value})
                flat.append(row)
            return pd.DataFrame(flat)
        return pd.DataFrame(rows)
    return pd.DataFrame({"result": rows})
