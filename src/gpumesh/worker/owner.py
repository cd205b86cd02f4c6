"""The machine's owner stays in charge: what a worker shares, when, and when it yields.

Pure decisions, no I/O: :class:`OwnerState` is fed the time (an injectable clock) and GPU
readings (:class:`GpuReading`) and answers, for the worker and each GPU, whether new tasks
may start there and whether running ones must be handed back. The agent
(:mod:`gpumesh.worker.agent`) acts on the answers; the control channel
(:mod:`gpumesh.worker.control`) turns ``gpumesh pause`` / ``resume`` into calls here.

Rules, each off unless set (the defaults are a worker that shares everything, always):

=====================  ===========================================================
rule                   effect
=====================  ===========================================================
pause (``--now``)      no new tasks; with ``now`` running ones are handed back
``hours``              outside every window no new tasks; running ones finish, or
                       are handed back with ``at_window_end="requeue"``
``yield_gpu``          a GPU that another process uses above ``busy_threshold``
                       takes no new task; after ``yield_grace_s`` its running one is
                       handed back; it reopens after as long a quiet spell
``max_temp_c``         at or above it a GPU takes no new task; it reopens at
                       ``max_temp_c - TEMP_HYSTERESIS_C`` or below
``max_power_w``        the same for power draw, reopening below
                       ``max_power_w * POWER_HYSTERESIS``
=====================  ===========================================================

Hour windows are local time: ``"22:00-08:00"`` (every day; a window that passes midnight
belongs to the day it starts on), ``"mon-fri 19:00-23:30"``, ``"sat,sun 00:00-24:00"``.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta

#: A hot GPU reopens this many degrees Celsius below ``max_temp_c``.
TEMP_HYSTERESIS_C = 5.0
#: A GPU over its power cap reopens below this fraction of ``max_power_w``.
POWER_HYSTERESIS = 0.9
#: Default ``yield_grace_s``: seconds a busy GPU's running task may go on before it is
#: handed back (a game's loading screen should not kill an hour of work at once).
DEFAULT_YIELD_GRACE_S = 30.0
#: Default ``busy_threshold``: other processes' GPU utilisation that means "in use".
DEFAULT_BUSY_THRESHOLD = "10%"

DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
_TIME = re.compile(r"^([01]?[0-9]|2[0-4]):([0-5][0-9])$")
_DURATION = re.compile(r"^(?:(\d+(?:\.\d+)?)d)?(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?"
                       r"(?:(\d+(?:\.\d+)?)s)?$")


def clock_time(when: float, now: float | None = None) -> str:
    """The local time of the epoch seconds ``when`` as a person reads it next to "until":
    ``12:09:20`` within the hour (a pause of 20 s must not read "until 12:09"), ``19:00``
    within the day, ``Mon 19:00`` beyond."""
    ahead = when - (time.time() if now is None else now)
    fmt = "%H:%M:%S" if ahead < 3600 else "%H:%M" if ahead < 86400 - 3600 else "%a %H:%M"
    return time.strftime(fmt, time.localtime(when))


# ---------------------------------------------------------------- parsing -------------
def parse_duration(text: str, setting: str = "duration") -> float:
    """``"2h"``, ``"90m"``, ``"1h30m"``, ``"45s"``, ``"1d"`` or plain seconds -> seconds.
    Raises ``ValueError`` naming ``setting`` for anything else or for zero."""
    raw = str(text).strip().lower()
    try:
        seconds = float(raw)
    except ValueError:
        m = _DURATION.match(raw)
        if not raw or not m or not any(m.groups()):
            raise ValueError(f"{setting}={text!r} is not a duration: write e.g. 2h, 30m, 1h30m "
                             "or 45s") from None
        d, h, mi, s = (float(g) if g else 0.0 for g in m.groups())
        seconds = d * 86400 + h * 3600 + mi * 60 + s
    if not 0 < seconds <= 366 * 86400:
        raise ValueError(f"{setting}={text!r} must be more than 0 and at most a year")
    return seconds


def _minutes(text: str, setting: str, whole: str) -> int:
    m = _TIME.match(text)
    if not m or (int(m.group(1)) == 24 and m.group(2) != "00"):
        raise ValueError(f"{setting}={whole!r}: {text!r} is not a time of day (HH:MM, 00:00 to 24:00)")
    return int(m.group(1)) * 60 + int(m.group(2))


def _days(text: str, setting: str, whole: str) -> frozenset[int]:
    out: set[int] = set()
    for part in text.lower().split(","):
        ends = part.split("-")
        if len(ends) > 2 or not all(e in DAYS for e in ends):
            raise ValueError(f"{setting}={whole!r}: {part!r} is not a day or a range of days "
                             "(mon, tue, ..., sun; e.g. mon-fri or sat,sun)")
        a, b = DAYS.index(ends[0]), DAYS.index(ends[-1])
        out.update(range(a, b + 1) if a <= b else [*range(a, 7), *range(0, b + 1)])
    return frozenset(out)


@dataclass(frozen=True)
class Window:
    """A weekly time window: ``days`` (0 = Monday; None: every day), ``start``/``end`` in
    minutes after midnight, local time. ``end <= start`` passes midnight."""

    start: int
    end: int
    days: frozenset[int] | None = None
    text: str = ""

    @classmethod
    def parse(cls, text: str, setting: str = "hours") -> Window:
        """``"22:00-08:00"`` or ``"mon-fri 19:00-23:30"``; ``ValueError`` naming ``setting``."""
        words = str(text).split()
        if len(words) not in (1, 2) or words[-1].count("-") != 1:
            raise ValueError(f"{setting}={text!r} is not a time window: write e.g. 22:00-08:00 "
                             "or mon-fri 19:00-23:30")
        a, b = words[-1].split("-")
        start, end = _minutes(a, setting, text), _minutes(b, setting, text)
        if start == 24 * 60:
            raise ValueError(f"{setting}={text!r}: a window cannot start at 24:00")
        if start == end:
            raise ValueError(f"{setting}={text!r} is empty (it starts where it ends); "
                             "write 00:00-24:00 for the whole day")
        days = _days(words[0], setting, text) if len(words) == 2 else None
        return cls(start, end, days, " ".join(words))

    def contains(self, when: datetime) -> bool:
        """Whether the local time ``when`` is inside this window."""
        m, day = when.hour * 60 + when.minute, when.weekday()
        if self.start < self.end:
            return self.start <= m < self.end and (self.days is None or day in self.days)
        # past midnight: the small hours belong to the day before
        if m >= self.start:
            return self.days is None or day in self.days
        return m < self.end and (self.days is None or (day - 1) % 7 in self.days)


@dataclass(frozen=True)
class Threshold:
    """When another process "uses" a GPU: utilisation ``percent`` or memory ``mib``."""

    percent: float | None = None
    mib: float | None = None

    @classmethod
    def parse(cls, text, setting: str = "busy_threshold") -> Threshold:
        """``"10%"`` (utilisation) or a memory size ``"500MiB"``/``"2GB"``."""
        from ..hardware import MiB, parse_memory
        raw = str(text).strip()
        if raw.endswith("%"):
            try:
                pct = float(raw[:-1])
            except ValueError:
                pct = -1.0
            if not 0 < pct <= 100:
                raise ValueError(f"{setting}={text!r}: a utilisation must be more than 0% and at most 100%")
            return cls(percent=pct)
        try:
            return cls(mib=parse_memory(raw, setting) / MiB)
        except ValueError:
            raise ValueError(f"{setting}={text!r} is neither a utilisation (e.g. 10%) nor a "
                             "memory size (e.g. 500MiB)") from None

    def exceeded(self, reading: GpuReading) -> bool:
        if self.percent is not None:
            return (reading.other_util_pct or 0) >= self.percent
        return (reading.other_mb or 0) >= (self.mib or 0)

    def __str__(self) -> str:
        return f"{self.percent:g}%" if self.percent is not None else f"{self.mib:g}MiB"


@dataclass(frozen=True)
class Policy:
    """The owner's rules (see the module docstring). Memory in MiB, times in seconds,
    temperature in degrees Celsius, power in watts."""

    gpus: tuple[int, ...] | None = None  # which GPUs are shared (None: all; (): none)
    max_gpu_memory_mb: int | None = None
    hours: tuple[Window, ...] = ()
    at_window_end: str = "finish"
    yield_gpu: bool = False
    busy_threshold: Threshold = field(default_factory=lambda: Threshold(percent=10.0))
    yield_grace_s: float = DEFAULT_YIELD_GRACE_S
    max_temp_c: float | None = None
    max_power_w: float | None = None

    @property
    def watches_gpus(self) -> bool:
        """Whether the rules need GPU readings at run time."""
        return self.yield_gpu or self.max_temp_c is not None or self.max_power_w is not None


@dataclass(frozen=True)
class GpuReading:
    """One GPU as last read: other processes' (not gpumesh's tasks') utilisation in % and
    memory in MiB, temperature in degrees Celsius, power draw in watts; None: unknown."""

    index: int
    other_util_pct: float | None = None
    other_mb: float | None = None
    temp_c: float | None = None
    power_w: float | None = None


@dataclass(frozen=True)
class Decision:
    """What the rules say now.

    ``worker``: ``{"state", "label"}`` when the whole worker takes no new tasks (paused,
    outside hours), else None; ``gpus``: the same per GPU index that takes none;
    ``hand_back_all``: running tasks everywhere must go back; ``hand_back_gpus``: those
    on these GPUs must."""

    worker: dict | None = None
    gpus: dict[int, dict] = field(default_factory=dict)
    hand_back_all: bool = False
    hand_back_gpus: frozenset[int] = frozenset()

    def open(self, gpu: int | None) -> bool:
        """Whether a slot (on GPU ``gpu``; None: a CPU slot) may start a new task."""
        return self.worker is None and (gpu is None or gpu not in self.gpus)

    def hand_back(self, gpu: int | None) -> bool:
        return self.hand_back_all or (gpu is not None and gpu in self.hand_back_gpus)


def _state(state: str, label: str, **extra) -> dict:
    return {"state": state, "label": label, **extra}


class OwnerState:
    """The rules over time. ``clock``: epoch seconds (injectable); ``localtime``: epoch
    seconds -> local :class:`datetime` (injectable, e.g. to fix the time zone).
    Not thread-safe: the agent calls it under its own lock."""

    def __init__(self, policy: Policy | None = None, clock=time.time,
                 localtime=datetime.fromtimestamp):
        self.policy = policy or Policy()
        self.clock, self.localtime = clock, localtime
        self.paused = False
        self.paused_now = False  # running tasks go back too
        self.paused_until: float | None = None
        self._busy_since: dict[int, float] = {}
        self._quiet_since: dict[int, float] = {}
        self._yielding: set[int] = set()
        self._hot: dict[int, float] = {}
        self._power: dict[int, float] = {}
        self._readings: dict[int, GpuReading] = {}

    # -- the owner's commands -------------------------------------------------------
    def pause(self, now: bool = False, for_s: float | None = None) -> None:
        """Pause (again: the newest command wins); ``for_s``: resume by itself after."""
        self.paused, self.paused_now = True, bool(now)
        self.paused_until = None if for_s is None else self.clock() + for_s

    def resume(self) -> bool:
        """Lift a pause. Returns whether there was one."""
        was = self.paused
        self.paused, self.paused_now, self.paused_until = False, False, None
        return was

    # -- readings ---------------------------------------------------------------------
    def in_hours(self) -> bool:
        hours = self.policy.hours
        if not hours:
            return True
        when = self.localtime(self.clock())
        return any(w.contains(when) for w in hours)

    def next_open(self) -> float | None:
        """Epoch seconds when the next hour window opens (the start of the first window,
        within a week, that the time is not already inside of); None without windows."""
        hours = self.policy.hours
        if not hours:
            return None
        # From the whole second: a window opens on a whole second, and the offset to it
        # from a whole second is whole seconds, so the sum is exact. From the clock's
        # fraction it was not (a datetime keeps microseconds, a float of 1.8e9 s about
        # 0.2 us): 03:00 came out as 02:59:59.9999998, which "until 02:59" truncated.
        now = float(math.floor(self.clock()))
        when = self.localtime(now)
        midnight = when.replace(hour=0, minute=0, second=0, microsecond=0)
        starts = sorted(midnight + timedelta(days=d, minutes=w.start)
                        for d in range(-1, 9) for w in hours)
        for start in starts:
            if start > when and any(w.contains(start) for w in hours):
                # (as an offset from now: local times that a clock change repeats or
                # skips move it by an hour at worst)
                return now + (start - when).total_seconds()
        return None

    def decide(self, readings: dict[int, GpuReading] | None = None) -> Decision:
        """The decision for now; ``readings`` (by GPU index) update the GPU rules, None
        keeps the last ones."""
        now = self.clock()
        if readings is not None:
            self._readings = dict(readings)
            self._update_gpus(now)
        if self.paused and self.paused_until is not None and now >= self.paused_until:
            self.resume()
        worker, hand_back_all = None, False
        if self.paused:
            extra = {"until": self.paused_until} if self.paused_until is not None else {}
            worker, hand_back_all = _state("paused", "paused: owner", **extra), self.paused_now
        elif not self.in_hours():
            opens = self.next_open()
            worker = _state("outside_hours", "outside hours",
                            **({"until": opens} if opens is not None else {}))
            hand_back_all = self.policy.at_window_end == "requeue"
        gpus: dict[int, dict] = {}
        for i in sorted(self._readings):
            if i in self._yielding:
                gpus[i] = _state("yielding", "yielding: GPU busy")
            elif i in self._hot:
                gpus[i] = _state("hot", f"hot {self._hot[i]:.0f}C")
            elif i in self._power:
                gpus[i] = _state("power", f"power {self._power[i]:.0f}W")
        grace = self.policy.yield_grace_s
        back = frozenset(i for i, since in self._busy_since.items()
                         if i in self._yielding and now - since >= grace)
        return Decision(worker, gpus, hand_back_all, back)

    def _update_gpus(self, now: float) -> None:
        p = self.policy
        for i, r in self._readings.items():
            if p.yield_gpu:
                if p.busy_threshold.exceeded(r):
                    self._busy_since.setdefault(i, now)
                    self._quiet_since.pop(i, None)
                    self._yielding.add(i)
                elif i in self._yielding:
                    # reopen only after a quiet spell as long as the grace: a game that
                    # idles for a second between levels is still the owner's
                    self._busy_since.pop(i, None)
                    quiet = self._quiet_since.setdefault(i, now)
                    if now - quiet >= p.yield_grace_s:
                        self._yielding.discard(i)
                        self._quiet_since.pop(i, None)
            if p.max_temp_c is not None and r.temp_c is not None:
                if r.temp_c >= p.max_temp_c:
                    self._hot[i] = r.temp_c
                elif i in self._hot:
                    if r.temp_c <= p.max_temp_c - TEMP_HYSTERESIS_C:
                        del self._hot[i]
                    else:
                        self._hot[i] = r.temp_c  # still cooling down: show the new figure
            if p.max_power_w is not None and r.power_w is not None:
                if r.power_w >= p.max_power_w:
                    self._power[i] = r.power_w
                elif i in self._power:
                    if r.power_w < p.max_power_w * POWER_HYSTERESIS:
                        del self._power[i]
                    else:
                        self._power[i] = r.power_w


# ---------------------------------------------------------------- what is shared -------
def share_gpus(gpus: list[dict], policy: Policy, setting: str = "gpus") -> list[dict]:
    """The GPUs this worker offers under ``policy``: those named by ``policy.gpus`` (in
    the order detected), each with its memory capped at ``max_gpu_memory_mb`` (so the
    coordinator never sends a task that needs more). Raises ``ValueError`` naming the
    setting for a GPU index the machine does not have."""
    out = list(gpus)
    if policy.gpus is not None:
        have = {g["index"] for g in gpus}
        missing = [i for i in policy.gpus if i not in have]
        if missing:
            raise ValueError(f"{setting}: this machine has no GPU {missing[0]} (it has "
                             f"{', '.join(map(str, sorted(have))) or 'none'})")
        out = [g for g in gpus if g["index"] in policy.gpus]
    return [cap_memory(g, policy.max_gpu_memory_mb) for g in out]


def cap_memory(gpu: dict, cap_mb: int | None) -> dict:
    """``gpu`` as the coordinator should see it with ``cap_mb`` MiB usable: its total is
    the cap, its free memory what is free of the cap (never more than really is free)."""
    if cap_mb is None:
        return gpu
    total = int(gpu.get("memory_total_mb") or 0)
    free = int(gpu.get("memory_free_mb", total) or 0)
    usable = min(total, cap_mb) if total else cap_mb
    return {**gpu, "memory_total_mb": usable, "memory_free_mb": max(0, min(free, usable))}


def cap_free(free_mb: dict[int, int], cap_mb: int | None) -> dict[int, int]:
    """Free MiB per GPU as reported under a cap of ``cap_mb`` usable MiB."""
    if cap_mb is None:
        return free_mb
    return {i: max(0, min(mb, cap_mb)) for i, mb in free_mb.items()}


__all__ = ["Decision", "GpuReading", "OwnerState", "Policy", "Threshold", "Window", "cap_free",
           "cap_memory", "parse_duration", "share_gpus"]
