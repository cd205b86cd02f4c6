"""Which pending task a free slot should take: pure policy, no I/O, no clock of its own.

The coordinator asks this module three questions whenever a slot is free:

1. **Can this slot run the task at all?** Hard filters, in :func:`gpumesh.hardware.refusal`:
   ``gpu=`` kind or model, ``cores=``, ``memory=`` (host RAM), ``gpu_memory=`` (the GPU's
   total memory) and the task's ``gpu_memory_mb`` hint against the GPU's last reported
   free memory. A hint asks for a GPU: a CPU slot never takes a hinted task.
2. **Which of the runnable tasks?** :func:`pick`: a slot's *relative strength* ``p`` is
   its device's benchmark score divided by the best score among the alive slots that
   could run the job (1.0 for the strongest). Among the first :data:`HEAD_WINDOW`
   runnable tasks of a job it takes the one whose cost sits at quantile ``p``: the
   strongest slots take the heaviest tasks (largest first, which also shortens the
   batch), the weakest the lightest. Equal costs: the earliest task (FIFO).
3. **Is this slot a straggler?** :class:`SlotStats` keeps, per slot and function, the
   seconds each unit of ``cost`` took, with exponentially decaying weights (half-life
   :data:`STATS_HALF_LIFE_S`): old samples fade, and a verdict needs at least
   :data:`STRAGGLER_MIN_COST` units of recent evidence. A slot whose seconds per unit of
   cost are over :data:`STRAGGLER_FACTOR` times the median of the *other* slots' (for the
   same function) counts at :data:`STRAGGLER_PENALTY` of its score. Normalising by cost
   means a strong slot that was given the heavy tasks is not mistaken for a slow one.

Fairness between jobs and FIFO within a job come from the run queue
(:mod:`gpumesh.coordinator.scheduler`); this module only chooses within what the queue
offers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..hardware import Slot

#: Tasks at the head of a job's queue a free slot looks at when choosing by cost or
#: skipping tasks whose GPU memory hint it cannot meet.
HEAD_WINDOW = 64
#: Half-life of a straggler sample, in seconds of coordinator time.
STATS_HALF_LIFE_S = 300.0
#: A slot is a straggler when its seconds per unit of cost exceed this many times the
#: median of the other slots' for the same function.
STRAGGLER_FACTOR = 2.5
#: Units of cost (decayed) a slot must have run, and the others too, before a verdict.
STRAGGLER_MIN_COST = 3.0
#: A straggler's score is multiplied by this when ranking slots.
STRAGGLER_PENALTY = 0.25
#: Entries whose decayed evidence falls below this are forgotten.
_FORGET_COST = 0.05
#: Smallest number of slot entries per function, and of functions, before a sweep.
_SWEEP_KEYS, _SWEEP_FNS = 64, 256

#: A slot as the statistics know it: :attr:`Slot.key`, ``(worker id, slot index)``.
SlotKey = tuple[str, int]


@dataclass
class _Acc:
    seconds: float
    cost: float
    t: float


class SlotStats:
    """Decaying seconds-per-unit-of-cost per ``(slot key, function)``. The caller passes
    the time (seconds, any monotonic clock) to every method."""

    def __init__(self, half_life_s: float = STATS_HALF_LIFE_S):
        self.half_life_s = half_life_s
        self._acc: dict[str, dict[SlotKey, _Acc]] = {}  # function -> slot key -> samples
        # Sizes at which the next sweep for faded entries runs. Doubling them after each
        # sweep keeps record() amortised O(1) on a pool of hundreds of slots, where a sweep
        # on every call would cost O(slots) per finished task.
        self._sweep_at: dict[str, int] = {}
        self._sweep_fns_at = _SWEEP_FNS

    def _decayed(self, a: _Acc, now: float) -> tuple[float, float]:
        f = 0.5 ** (max(0.0, now - a.t) / self.half_life_s)
        return a.seconds * f, a.cost * f

    def record(self, key: SlotKey, fn: str, seconds: float, cost: float, now: float) -> None:
        """``key``'s slot ran a task of function ``fn`` with ``cost`` in ``seconds``."""
        if cost <= 0 or seconds < 0 or not math.isfinite(seconds):
            return  # a free task says nothing about speed
        per_fn = self._acc.setdefault(fn, {})
        a = per_fn.get(key)
        if a is None:
            per_fn[key] = _Acc(seconds, cost, now)
        else:
            s, c = self._decayed(a, now)
            a.seconds, a.cost, a.t = s + seconds, c + cost, now
        if len(per_fn) > self._sweep_at.get(fn, _SWEEP_KEYS):  # keep memory bounded
            for k in [k for k, v in per_fn.items() if self._decayed(v, now)[1] < _FORGET_COST]:
                del per_fn[k]
            self._sweep_at[fn] = max(_SWEEP_KEYS, 2 * len(per_fn))
        if len(self._acc) > self._sweep_fns_at:
            for f in [f for f, d in self._acc.items()
                      if all(self._decayed(v, now)[1] < _FORGET_COST for v in d.values())]:
                del self._acc[f]
                self._sweep_at.pop(f, None)
            self._sweep_fns_at = max(_SWEEP_FNS, 2 * len(self._acc))

    def rate(self, key: SlotKey, fn: str, now: float) -> float | None:
        """Seconds per unit of cost, or None without enough recent evidence."""
        a = self._acc.get(fn, {}).get(key)
        if a is None:
            return None
        s, c = self._decayed(a, now)
        return s / c if c >= STRAGGLER_MIN_COST else None

    def stragglers(self, fn: str, now: float) -> set[SlotKey]:
        """Slot keys that are stragglers for ``fn`` now."""
        rates = {}
        for key in self._acc.get(fn, {}):
            r = self.rate(key, fn, now)
            if r is not None:
                rates[key] = r
        if len(rates) < 2:
            return set()
        # One sort for all slots: the median of "the others" is read off the full sorted
        # list by skipping the slot's own position (O(n log n), not O(n^2 log n)).
        ranked = sorted((r, i) for i, r in enumerate(rates.values()))
        values = [r for r, _ in ranked]
        position = {i: p for p, (_, i) in enumerate(ranked)}
        n_others = len(values) - 1

        def other(m: int, skip: int) -> float:  # m-th smallest rate among the others
            return values[m if m < skip else m + 1]

        out = set()
        for i, (key, r) in enumerate(rates.items()):
            skip, mid = position[i], n_others // 2
            median = (other(mid, skip) if n_others % 2
                      else (other(mid - 1, skip) + other(mid, skip)) / 2)
            if r > STRAGGLER_FACTOR * median:
                out.add(key)
        return out

    def forget_worker(self, worker_id: str) -> None:
        for per_fn in self._acc.values():
            for key in [k for k in per_fn if k[0] == worker_id]:
                del per_fn[key]


def strength(slot: Slot, stragglers: Iterable[SlotKey] = ()) -> float:
    """How strong a slot counts as: its device's score, penalised if it straggles."""
    s = max(0.0, float(slot.score))
    return s * STRAGGLER_PENALTY if slot.key in stragglers else s


def relative(value: float, best: float) -> float:
    """``value / best`` in [0, 1]; 1.0 when nothing has been measured yet."""
    if best <= 0:
        return 1.0
    return max(0.0, min(1.0, value / best))


def pick(candidates: Sequence[tuple[int, float]], p: float) -> int:
    """Choose among ``(position, cost)`` candidates (in queue order) for a slot of
    relative strength ``p``: the cost at quantile ``p`` of the candidates' costs, the
    earliest task with that cost. Returns the chosen position."""
    if not candidates:
        raise ValueError("no candidates")
    first_cost = candidates[0][1]
    if all(c == first_cost for _, c in candidates):
        return candidates[0][0]  # FIFO among equals
    costs = sorted({c for _, c in candidates})
    target = costs[round(p * (len(costs) - 1))]
    return next(pos for pos, c in candidates if c == target)


def order_slots(slots: Iterable[Slot], stragglers: Iterable[SlotKey] = ()) -> list[Slot]:
    """Strongest first; GPU slots before CPU slots at equal strength, then by slot id."""
    st = set(stragglers)
    return sorted(slots, key=lambda s: (-strength(s, st), s.kind == "cpu", s.id))
