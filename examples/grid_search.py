"""A training sweep: logistic regression by gradient descent, one task per (lr, epochs, l2).

    python examples/grid_search.py                  # fan the grid out over the mesh
    python examples/grid_search.py --stdin-payload  # script-job mode: one JSON payload on stdin
    gpumesh submit examples/grid_search.py --payloads examples/payloads.json --wait

The mesh is found the usual way ($GPUMESH_URL / $GPUMESH_TOKEN, else the saved config);
if it cannot be reached the same ``.map`` runs locally. The data are generated from a
fixed seed (two Gaussian clouds in the plane), so nothing is downloaded and only NumPy
is needed.

Each configuration carries a ``cost`` (its epochs / 100): a scheduling hint, so the
strongest workers take the longest runs. In ``.map`` the key is taken off before the
call; a script job's payload reaches the script whole, and the script ignores it.

Standard output is fully deterministic (fixed data, no randomness in training, no
timings, nothing about where a task ran), so a local run and a mesh run print identical
text. The elapsed time goes to standard error.

In script-job mode the payload is a JSON object ``{"lr": ..., "epochs": ..., "l2": ...}``
(other keys, such as ``cost``, are ignored) and the result is one JSON line, e.g.::

    echo '{"lr": 0.1, "epochs": 300, "l2": 0.001}' | python examples/grid_search.py --stdin-payload
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np

LR_VALUES = [0.01, 0.05, 0.1, 0.3]
EPOCH_VALUES = [100, 300, 1000]
L2_VALUES = [0.0, 0.01]

#: Seed of the generated data; training itself has no randomness.
SEED = 0
#: Points generated, the first TRAIN_POINTS of them for training, the rest to validate.
N_POINTS, TRAIN_POINTS = 1000, 750
#: Most epochs a payload may ask for (a typo should not run for an hour).
MAX_EPOCHS = 100_000


def grid() -> list[dict]:
    """Every configuration as a ``.map`` item: kwargs for :func:`train` plus its ``cost``."""
    return [{"lr": lr, "epochs": e, "l2": l2, "cost": e / 100}
            for lr in LR_VALUES for e in EPOCH_VALUES for l2 in L2_VALUES]


def make_data(seed: int = SEED) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(X_train, y_train, X_val, y_val)``: two overlapping clouds around (-0.8, 0.8)
    (label 0) and (0.8, -0.8) (label 1), standard deviation 0.7."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, N_POINTS)
    centres = np.array([[-0.8, 0.8], [0.8, -0.8]])
    X = centres[y] + rng.normal(0.0, 0.7, (N_POINTS, 2))
    return X[:TRAIN_POINTS], y[:TRAIN_POINTS], X[TRAIN_POINTS:], y[TRAIN_POINTS:]


def train(lr: float, epochs: int, l2: float) -> dict:
    """Fit ``p(y=1) = sigmoid(w0*x0 + w1*x1 + b)`` by full-batch gradient descent on the
    log loss plus ``l2 * (w0^2 + w1^2) / 2``; return the validation accuracy and the
    weights ``[w0, w1, b]``. Deterministic: the same numbers locally and on any worker."""
    X_train, y_train, X_val, y_val = make_data()
    A = np.hstack([X_train, np.ones((len(X_train), 1))])
    w = np.zeros(3)
    for _ in range(int(epochs)):
        p = 1.0 / (1.0 + np.exp(-(A @ w)))
        grad = A.T @ (p - y_train) / len(y_train) + l2 * np.r_[w[:2], 0.0]
        w -= lr * grad
    A_val = np.hstack([X_val, np.ones((len(X_val), 1))])
    accuracy = float(((A_val @ w > 0) == y_val).mean())
    return {"lr": float(lr), "epochs": int(epochs), "l2": float(l2),
            "val_accuracy": round(accuracy, 3), "weights": [round(float(v), 4) for v in w]}


def rank(results: list[dict]) -> list[dict]:
    """Best first: validation accuracy descending, then fewer epochs, smaller lr and l2."""
    return sorted(results, key=lambda r: (-r["val_accuracy"], r["epochs"], r["lr"], r["l2"]))


def format_table(ranked: list[dict]) -> str:
    """A plain, aligned text table (no colours, no timings: the same text on every run)."""
    header = ("rank", "lr", "epochs", "l2", "val_accuracy", "weights")
    rows = [(str(i), f"{r['lr']:g}", str(r["epochs"]), f"{r['l2']:g}", f"{r['val_accuracy']:.3f}",
             " ".join(f"{v:+.4f}" for v in r["weights"]))
            for i, r in enumerate(ranked, 1)]
    widths = [max(len(h), *(len(row[j]) for row in rows)) for j, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def _payload_error(payload) -> str | None:
    """Why ``payload`` is not a configuration, or None."""
    if not isinstance(payload, dict) or not {"lr", "epochs", "l2"} <= set(payload):
        return 'expected a JSON object with the keys "lr", "epochs" and "l2"'
    lr, epochs, l2 = payload["lr"], payload["epochs"], payload["l2"]
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (lr, epochs, l2)):
        return "lr, epochs and l2 must be numbers"
    if not (math.isfinite(lr) and lr > 0 and math.isfinite(l2) and l2 >= 0):
        return "lr must be a positive number and l2 a number >= 0"
    if epochs != int(epochs) or not 1 <= epochs <= MAX_EPOCHS:
        return f"epochs must be a whole number from 1 to {MAX_EPOCHS}"
    return None


def run_payload() -> int:
    """Script-job mode: one JSON object on stdin -> one JSON line on stdout."""
    try:
        payload = json.loads(sys.stdin.read())
    except ValueError as exc:
        print(f"error: stdin is not valid JSON: {exc}", file=sys.stderr)
        return 2
    why = _payload_error(payload)
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 2
    result = train(float(payload["lr"]), int(payload["epochs"]), float(payload["l2"]))
    print(json.dumps(result), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--stdin-payload",
        action="store_true",
        help='read one JSON payload {"lr": ..., "epochs": ..., "l2": ...} from stdin, '
             "print the result as JSON",
    )
    args = parser.parse_args(argv)
    # A worker runs script jobs (gpumesh submit) with GPUMESH_SCRIPT=1: payload mode.
    if args.stdin_payload or os.environ.get("GPUMESH_SCRIPT") == "1":
        return run_payload()

    from gpumesh import mesh  # auto-connects: $GPUMESH_URL / $GPUMESH_TOKEN, else saved config

    @mesh
    def train_config(lr: float, epochs: int, l2: float) -> dict:
        return train(lr=lr, epochs=epochs, l2=l2)

    configs = grid()
    started = time.perf_counter()
    results = train_config.map(configs)  # one task per configuration, results in input order
    elapsed = time.perf_counter() - started

    ranked = rank(results)
    print(f"logistic regression, {len(configs)} configurations (lr x epochs x l2), "
          "validation accuracy")
    print(format_table(ranked))
    print("best: " + json.dumps(ranked[0]))
    print(f"[grid_search] {len(results)} tasks in {elapsed:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("[grid_search] interrupted", file=sys.stderr)
        sys.exit(130)
