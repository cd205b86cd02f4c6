"""A PyTorch training sweep: one small MLP per (learning rate, hidden width), one task each.

    python examples/torch_sweep.py

Each task trains on a GPU when its worker has one (the worker pins each GPU task with
CUDA_VISIBLE_DEVICES, so ``torch.device("cuda")`` is that task's own GPU) and on the CPU
otherwise, so the sweep runs the same on a laptop without a GPU. The mesh is found the
usual way ($GPUMESH_URL / $GPUMESH_TOKEN, else the saved config); unreachable, the sweep
runs in this process.

PyTorch is needed here and on every worker (the task imports it there):
``pip install torch``. Without it the script says so and exits 1.

The data are two interleaved spirals (600 points, fixed seed), split 480/120. Standard
output (the ranked table and the best configuration) depends only on the configurations:
training is seeded, single-threaded on the CPU and deterministic, so a local run and a
mesh run of CPU workers print the same text. Where each task ran goes to standard error.
"""

from __future__ import annotations

import json
import math
import sys
import time

try:
    import torch
except ImportError:
    print("this example needs PyTorch, here and on every worker: pip install torch\n"
          "(a CPU-only build: pip install torch --index-url https://download.pytorch.org/whl/cpu)",
          file=sys.stderr)
    sys.exit(1)

from gpumesh import mesh

LEARNING_RATES = [0.003, 0.01, 0.03]
HIDDEN = [8, 32]
EPOCHS = 300
SEED = 0


def spirals(n: int = 600, seed: int = SEED) -> tuple[torch.Tensor, torch.Tensor]:
    """``(X, y)``: ``X`` float32 of shape (n, 2), ``y`` int64 of shape (n,) with classes 0/1."""
    g = torch.Generator().manual_seed(seed)
    half = n // 2
    t = torch.rand(half, generator=g) * 3 * math.pi + 0.5
    arm = torch.stack([t * torch.cos(t), t * torch.sin(t)], dim=1) / (3 * math.pi)
    X = torch.cat([arm, -arm]) + 0.03 * torch.randn(2 * half, 2, generator=g)
    y = torch.cat([torch.zeros(half, dtype=torch.long), torch.ones(half, dtype=torch.long)])
    order = torch.randperm(2 * half, generator=g)
    return X[order], y[order]


@mesh
def train(lr: float, hidden: int, epochs: int = EPOCHS) -> dict:
    """Train a 2-layer MLP full-batch with Adam; the validation accuracy and final loss.

    Returns ``{"lr", "hidden", "val_accuracy", "train_loss", "device"}`` (accuracy in
    [0, 1], loss the cross-entropy of the last epoch, device ``"cuda"`` or ``"cpu"``)."""
    torch.set_num_threads(1)  # one slot, one core; also makes CPU results reproducible
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    X, y = spirals()
    X, y = X.to(device), y.to(device)
    X_train, y_train, X_val, y_val = X[:480], y[:480], X[480:], y[480:]
    torch.manual_seed(SEED)
    model = torch.nn.Sequential(torch.nn.Linear(2, hidden), torch.nn.Tanh(),
                                torch.nn.Linear(hidden, hidden), torch.nn.Tanh(),
                                torch.nn.Linear(hidden, 2)).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    loss_fn = torch.nn.CrossEntropyLoss()
    for _ in range(epochs):
        opt.zero_grad()
        loss = loss_fn(model(X_train), y_train)
        loss.backward()
        opt.step()
    with torch.no_grad():
        acc = (model(X_val).argmax(dim=1) == y_val).float().mean().item()
    return {"lr": lr, "hidden": hidden, "val_accuracy": round(acc, 4),
            "train_loss": round(loss.item(), 4), "device": device.type}


def configs() -> list[dict]:
    # ``cost`` is a scheduling hint (removed before the call): wider nets to stronger slots.
    return [{"lr": lr, "hidden": h, "cost": float(h)} for lr in LEARNING_RATES for h in HIDDEN]


def main() -> int:
    started = time.perf_counter()
    results = train.map(configs())
    ranked = sorted(results, key=lambda r: (-r["val_accuracy"], r["train_loss"], r["lr"], r["hidden"]))
    print(f"MLP on two spirals: {len(results)} configurations, {EPOCHS} epochs each")
    print(f"{'rank':>4}  {'lr':>6}  {'hidden':>6}  {'val_accuracy':>12}  {'train_loss':>10}")
    for i, r in enumerate(ranked, 1):
        print(f"{i:>4}  {r['lr']:>6g}  {r['hidden']:>6}  {r['val_accuracy']:>12.4f}  {r['train_loss']:>10.4f}")
    best = {k: v for k, v in ranked[0].items() if k != "device"}
    print("best: " + json.dumps(best, sort_keys=True))
    devices = sorted({r["device"] for r in results})
    print(f"[torch_sweep] {len(results)} tasks on {'/'.join(devices)} in "
          f"{time.perf_counter() - started:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
