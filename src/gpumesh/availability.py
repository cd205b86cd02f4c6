"""Whether a worker, or one of its GPUs, takes new tasks now, and why not.

A worker's owner rules (:mod:`gpumesh.worker.owner`) may close the whole worker
(``paused``, ``outside_hours``) or single GPUs (``yielding``, ``hot``, ``power``). The worker
reports it with its heartbeats as ``owner`` (``{"state", "label", "until"?}`` or null) and
``gpu_states`` (``{"<gpu index>": {"state", "label"}}``); the coordinator grants a closed
slot nothing, and listings show the labels: ``[paused: owner]``, ``[outside hours]``,
``[yielding: GPU busy]``, ``[hot 83C]``. A caller whose tasks only closed workers could
run hears how many wait in each state (:func:`describe_closed`). Pure functions, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

WORKER_STATES = ("paused", "outside_hours")
GPU_STATES = ("yielding", "hot", "power")
#: Longest state label the coordinator accepts from a worker; workers send short fixed
#: phrases, so this only bounds what a malformed heartbeat may carry.
_MAX_LABEL = 80


def _check_state(value, allowed: tuple[str, ...], field: str) -> dict:
    if not isinstance(value, Mapping) or set(value) - {"state", "label", "until"}:
        raise ValueError(f"field {field!r} must be an object with 'state' and 'label'")
    state, label = value.get("state"), value.get("label")
    if state not in allowed:
        raise ValueError(f"field {field}.state must be one of {', '.join(allowed)}")
    if not isinstance(label, str) or not 0 < len(label) <= _MAX_LABEL or not label.isprintable():
        raise ValueError(f"field {field}.label must be a short printable string")
    out = {"state": state, "label": label}
    until = value.get("until")
    if until is not None:
        if isinstance(until, bool) or not isinstance(until, (int, float)) or not 0 <= until < 1e11:
            raise ValueError(f"field {field}.until must be a time in epoch seconds")
        out["until"] = float(until)
    return out


def check_owner(value, field: str = "owner") -> dict | None:
    """A worker's own state as a heartbeat carries it (None: open)."""
    return None if value is None else _check_state(value, WORKER_STATES, field)


def check_gpu_states(value, field: str = "gpu_states") -> dict[str, dict]:
    """``{"0": {"state": "hot", "label": "hot 83C"}}``: the GPUs that take no new task."""
    if not isinstance(value, Mapping) or len(value) > 256:
        raise ValueError(f"field {field!r} must be an object mapping GPU index to a state")
    out = {}
    for k, v in value.items():
        if not (isinstance(k, str) and k.isdigit() and len(k) <= 3):
            raise ValueError(f"field {field}: {str(k)[:20]!r} is not a GPU index")
        out[k] = _check_state(v, GPU_STATES, f"{field}.{k}")
    return out


def closed_slots(info: Mapping, slot_list: Sequence[Mapping]) -> set[int]:
    """Ids of the slots of a worker (``info`` as registered/heartbeated) that take no new
    task: all of them while the worker is closed, else those on a closed GPU."""
    if info.get("owner"):
        return {int(s["id"]) for s in slot_list}
    gpus = info.get("gpu_states") or {}
    return {int(s["id"]) for s in slot_list if s.get("kind") == "cuda" and str(s.get("gpu")) in gpus}


def labels(worker: Mapping) -> list[str]:
    """What a listing shows after a worker: its state, then each closed GPU's
    (``"cuda:0 yielding: GPU busy"`` when it has several GPUs)."""
    out = []
    if worker.get("owner"):
        out.append(str(worker["owner"].get("label")))
    states = worker.get("gpu_states") or {}
    several = len(worker.get("gpus") or ()) > 1
    for k in sorted(states, key=lambda k: int(k)):
        label = str(states[k].get("label"))
        out.append(f"cuda:{k} {label}" if several else label)
    return out


#: A caller's words for workers closed in each state: (one worker, several).
_CLOSED_WORDS = {
    "paused": ("worker paused by its owner", "workers paused by their owners"),
    "outside_hours": ("worker outside its lending hours", "workers outside their lending hours"),
    "yielding": ("worker whose GPU its owner is using", "workers whose GPUs their owners are using"),
    "hot": ("worker whose GPU is too hot", "workers whose GPUs are too hot"),
    "power": ("worker whose GPU is at its power limit", "workers whose GPUs are at their power limits"),
}


def describe_closed(counts: Mapping[str, int]) -> str:
    """``{"paused": 1, "hot": 2}`` (a results page's ``workers_closed``) ->
    ``"1 worker paused by its owner, 2 workers whose GPUs are too hot"``. A state this
    version does not know (a newer coordinator's) is named as it came."""
    known = WORKER_STATES + GPU_STATES
    parts = []
    for state in sorted(counts, key=lambda k: (known.index(k) if k in known else len(known), k)):
        n = counts[state]
        name = state[:40] if state.isprintable() else "?"
        one, many = _CLOSED_WORDS.get(state, (f"worker closed by its owner ({name})",
                                              f"workers closed by their owners ({name})"))
        parts.append(f"{n} {one if n == 1 else many}")
    return ", ".join(parts)


def device_state(worker: Mapping, device: str) -> dict | None:
    """The state of one device of ``worker`` (``"cuda:N"``, ``"cpu"``...) that takes no
    new task, else None."""
    if worker.get("owner"):
        return dict(worker["owner"])
    if device.startswith("cuda:"):
        got = (worker.get("gpu_states") or {}).get(device[5:])
        return dict(got) if got else None
    return None
