"""Read-only views of the coordinator's state, in the words its API and callers see.

Plain functions over a :class:`~gpumesh.coordinator.core.Coordinator`: they look, never
change anything, so the state machine in ``core`` stays about transitions. ``Coordinator``
keeps a method for ``worker_view``, ``waiting_reason`` and ``unsatisfiable_message``,
which the routes, the dashboard and the tests call; a results page reads
:func:`closed_counts` directly.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from .. import availability, hardware
from .model import Job, Lease, Worker

if TYPE_CHECKING:  # core imports this module: no import of core at run time
    from .core import Coordinator


def running_leases(leases: Iterable[Lease]) -> list[Lease]:
    """The leases whose tasks are running: in each worker slot the one granted first; the
    others are queued behind it in that slot (``Coordinator.grant_queued``) and have not
    started. A lease whose slot is unknown (recovered after a restart) counts as running."""
    first: dict[tuple[str, int], Lease] = {}
    out = []
    for lease in leases:
        if lease.slot is None:
            out.append(lease)
            continue
        held = first.setdefault((lease.worker_id, lease.slot), lease)
        if lease.granted < held.granted:
            first[(lease.worker_id, lease.slot)] = lease
    return out + list(first.values())


def ran_in_slot(w: Worker | None, lease: Lease, now: float) -> float:
    """Seconds the task of ``lease`` ran, its result coming at ``now`` (coordinator
    clock): from its grant, or, for a grant queued behind another task in its slot, from
    that slot's previous result (``Worker.slot_free_at``), not counting the wait."""
    start = lease.granted
    if w is not None and lease.slot is not None:
        start = max(start, w.slot_free_at.get(lease.slot, start))
    return max(0.0, now - start)


def worker_view(coord: Coordinator, w: Worker) -> dict[str, Any]:
    """A worker as ``GET /v1/workers`` lists it."""
    d = dict(w.info)
    lacks = sorted(m for m, ws in coord.lacking.items() if w.id in ws and ws[w.id] is None)
    if lacks:  # modules recent jobs needed and did not find here
        d["lacks"] = lacks
    gaps = [{"module": m, "package": gap[0], "version": gap[1]}
            for m, ws in sorted(coord.lacking.items()) if (gap := ws.get(w.id)) is not None]
    if gaps:  # ... and did not find in this worker's version of their package
        d["version_gaps"] = gaps
    d.update(id=w.id, alive=w.alive, slots=w.slots, running=len(w.leases), slot_list=w.slot_list,
             busy_slots=sorted({lease.slot for tid in w.leases
                                if (lease := coord.leases.get(tid)) is not None
                                and lease.slot is not None}))
    if not d.get("scores") and not d.get("score"):
        d["score"] = None  # not measured yet: "pending", as devices() and the CLI say
    return d


def waiting_reason(coord: Coordinator, job_id: str) -> str | None:
    """Why the job's pending tasks wait although workers that could run them are
    alive: the job was recovered after a restart and its caller is not back yet
    (:mod:`.callers`), or every such worker (or GPU) is closed by its owner's rules.
    None otherwise."""
    if job_id in coord.callers.held:
        return (f"waiting for its caller: the coordinator restarted, and the call's tasks "
                f"start once its caller polls again (cancelled if it has not within "
                f"{coord.callers.timeout:g}s of the restart)")
    closed = closed_for(coord, job_id)
    if not closed:
        return None
    return "waiting: every worker that can run it is unavailable: " + "; ".join(
        f"{w.info.get('hostname') or w.id} [{', '.join(availability.labels(w.info))}]"
        for w, _ in closed)


def closed_counts(coord: Coordinator, job_id: str) -> dict[str, int] | None:
    """What a results page says of a job that waits only for its owners' rules: how many
    of the workers that could run its pending tasks are closed in each state
    (``{"paused": 1}``; see :func:`closed_for`). None when it does not wait so."""
    closed = closed_for(coord, job_id)
    return dict(Counter(state for _, state in closed)) if closed else None


def closed_for(coord: Coordinator, job_id: str) -> list[tuple[Worker, str]]:
    """The alive workers that could run the job's pending tasks, each with the state that
    closes it to them (``paused``, ``outside_hours``, else its GPU's ``yielding``, ``hot``
    or ``power``), when every one of them is closed by its owner's rules. Empty when the
    job has no pending task, when one of them has an open slot for it (it only waits its
    turn), or when none could run it (that is the callers' ``workers_able``). A worker
    that lacks a module the job imports (:meth:`Job.excludes`) could not run it."""
    job = coord.jobs.get(job_id)
    if job is None or not coord.queue.pending(job_id):
        return []
    out = []
    for w in coord.alive_workers():
        if job.excludes(w.id):  # (it lacks a module the job's tasks import: never again)
            continue
        closed = availability.closed_slots(w.info, w.slot_list)
        fits = [v for v in w.slot_views() if not job.lane
                or hardware.refusal(job.lane, v, ever=True) is None]
        if not fits:
            continue
        if any(v.id not in closed for v in fits):
            return []  # somewhere to run: it only waits its turn
        out.append((w, _closed_state(w.info, fits)))
    return out


def _closed_state(info: dict[str, Any], fits: list[hardware.Slot]) -> str:
    """The state of a closed worker (its owner's) or of the first of its GPUs in ``fits``."""
    if info.get("owner"):
        return str(info["owner"].get("state"))
    for v in fits:
        state = availability.device_state(info, f"cuda:{v.gpu}") if v.gpu is not None else None
        if state:
            return str(state.get("state"))
    return "closed"  # (closed_slots closes only those two ways)


def unsatisfiable_message(coord: Coordinator, req: hardware.Requirements, hint: float | None) -> str:
    """Why no alive worker can ever run a job with requirements ``req`` and largest
    ``gpu_memory_mb`` hint ``hint``: the text of the ``Unsatisfiable`` refusal."""
    alive = coord.alive_workers()
    if req.python and not any(s.python in ("", req.python) for w in alive for s in w.slot_views()):
        # The one refusal that is about software: say so in its own words.
        others = sorted({f"Python {w.info.get('python', '?')} ({w.info.get('hostname', w.id)})"
                         for w in alive})
        return (f"this call ships code by value (a function, lambda or class defined in "
                f"__main__, a notebook or a closure), whose bytecode only loads on the Python "
                f"that made it: the caller runs Python {req.python} and the alive workers run "
                f"{', '.join(others)}; join a worker running Python {req.python}, or run the "
                f"caller on the workers' Python")
    if req.requires:
        from ..packages import unmet
        lacking = [(w, unmet(req.requires, w.info.get("packages") or {})) for w in alive
                   if not w.info.get("allow_installs")]
        if len(lacking) == len(alive) and all(missing for _, missing in lacking):
            who = "; ".join(f"{w.info.get('hostname', '?')} ({w.id}) lacks {', '.join(missing)}"
                            for w, missing in lacking)
            return (f"no alive worker has {', '.join(req.requires)} or allows installs: {who}; "
                    f"join a worker with `gpumesh join --allow-installs` (it builds the "
                    f"environment with uv) or install them on a worker")
    wants = req.describe() if req else ""
    if hint:
        wants = (wants + ", " if wants else "") + f"gpu_memory_mb={hardware.format_mib(hint)}"
    pool = [coord.worker_view(w) for w in coord.alive_workers()]
    return (f"no alive worker can ever run this job ({wants}); "
            f"{hardware.describe_pool(pool, bool(req.python), tuple(req.requires or ()))}")


def missing_module_message(coord: Coordinator, job: Job, module: str) -> str:
    """The final error of a task whose ``module`` no worker that could run ``job`` has:
    names the module and each worker that lacks it (host, id, Python); a worker whose
    version of the module's package has no such module (a version gap) is named with
    that version, and then the error says what to do about versions instead."""
    lacking: list[tuple[str, None]] = []
    gaps: list[tuple[str, tuple[str, str]]] = []
    for wid, gap in sorted(job.lacking[module].items()):
        if gap is None:
            lacking.append((_who(coord, wid), None))
        else:
            gaps.append((_who(coord, wid), gap))
    absent = (f"{', '.join(who for who, _ in lacking)} lack{'s' if len(lacking) == 1 else ''} it"
              if lacking else "")
    if not gaps:
        from ..packages import INSTALL_ADVICE
        return (f"No module named {module!r} on any worker that could run this task: {absent}; "
                f"{INSTALL_ADVICE}")
    package = gaps[0][1][0]
    have = "; ".join([f"{who} has {gap[0]} {gap[1]}" for who, gap in gaps] + ([absent] if absent else []))
    return (f"No module named {module!r} in the version of {package} on any worker that could "
            f"run this task ({have}): the caller's {package} is likely another version, one "
            f"that has it. Install the same {package} version on the caller and the workers, or "
            f"call with requires=[\"{package}==<the caller's version>\"] "
            f"on workers joined with --allow-installs")


def unable_message(coord: Coordinator, job: Job) -> str:
    """The final error of a task that no alive worker able to run ``job`` can run: names
    each worker kept off it (host, id, Python) and why (:attr:`Job.unable`)."""
    why = "; ".join(f"{_who(coord, wid)} {reason}" for wid, reason in sorted(job.unable.items()))
    return (f"no alive worker could run this task: {why}; join a worker that can (for "
            f"requires=, one whose Python the packages support), or change what the call needs")


def _who(coord: Coordinator, wid: str) -> str:
    """A worker as a final error names it: host, id and Python."""
    w = coord.workers.get(wid)
    return (f"{w.info.get('hostname', '?') if w else '?'} ({wid}, "
            f"Python {w.info.get('python', '?') if w else '?'})")


def attempt_logs(coord: Coordinator, job_id: str, task: dict[str, Any],
                 tail: int | None = None) -> list[dict[str, Any]]:
    """A task's output attempt by attempt (``tail``: only the last that many bytes of each
    stream): ``[{"attempt", "worker", "hostname", "ended",
    "stdout", "stderr"}]``; ``ended`` says why an earlier attempt ended without a result
    (from the task's history), and is the task's state for its last attempt."""
    history = {h.get("attempt"): h for h in task.get("history") or ()}
    out = []

    def text(stream: str, k: int) -> str:
        data = coord.output.task_log(job_id, task["id"], stream, k)
        return (data if tail is None else data[-tail:]).decode("utf-8", "replace")

    for k in range(1, max(int(task["attempts"] or 0), 1) + 1):
        h = history.get(k)
        last = h is None and k == task["attempts"]
        worker = h.get("worker") if h else (task["worker_id"] if last else None)
        if h:
            hostname = h.get("hostname")
        else:  # the current attempt has no history entry: name its worker as history would
            w = coord.workers.get(worker) if worker else None
            hostname = w.hostname if w is not None else None
        out.append({"attempt": k, "worker": worker, "hostname": hostname,
                    "ended": h.get("ended") if h else task["state"],
                    "stdout": text("stdout", k), "stderr": text("stderr", k)})
    return out
