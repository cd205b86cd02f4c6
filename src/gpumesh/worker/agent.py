"""The worker agent: register, heartbeat, lease tasks by long-poll, run them, post results.

::

    register ─► heartbeat thread (every HEARTBEAT_INTERVAL_S: "these tasks are running";
    │           answers carry task ids to cancel)
    ▼
    lease loop: POST /lease {free: [slot ids]} (long-poll) ─► each granted task to its slot's thread:
                fetch function blob (cached by sha256) ─► Executor.run ─► POST result
                (retried with backoff until accepted or refused as stale)
    scorer: after joining, benchmark the devices in a separate process while no task runs

Slots: one per GPU (its tasks run with ``CUDA_VISIBLE_DEVICES=<that GPU>``), then the
CPU slots (their tasks see no GPU on a machine that has some). Each granted task names
the slot it was granted for; its result asks for that slot's next task.

Whenever the coordinator is unreachable every loop backs off (bounded exponential with
full jitter) and retries; when the coordinator says it does not know this worker (it
restarted) the agent registers again under the same id, keeping running tasks. On
stop (Ctrl+C / SIGTERM) it kills its task processes, deregisters so the coordinator
re-queues at once, and exits.
"""

from __future__ import annotations

import json
import logging
import queue
import random
import shutil
import threading
import time
from pathlib import Path

from .. import hardware, limits, packages, protocol, tracing, versions, wire
from ..handoff import Handoff, new_name
from ..payloadref import PayloadRef
from .._version import __version__
from ..errors import AuthError, LockedOut, RequestRejected, WireError
from ..limits import (BACKOFF_BASE_S, BACKOFF_MAX_S, HEARTBEAT_INTERVAL_S, JOIN_BACKOFF_MAX_S,
                      JOIN_HINT_AFTER, JOIN_PATIENCE_S, LONG_POLL_S, OUTPUT_BODY_BYTES,
                      OUTPUT_FLUSH_S, SESSION_PING_S, WARM_IDLE_S)
from ..transport import Transport, Unreachable
from . import procs, tempdirs
from .device import GpuMonitor
from .envs import EnvCache, InstallError
from .executor import Outcome, make_executor
from .fncache import FunctionCache
from .outputs import OutputCursor
from .lending import OwnerRules
from .owner import OwnerState, cap_free
from .poster import ResultPoster
from .scoring import Scorer, describe

log = logging.getLogger("gpumesh.worker")


def backoff_delays(base: float = BACKOFF_BASE_S, cap: float = BACKOFF_MAX_S):
    """Full-jitter exponential backoff (AWS architecture blog, "Exponential Backoff and
    Jitter"): attempt k sleeps uniform(0, min(cap, base * 2**k)) seconds."""
    k = 0
    while True:
        yield random.uniform(0, min(cap, base * (2 ** k)))
        k = min(k + 1, 30)


class WorkerAgent(OwnerRules):
    """One worker process's agent.

    ``url``/``token``: the coordinator. ``slots``: CPU slots (tasks run at once besides
    one per GPU). ``info``: the device description sent at registration (see
    :func:`gpumesh.worker.device.detect`); its ``gpus`` and ``mps`` decide the GPU slots.
    ``bench``: measure the devices' scores after joining (off: scores stay 0).
    ``on_event(kind, text)`` receives user-facing lines (``joined``, ``reconnected``...).
    ``owner``: the machine owner's rules (:class:`gpumesh.worker.owner.OwnerState`;
    default: share everything, always); ``gpumesh pause`` reaches them via :meth:`control`.
    """

    def __init__(self, url: str, token: str, *, slots: int = 1, info: dict | None = None,
                 cache_dir: Path | None = None, worker_id: str | None = None,
                 on_event=None, fingerprint: str | None = None, bench: bool = True,
                 owner: OwnerState | None = None, allow_installs: bool = False,
                 runtime: str | None = None):
        self.url = url
        self.http = Transport(url, token, fingerprint=fingerprint)  # fingerprint: TLS pin
        self.info = dict(info or {})
        self.info.setdefault("version", __version__)
        self._packages = packages.Inventory()  # reported at join, again when they change
        self.info.setdefault("packages", self._packages.current)
        # requires=: build task environments (gpumesh.worker.envs) only if the owner said so.
        self.info["allow_installs"] = bool(allow_installs)
        self.envs = EnvCache() if allow_installs else None
        gpus = [g for g in self.info.get("gpus") or () if isinstance(g, dict)]
        self.slot_list = hardware.slot_list(gpus, slots, bool(self.info.get("mps")))
        if not self.slot_list:
            raise ValueError("a worker needs at least one slot (a GPU or a CPU slot)")
        self.slots = len(self.slot_list)
        self._slot_env = {s["id"]: self._env_for(s, bool(gpus)) for s in self.slot_list}
        self._gpus = GpuMonitor([g["index"] for g in gpus])
        self._scores: dict[str, float] = {}
        self.scorer = Scorer([g["index"] for g in gpus], bool(self.info.get("mps")),
                             self._on_scores) if bench else None
        self.id: str | None = worker_id
        self.on_event = on_event or (lambda kind, text: log.info(text))
        self._own_cache = cache_dir is None
        self._cache_lock = None
        if cache_dir is None:  # (and remove the directories of workers that were killed)
            cache_dir, self._cache_lock = tempdirs.create()
        self.cache = Path(cache_dir)
        self.stopping = threading.Event()
        self._locked_until = 0.0  # until when the coordinator refuses this address (LockedOut)
        self._away = False  # the coordinator stopped answering (said once per outage)
        # runtime: fork or spawn (None: $GPUMESH_RUNTIME, else the platform's default)
        self.executor = make_executor(runtime, self.cache / "spool", self.cache / "tmp",
                                      procs.thread_env(self.info.get("cores"), len(self.slot_list)))
        #: Function blobs by sha256, fetched once, bounded (gpumesh.worker.fncache).
        self.functions = FunctionCache(
            self.cache / "fn", lambda h: self.http.stream_into("GET", protocol.blob(h), timeout=600),
            limits.setting("GPUMESH_FN_CACHE_MB"), WARM_IDLE_S, self.executor.functions_in_use)
        self._busy = {s["id"]: 0 for s in self.slot_list}  # tasks holding (or polls reserving) a slot
        self._free_cv = threading.Condition()
        self._reg_lock = threading.Lock()
        self._registered = threading.Event()
        #: Tasks this worker holds a lease for, from the moment they arrive until their
        #: result is delivered (argument download, run and result upload included).
        self._held: set[str] = set()
        # Set while a lease answer's body is arriving: its tasks are not held yet, and the
        # heartbeat says so, or a slow link's big answer would look forgotten (see there).
        self._receiving = threading.Event()
        self._output: dict[str, OutputCursor] = {}
        self._slot_inbox: dict[int, queue.SimpleQueue] = {}  # grants for each slot's thread
        #: The coordinator's payload directories when it shares this machine and user
        #: (big arguments and results then change hands as files; gpumesh.handoff).
        self.handoff: Handoff | None = None
        #: Posts results several per request once the coordinator offers it (None: one
        #: request per result, as to a coordinator from before ``result_batch``).
        self.poster: ResultPoster | None = None
        self._init_owner(owner or OwnerState(), gpus)  # the owner's rules (gpumesh.worker.lending)

    # ------------------------------------------------------------------ lifecycle ---
    def run(self) -> None:
        """Run until :meth:`stop`. Raises ``AuthError`` if the token is refused."""
        # Everything inside the try: a Ctrl+C while it still waits for the coordinator, or
        # just after joining, must clean up (its temporary directory) like a later one.
        try:
            self._register(first=True)
            self._announce_start()
            for target, name in ((self._heartbeat_loop, "heartbeat"), (self._session_loop, "session"),
                                 (self._output_loop, "output"), (self._owner_loop, "owner")):
                threading.Thread(target=target, name=name, daemon=True).start()
            if self.scorer is not None:
                self.scorer.stopping = self.stopping
                self.scorer.start()  # after joining: the first task never waits for it
            self._lease_loop()
        finally:
            self._shutdown()

    def stop(self) -> None:
        self.stopping.set()

    def _shutdown(self) -> None:
        # Leave first, so the coordinator re-queues our tasks at once and fences off any
        # result a dying task might still post; then kill the task processes.
        if self.id is not None and self._registered.is_set():
            try:
                self.http.request("DELETE", protocol.worker(self.id), timeout=3)
            except Exception as e:  # noqa: BLE001 - best effort; pulse and TTL cover it
                log.debug("deregister failed: %s", e)
        self.stopping.set()
        if self.scorer is not None:
            self.scorer.close()
        self._gpus.close()
        self._owner_gpus.close()
        self.executor.close()  # no orphans: every task's process group is killed
        self.http.close()
        if self._own_cache:
            shutil.rmtree(self.cache, ignore_errors=True)
            assert self._cache_lock is not None  # (made with the cache it owns)
            self._cache_lock.release()

    # ------------------------------------------------------------------ registration -
    def _register(self, first: bool = False) -> None:
        with self._reg_lock:
            if self._registered.is_set() and not first:
                return
            never_joined = self.id is None
            # A coordinator started alongside (serve's self-worker, compose, a script) is up
            # in seconds: the reconnect pace first, the longer backoff only for an address
            # that has not answered for JOIN_PATIENCE_S (a wrong URL or port).
            delays, failures, patient_until = backoff_delays(), 0, time.monotonic() + JOIN_PATIENCE_S
            while not self.stopping.is_set():
                try:
                    body = dict(self.info, slots=self.slots, slot_list=self.slot_list,
                                **self._owner_report())
                    if self.id:
                        body["id"] = self.id
                    resp = self.http.request("POST", protocol.WORKERS, json=body, timeout=10)
                    self._check_version(resp.json())
                    self.id = resp.json()["id"]
                    self._use_features(resp.json().get("features"))
                    self.handoff = Handoff.probe(self.http)  # the coordinator may have moved
                    self._registered.set()
                    self.on_event("joined" if first else "rejoined",
                                  f"joined mesh as {self.id}" if first else f"re-joined mesh as {self.id}")
                    return
                except LockedOut as e:  # (another program's refused tokens, maybe)
                    self._locked_out(e)
                except AuthError:
                    raise
                except Unreachable as e:
                    failures += 1
                    if first and failures == 1:  # once, not once a try
                        self.on_event("waiting", f"coordinator unreachable ({e}), retrying")
                        first = False if self.id else first
                    if never_joined and failures == JOIN_HINT_AFTER:
                        self.on_event("waiting", f"still no answer after {failures} tries; retrying, "
                                      f"at most {JOIN_BACKOFF_MAX_S:g} s apart. Check the address "
                                      f"with: gpumesh doctor {self.url}")
                    if never_joined and patient_until and time.monotonic() >= patient_until:
                        delays, patient_until = backoff_delays(cap=JOIN_BACKOFF_MAX_S), 0.0
                    self.stopping.wait(next(delays))

    def _check_version(self, answer: dict) -> None:
        """VersionMismatch unless the coordinator runs this gpumesh (one from before
        registration answers named their version says it in /v1/health)."""
        theirs = answer.get("version")
        if theirs is None:
            theirs = self.http.request("GET", protocol.HEALTH, timeout=10).json().get("version")
        versions.check_coordinator(theirs, self.url, "worker")

    #: The coordinator features this agent uses when offered (protocol.FEATURE_*).
    FEATURES = frozenset({protocol.FEATURE_RESULT_BATCH})

    def _use_features(self, offered) -> None:
        if (isinstance(offered, list) and protocol.FEATURE_RESULT_BATCH in offered
                and protocol.FEATURE_RESULT_BATCH in self.FEATURES and self.poster is None):
            self.poster = ResultPoster(self)

    def _running(self) -> list[str]:
        """What the heartbeat reports: every task held, results on their way included."""
        posting = self.poster.posting if self.poster is not None else ()
        return sorted(self._held.union(posting))

    def _cancel(self, *task_ids: str) -> None:
        """Cancel tasks: queued grants are dropped (one sent ahead to its slot's process is
        withdrawn, Executor.withdraw: it must not begin), then running tasks' process
        groups are killed. In that order: a slot whose task is killed goes on to its next
        queued grant at once, which must be gone by then (the coordinator, for its part,
        sends a job's cancel lines newest lease first)."""
        running = []
        for task_id in task_ids:
            if self.poster is not None and self.poster.drop(task_id):
                self.executor.withdraw(task_id)
            else:
                running.append(task_id)
        for task_id in running:
            self.executor.cancel(task_id)

    def _lost_registration(self) -> None:
        self._registered.clear()
        self._register()

    # ------------------------------------------------------------------ heartbeat ---
    def _unreachable(self, e: Exception) -> None:
        """Say once per outage that the coordinator does not answer (the lease loop or
        the heartbeat, whichever meets it first); a lease answered ends the outage."""
        if not self._away and not self.stopping.is_set():
            self.on_event("waiting", f"coordinator unreachable ({e}), retrying")
        self._away = True

    def _locked_out(self, e: LockedOut) -> None:
        """The coordinator refuses this address for a while: say so once per spell, and
        wait it out (a worker with the right token must not leave for it: the refused
        tokens may be another program's at a shared address)."""
        now = time.monotonic()
        if now >= self._locked_until + 5.0:  # (not when a lockout follows the last at once)
            self.on_event("waiting", f"{e}; waiting")
        self._locked_until = max(self._locked_until, now + e.retry_after)
        self.stopping.wait(e.retry_after)

    def _heartbeat_loop(self) -> None:
        delays = backoff_delays()
        while not self.stopping.wait(HEARTBEAT_INTERVAL_S):
            try:
                self.functions.sweep()  # (blobs no task used for WARM_IDLE_S)
            except Exception as e:  # noqa: BLE001 - never let the heartbeat thread die
                log.warning("function cache sweep failed: %s", e)
            if not self._registered.is_set():
                continue
            try:
                resp = self.http.request("POST", protocol.worker_heartbeat(self._wid),
                                         json={"running": self._running(),
                                               **({"receiving": True} if self._receiving.is_set()
                                                  else {}),
                                               **self._device_state(), **self._owner_report()},
                                         timeout=5)
                self._cancel(*resp.json().get("cancel", []))
                delays = backoff_delays()
            except RequestRejected as e:
                if getattr(e, "code", "") == protocol.ErrorCode.UNKNOWN_WORKER:
                    self._lost_registration()
            except LockedOut as e:
                self._locked_out(e)
            except Unreachable as e:
                self._unreachable(e)  # (a lost link shows here first: a lease waits 30 s)
                self.stopping.wait(next(delays))
            except Exception as e:  # noqa: BLE001 - never let the heartbeat thread die
                log.warning("heartbeat failed: %s", e)

    def _device_state(self) -> dict:
        """What the heartbeat says about the devices: free GPU memory, scores once known."""
        out: dict = {}
        free = cap_free(self._gpus.free_mb(), self.owner.policy.max_gpu_memory_mb)
        if free:
            out["gpu_free_mb"] = {str(i): mb for i, mb in free.items()}
            for g in self.info.get("gpus") or ():
                if g.get("index") in free:
                    g["memory_free_mb"] = free[g["index"]]
        tele = self._gpus.telemetry()  # utilisation, temperature: shown, never scheduled on
        if any(tele.values()):
            out["gpu_telemetry"] = {str(i): v for i, v in tele.items() if v}
        if self._scores:
            out["scores"] = self._scores
            out["score"] = self.info["score"]
        changed = self._packages.changed()
        if changed is not None:
            out["packages"] = self.info["packages"] = changed
        return out

    def _on_scores(self, result: dict) -> None:
        """The benchmark finished: keep the scores (a re-registration carries them too),
        print them, and tell the coordinator now rather than at the next heartbeat."""
        scores = {k: float(v["score"]) for k, v in result.items()
                  if isinstance(v, dict) and isinstance(v.get("score"), (int, float))}
        self._scores = scores
        self.info["scores"] = scores
        self.info["score"] = max(scores.values(), default=0.0)
        for line in describe(result, self.info):
            self.on_event("scored", line)
        if self._registered.is_set():
            try:
                self.http.request("POST", protocol.worker_heartbeat(self._wid),
                                  json={"scores": scores, "score": self.info["score"]}, timeout=5)
            except Exception as e:  # noqa: BLE001 - the next heartbeat carries them too
                log.debug("could not report the scores now: %s", e)

    @staticmethod
    def _env_for(slot: dict, machine_has_gpus: bool) -> dict | None:
        """Environment of a task in ``slot``: its own GPU, or (a CPU slot on a GPU machine)
        none, so it cannot take memory from the GPUs' own tasks."""
        if slot["kind"] == "cuda":
            # NVML indices follow PCI bus order; make CUDA number the GPUs the same way.
            return {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": str(slot["gpu"])}
        if machine_has_gpus:
            return {"CUDA_VISIBLE_DEVICES": ""}
        return None

    # ------------------------------------------------------------------ pulse -------
    def _session_loop(self) -> None:
        """Hold the pulse connection open; reopen it whenever it ends."""
        delays = backoff_delays()
        while not self.stopping.is_set():
            if not self._registered.wait(0.5):
                continue
            try:
                # The coordinator pings every SESSION_PING_S: three missed pings = gone.
                with self.http.stream_lines(protocol.worker_session(self._wid),
                                            timeout=3 * SESSION_PING_S) as (status, lines):
                    if status == 404:
                        self._lost_registration()
                        continue
                    for line in lines:
                        delays = backoff_delays()
                        if self.stopping.is_set():
                            return
                        if line.startswith("cancel "):
                            self._cancel(line[7:].strip())
            except Unreachable as e:
                log.debug("pulse connection ended: %s", e)
            except Exception as e:  # noqa: BLE001 - never let the pulse thread die
                log.warning("pulse connection failed: %s", e)
            self.stopping.wait(next(delays))

    # ------------------------------------------------------------------ output ------
    def _output_loop(self) -> None:
        """Forward what running tasks print, every OUTPUT_FLUSH_S."""
        while not self.stopping.wait(OUTPUT_FLUSH_S):
            for cursor in list(self._output.values()):
                try:
                    self._forward_output(cursor)
                except Exception as e:  # noqa: BLE001 - output is best effort
                    log.debug("output forward failed: %s", e)

    def _forward_output(self, cursor: OutputCursor, final: bool = False) -> None:
        with cursor.lock:
            try:
                while True:
                    out, err = cursor.read(OUTPUT_BODY_BYTES // 2 - 1024)
                    if not out and not err:
                        return
                    chunks, size = wire.pack_frames([b"{}", out, err])
                    try:
                        self.http.request("POST", protocol.task_output(cursor.task_id),
                                          params={"lease": cursor.lease_id},
                                          content=wire.iter_chunks(chunks),
                                          headers={"content-length": str(size)}, timeout=30)
                    except (RequestRejected, Unreachable):
                        return  # output is best effort; the result is what matters
                    if not final and not cursor.behind():
                        return
            finally:
                cursor.trim()  # (the lender's disk: see OutputCursor)

    # ------------------------------------------------------------------ leasing -----
    def _lease_loop(self) -> None:
        delays = backoff_delays()
        while not self.stopping.is_set():
            # Wait for a free slot, then ask for a task for each free slot (naming them:
            # the coordinator grants a slot only a task that slot can run).
            with self._free_cv:
                free = [k for k, n in self._busy.items() if n == 0 and self._slot_open(k)]
                if not free:
                    self._free_cv.wait(0.5)
                    continue
                for k in free:
                    self._busy[k] += 1  # reserved by this request
            try:
                body = self.http.stream_into(
                    "POST", protocol.worker_lease(self._wid),
                    json=protocol.LeaseRequest(slots=len(free), free=free, wait=LONG_POLL_S,
                                               handoff=self.handoff is not None).as_dict(),
                    timeout=LONG_POLL_S + 10, buffer_for=self.executor.bodies.buffer_for,
                    on_head=self._receiving.set)
                delays = backoff_delays()
                self._away = False
            except LockedOut as e:
                self._release(free)
                self._locked_out(e)
                continue
            except RequestRejected as e:
                self._away = False
                self._release(free)
                if getattr(e, "code", "") == protocol.ErrorCode.UNKNOWN_WORKER:
                    self._lost_registration()
                else:
                    log.warning("lease refused: %s", e)
                    self.stopping.wait(next(delays))
                continue
            except Unreachable as e:
                self._receiving.clear()
                self._release(free)
                self._unreachable(e)
                self.stopping.wait(next(delays))
                continue
            try:
                self._start(body, free)
            finally:
                self._receiving.clear()  # its tasks are held now (or it had none)
            # A big answer is shared memory that only its tasks may keep alive: this loop
            # must not hold it until the next answer, which may be long in coming.
            body = None

    def _start(self, body, free: list[int]) -> None:
        """Start a thread for each task of a lease answer; release the reserved slots
        (``free``) that got none."""
        frames = self.executor.bodies.slices(body)
        try:
            tasks = protocol.TaskGrant.list_from_dict(json.loads(bytes(frames[0])))
        except (ValueError, WireError) as e:  # a coordinator that is not ours (or a bug)
            log.error("ignored a lease answer that is not one: %s", e)
            tasks = []
        if tasks:
            tracing.mark("agent.leased")
        left = list(free)
        # Held from here, not only once each slot's thread takes its task: the heartbeat
        # stops saying "receiving" when this returns.
        self._held.update(task.task_id for task in tasks[:len(frames) - 1])
        for task, args in zip(tasks, frames[1:]):
            slot = task.slot
            if slot in left:
                left.remove(slot)  # the request's reservation becomes the task's
            elif slot in self._busy:
                # A slot that became idle while this poll was open (its result told the
                # coordinator so); its last task's thread is on its way out.
                with self._free_cv:
                    self._busy[slot] += 1
            elif left:  # a coordinator that does not name slots: any free one
                slot = left.pop(0)
            else:
                slot = None
            self._slot_thread(slot, task, args)
        self._release(left)

    def _slot_thread(self, slot: int | None, task: protocol.TaskGrant, args) -> None:
        """Run ``task`` on ``slot``'s own thread, which waits between its tasks (started
        with the slot's first task; a slot the coordinator did not name gets a thread of
        its own). Starting a thread per task cost this loop a wait for the new thread to
        run first, on every task that a lease brings."""
        if slot is None:
            threading.Thread(target=self._run_task, args=(task, args, slot),
                             name=f"task-{task.task_id}", daemon=True).start()
            return
        inbox = self._slot_inbox.get(slot)
        if inbox is None:
            inbox = self._slot_inbox[slot] = queue.SimpleQueue()
            threading.Thread(target=self._slot_loop, args=(slot, inbox),
                             name=f"slot-{slot}", daemon=True).start()
        inbox.put((task, args))

    def _slot_loop(self, slot: int, inbox: queue.SimpleQueue) -> None:
        while True:
            task, args = inbox.get()
            try:
                self._run_task(task, args, slot)
            except Exception:  # noqa: BLE001 - the slot's later tasks still need the thread
                log.exception("the thread of slot %s failed", slot)
            task = args = None  # (a big argument is shared memory: not held while idle)

    def _release(self, slots) -> None:
        with self._free_cv:
            for k in slots:
                if self._busy.get(k, 0) > 0:
                    self._busy[k] -= 1
            self._free_cv.notify_all()

    def _run_task(self, task: protocol.TaskGrant | None, args, slot: int | None = None) -> None:
        """Run granted tasks in ``slot`` until the coordinator has no next one for it.
        ``args``: the task's argument frame, a ``memoryview`` or (a big one read into
        shared memory) a :class:`~gpumesh.payloadref.PayloadRef`."""
        if self.scorer is not None:
            self.scorer.task_started()  # a running benchmark is killed before the task starts
        try:
            while task is not None:
                held = task.task_id
                self._held.add(held)  # reported by heartbeats until its result is delivered
                self._slot_task[slot] = held
                if not self._slot_open(slot):  # granted just as the owner closed the slot
                    self._handing_back.setdefault(held, self._closed_reason(slot))
                outcome = None
                # (a task handed back that was sent ahead to the slot's process is withdrawn
                # there: it may have begun, and then its result stands)
                if held not in self._handing_back or self.executor.sent_ahead(held):
                    try:
                        path = self.functions.acquire(task.fn)
                    except Exception as e:  # noqa: BLE001
                        outcome = Outcome("retry", {"kind": protocol.FailureKind.FETCH,
                                                    "message": f"could not fetch the function: {e}"})
                    else:
                        try:
                            if held not in self._handing_back or self.executor.sent_ahead(held):
                                outcome = self._run_guarded(task, path, args, slot,
                                                            withdraw=held in self._handing_back)
                        finally:
                            self.functions.release(task.fn)
                args = None  # a big one is shared memory: free it now, not after the post
                self._slot_task.pop(slot, None)
                why = self._handing_back.pop(held, None)
                try:
                    killed = outcome is None or (outcome.error or {}).get("kind") == protocol.FailureKind.CANCELLED
                    if why is not None and killed:
                        # killed (or never started) for the owner: preempted, not failed
                        self._hand_back(task, why, backoff_delays())
                        task, args = self._next_queued(slot)
                    else:  # it finished first: its result stands
                        assert outcome is not None  # (None: not run, only when handed back)
                        task, args = self._post_result(task, outcome, slot)
                finally:
                    self._held.discard(held)
                    outcome = None  # (its result may be a memory file too)
        finally:
            if self.scorer is not None:
                self.scorer.task_finished()
            self._release([slot])

    def _next_queued(self, slot: int | None):
        """The slot's next queued grant ``(task, args)``, or ``(None, None)``."""
        return (None, None) if self.poster is None else self.poster.next_queued(slot)

    def _run_guarded(self, task: protocol.TaskGrant, path: Path, args, slot: int | None,
                     withdraw: bool = False) -> Outcome:
        """:meth:`_run_one`, with an error of this worker's own (not the task's: its
        gpumesh removed or replaced under it, a full spool disk) made the task's outcome:
        ``retry``, so the coordinator gives it to a worker again (up to its loss limit)
        and reports why, instead of the task staying leased here, renewed by every
        heartbeat, for ever."""
        try:
            return self._run_one(task, path, args, slot, withdraw)
        except Exception as e:  # noqa: BLE001 - any of them: the task must not be left held
            log.exception("slot %s could not run task %s", slot, task.task_id)
            return Outcome("retry", {"kind": protocol.FailureKind.HOST_DIED,
                                     "message": f"the worker could not run it: "
                                                f"{type(e).__name__}: {e}"})

    def _run_one(self, task: protocol.TaskGrant, path: Path, args, slot: int | None,
                 withdraw: bool = False) -> Outcome:
        """Run one task in the executor, forwarding what it prints (``withdraw``: see
        Executor.run)."""
        args_ref = None
        if isinstance(args, PayloadRef):  # big, from another machine: in shared memory
            args_ref, args = args, None
        elif task.refs or task.args_file:  # same machine: the arguments are the store's file
            try:
                args_ref = task.args_ref(self.handoff.blob_dir).pin()  # type: ignore[union-attr]  # None: caught
            except (OSError, AttributeError, ValueError) as e:
                return Outcome("retry", {"kind": protocol.FailureKind.FETCH,
                                         "message": f"could not open the task's arguments: {e}"})
        cursor = self._output[task.task_id] = OutputCursor(task, *self.executor.new_output(task.task_id))
        drop = self.handoff
        # The name the task may leave its result under: ours, so that whatever becomes of the
        # task (killed mid-write, cancelled, crashed) no file is left behind unclaimed.
        name = new_name() if drop is not None else None
        outcome = None
        try:
            if task.kind == "script":  # python SCRIPT, payload on stdin
                if args_ref is not None:
                    args = args_ref.open()
                outcome = self.executor.run_script(task.task_id, str(path), args,
                                                   task.timeout, env=self._slot_env.get(slot),
                                                   name=task.script)
            else:
                env_key, sys_path = None, None
                missing = packages.unmet(task.requires or (), self._packages.current)
                if missing:  # the coordinator sends these only to a worker allowing installs
                    if self.envs is None:
                        outcome = Outcome("error", {"kind": protocol.FailureKind.REQUIRES, "type": "Unsatisfiable",
                                                    "message": f"this worker lacks {missing} and "
                                                               "does not allow installs"})
                        return outcome
                    try:
                        env_key, site = self.envs.acquire(list(task.requires or ()))
                    except InstallError as e:
                        outcome = Outcome("error", {"kind": protocol.FailureKind.REQUIRES, "type": "InstallError",
                                                    "message": str(e)})
                        return outcome
                    sys_path = [site]
                tracing.mark("agent.run")
                poster = self.poster
                try:
                    outcome = self.executor.run(
                        task, str(path), args, env=self._slot_env.get(slot), args_ref=args_ref,
                        handoff_dir=str(drop.drop_dir) if drop else None,
                        handoff_name=name, sys_path=sys_path, slot=slot, withdraw=withdraw,
                        ahead=None if poster is None else lambda: poster.peek(slot))
                finally:
                    if env_key is not None:
                        assert self.envs is not None  # (env_key came from it)
                        self.envs.release(env_key)
            return outcome
        finally:
            if name is not None and (outcome is None or outcome.handoff_file != name):
                assert drop is not None  # (name came from it)
                drop.discard(name)
            if args_ref is not None:
                args_ref.release()
            del self._output[task.task_id]
            if (outcome is not None and outcome.status == "error" and outcome.error is not None
                    and cursor.emptied(1)):  # (its stderr file was emptied: see OutputCursor)
                with cursor.lock:
                    outcome.error["stderr_tail"] = cursor.tail(1).decode("utf-8", "replace")
            self._forward_output(cursor, final=True)  # before the result: order kept
            cursor.remove()

    def _post_result(self, task: protocol.TaskGrant, outcome: Outcome,
                     slot: int | None = None) -> tuple[protocol.TaskGrant | None, memoryview | None]:
        """Deliver a result (retrying while the coordinator is away). The answer may carry
        the next task for this slot: returns ``(task, args)`` or ``(None, None)``."""
        if self.poster is not None and self.poster.batchable(outcome):
            return self.poster.post(task, outcome, slot)
        tracing.mark("agent.post")
        drop = self.handoff
        meta = protocol.ResultPost(outcome.status, outcome.error)
        frames: list[wire.Chunk] = [json.dumps(meta.as_dict()).encode()]
        if outcome.handoff_file is not None:  # the task left its result as a file
            meta = protocol.ResultPost(outcome.status, outcome.error,
                                       refs={"0": {"kind": "handoff", "name": outcome.handoff_file}},
                                       # refs' key before it: drop it in the next release
                                       handoff_files={"0": outcome.handoff_file})
            frames = [json.dumps(meta.as_dict()).encode(), b""]
        elif outcome.payload is not None:
            frames.append(outcome.payload)
        try:
            queued = self._next_queued(slot)
            if queued[0] is not None:  # the slot has its next task already
                self._send_result(task, frames, slot, ask_next=False)
                return queued
            return self._send_result(task, frames, slot)
        finally:
            if outcome.handoff_file is not None and drop is not None:
                drop.discard(outcome.handoff_file)  # unless the coordinator took it

    def _send_result(self, task: protocol.TaskGrant, frames: list, slot: int | None,
                     ask_next: bool = True) -> tuple[protocol.TaskGrant | None, memoryview | None]:
        chunks, size = wire.pack_frames(frames)
        delays = backoff_delays()
        deadline = time.monotonic() + 3600
        while time.monotonic() < deadline:
            params = {"lease": task.lease_id}
            if ask_next and not self.stopping.is_set() and self._slot_open(slot):
                params["next"] = "1"
                if slot is not None:
                    params["slot"] = str(slot)
                if self.handoff is not None:
                    params["handoff"] = "1"
            try:
                # a small result goes as one bytes object: cheaper than a chunk iterator
                content = b"".join(chunks) if size <= 1 << 20 else wire.iter_chunks(chunks)
                body = self.http.stream_into(
                    "POST", protocol.task_result(task.task_id), params=params,
                    content=content, headers={"content-length": str(size)}, timeout=600,
                    buffer_for=self.executor.bodies.buffer_for)
            except RequestRejected as e:
                if (getattr(e, "code", "") == protocol.ErrorCode.HANDOFF_MISSING and len(frames) == 2
                        and not frames[1]):
                    # The coordinator does not see the file (it moved to another data
                    # directory, say): the payload is lost with it, so the task runs again.
                    log.warning("task %s: %s; handing the task back", task.task_id, e)
                    self.handoff = None
                    frames = [json.dumps(protocol.ResultPost("retry", {
                        "kind": protocol.FailureKind.HANDOFF, "message": str(e)}).as_dict()).encode()]
                    chunks, size = wire.pack_frames(frames)
                    continue
                if not e.retry_later:
                    log.info("result for task %s refused: %s", task.task_id, e)
                    return None, None
                log.warning("task %s: result not stored yet, posting it again: %s", task.task_id, e)
                if self.stopping.wait(next(delays)):
                    return None, None
                continue
            except Unreachable:
                if self.stopping.is_set():
                    return None, None
                self.stopping.wait(next(delays))
                continue
            got = self.executor.bodies.slices(body)
            try:
                granted = protocol.TaskGrant.list_from_dict(json.loads(bytes(got[0])))
            except (ValueError, WireError) as e:  # the result stands; a bad grant is skipped
                log.error("ignored a next task that is not one: %s", e)
                return None, None
            if granted:
                return granted[0], got[1]
            return None, None
        return None, None
