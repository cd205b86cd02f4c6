"""Hyperparameter grid search of an RBF SVM on scikit-learn's digits dataset, one task per config.

    python examples/grid_search.py                  # fan the grid out over the mesh
    python examples/grid_search.py --stdin-payload  # script-job mode: one JSON payload on stdin
    gpumesh submit examples/grid_search.py --payloads examples/payloads.json --wait

The mesh is found the usual way ($GPUMESH_URL / $GPUMESH_TOKEN, else the saved config);
if it cannot be reached the same ``.map`` runs locally. The digits data ships with
scikit-learn, so nothing is downloaded.

Standard output is fully deterministic (fixed split, fixed seeds, no timings, nothing
about where a task ran), so a local run and a mesh run print identical text. The elapsed
time goes to standard error.

In script-job mode the payload is a JSON object ``{"C": ..., "gamma": ...}`` and the
result is printed as one JSON line, e.g.::

    echo '{"C": 3.0, "gamma": 0.001}' | python examples/grid_search.py --stdin-payload
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

# Module level on purpose: the function shipped to a worker refers to these by reference,
# so a worker imports scikit-learn once when it loads the function, not once per task.
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from sklearn.svm import SVC

#: 6 x 4 = 24 configurations; each fit takes well under a second on one core.
C_VALUES = [0.1, 0.3, 1.0, 3.0, 10.0, 30.0]
GAMMA_VALUES = [0.0001, 0.0003, 0.001, 0.003]

#: Fixed seed for the train/validation split and the model.
SEED = 0


def grid() -> list[dict]:
    """Every configuration as a kwargs dict for :func:`evaluate`, in a fixed order."""
    return [{"C": c, "gamma": g} for c in C_VALUES for g in GAMMA_VALUES]


def evaluate(C: float, gamma: float) -> dict:
    """Fit ``SVC(C, gamma)`` on a fixed 75/25 split of digits; return the validation score.

    Deterministic: the split and the model both use a fixed ``random_state``, so it
    returns the same numbers locally, on any worker and in ``--stdin-payload`` mode.
    """
    X, y = load_digits(return_X_y=True)
    X_train, X_val, y_train, y_val = train_test_split(
        X, y, test_size=0.25, random_state=SEED, stratify=y
    )
    model = SVC(C=float(C), gamma=float(gamma), kernel="rbf", random_state=SEED)
    model.fit(X_train, y_train)
    return {
        "C": float(C),
        "gamma": float(gamma),
        "val_accuracy": round(float(model.score(X_val, y_val)), 4),
        "n_support": int(model.n_support_.sum()),
    }


def rank(results: list[dict]) -> list[dict]:
    """Best first: validation accuracy descending, ties broken by (C, gamma) ascending."""
    return sorted(results, key=lambda r: (-r["val_accuracy"], r["C"], r["gamma"]))


def format_table(ranked: list[dict]) -> str:
    """A plain, aligned text table (no colours, no timings: the same text on every run)."""
    header = ("rank", "C", "gamma", "val_accuracy", "support_vectors")
    rows = [
        (str(i), f"{r['C']:g}", f"{r['gamma']:g}", f"{r['val_accuracy']:.4f}", str(r["n_support"]))
        for i, r in enumerate(ranked, 1)
    ]
    widths = [max(len(h), *(len(row[j]) for row in rows)) for j, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def run_payload() -> int:
    """Script-job mode: one JSON object on stdin -> one JSON line on stdout."""
    try:
        payload = json.loads(sys.stdin.read())
    except ValueError as exc:
        print(f"error: stdin is not valid JSON: {exc}", file=sys.stderr)
        return 2
    if not isinstance(payload, dict) or set(payload) != {"C", "gamma"}:
        print('error: expected a JSON object with exactly the keys "C" and "gamma"', file=sys.stderr)
        return 2
    values = (payload["C"], payload["gamma"])
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        print("error: C and gamma must be numbers", file=sys.stderr)
        return 2
    C, gamma = (float(v) for v in values)
    if not all(math.isfinite(v) and v > 0 for v in (C, gamma)):
        print("error: C and gamma must be positive, finite numbers", file=sys.stderr)
        return 2
    print(json.dumps(evaluate(C=C, gamma=gamma), sort_keys=True), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--stdin-payload",
        action="store_true",
        help='read one JSON payload {"C": ..., "gamma": ...} from stdin, print the result as JSON',
    )
    args = parser.parse_args(argv)
    # A worker runs script jobs (gpumesh submit) with GPUMESH_SCRIPT=1: payload mode.
    if args.stdin_payload or os.environ.get("GPUMESH_SCRIPT") == "1":
        return run_payload()

    from gpumesh import mesh  # auto-connects: $GPUMESH_URL / $GPUMESH_TOKEN, else saved config

    @mesh
    def evaluate_config(C: float, gamma: float) -> dict:
        return evaluate(C=C, gamma=gamma)

    configs = grid()
    started = time.perf_counter()
    results = evaluate_config.map(configs)  # one task per configuration, results in input order
    elapsed = time.perf_counter() - started

    ranked = rank(results)
    print(f"SVC (rbf) on digits: {len(configs)} configurations, validation accuracy")
    print(format_table(ranked))
    print("best: " + json.dumps(ranked[0], sort_keys=True))
    print(f"[grid_search] {len(results)} tasks in {elapsed:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("[grid_search] interrupted", file=sys.stderr)
        sys.exit(130)
