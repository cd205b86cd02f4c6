"""Measure a worker's devices in the background, never while a task runs.

::

    agent joins ──► Scorer thread: wait until no task has run for QUIET_S
                        │
                        ▼
                    python -m gpumesh.worker.bench --gpus 0,1   (its own process: torch,
                        │                                         CUDA contexts live there)
                        │  a task arrives ──► task_started() kills it at once (SIGKILL),
                        │                     the thread waits for quiet and starts over
                        ▼
                    scores ──► on_scores({"cpu": ..., "cuda:0": ...}) ──► next heartbeat

The first task never waits for the benchmark, and the benchmark never shares the machine
with a task: :meth:`Scorer.task_started` is called before every task starts and kills a
running measurement before returning. After ``MAX_TRIES`` interrupted attempts (a worker
that is never idle) the scores stay unmeasured (0), which ranks the worker's devices
by their kind alone.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable

from . import procs

log = logging.getLogger("gpumesh.worker")

#: Seconds without any task before a measurement starts.
QUIET_S = 0.3
#: Seconds the benchmark process may take in all (imports and CUDA start-up included).
PROCESS_TIMEOUT_S = 120.0
#: Interrupted or failed attempts before the worker gives up measuring.
MAX_TRIES = 20


class Scorer:
    """Runs the benchmark process for ``gpus`` (NVML indices) and ``mps`` once, in a
    background thread; ``on_scores`` receives ``{device key: {"score", ...}}``."""

    def __init__(self, gpus: list[int], mps: bool, on_scores: Callable[[dict], None]):
        self.gpus, self.mps = list(gpus), mps
        self.on_scores = on_scores
        self.stopping = threading.Event()  # (the agent gives it its own before start())
        self._lock = threading.Condition()
        self._running_tasks = 0
        self._proc: subprocess.Popen | None = None
        self.done = threading.Event()
        self.tries = 0

    def start(self) -> None:
        threading.Thread(target=self._run, name="scorer", daemon=True).start()

    # -- called by the agent around every task -----------------------------------------
    def task_started(self) -> None:
        """A task is about to start: stop any measurement now (it is killed, not awaited)."""
        with self._lock:
            self._running_tasks += 1
            proc = self._proc
            if proc is not None and proc.poll() is None:
                _kill(proc)
                log.debug("benchmark interrupted by a task")

    def task_finished(self) -> None:
        with self._lock:
            self._running_tasks = max(0, self._running_tasks - 1)
            self._lock.notify_all()

    # -- the thread ------------------------------------------------------------------
    def _wait_quiet(self) -> bool:
        """Block until no task has run for QUIET_S; False if the agent is stopping."""
        with self._lock:
            while not self.stopping.is_set():
                if self._running_tasks == 0:
                    if not self._lock.wait(QUIET_S) and self._running_tasks == 0:
                        return True
                else:
                    self._lock.wait(0.5)
        return False

    def _run(self) -> None:
        while not self.done.is_set() and self.tries < MAX_TRIES:
            if not self._wait_quiet():
                return
            self.tries += 1
            result = self._measure_once()
            if result is not None:
                self.done.set()
                try:
                    self.on_scores(result)
                except Exception:  # noqa: BLE001
                    log.exception("reporting the scores failed")
                return
            self.stopping.wait(min(30.0, 0.5 * self.tries))
        if not self.done.is_set() and not self.stopping.is_set():
            log.warning("could not benchmark this worker's devices after %d tries", self.tries)

    def command(self) -> list[str]:
        """The benchmark process's command line."""
        cmd = [sys.executable, "-m", "gpumesh.worker.bench"]
        if self.gpus:
            cmd += ["--gpus", ",".join(str(i) for i in self.gpus)]
        if self.mps:
            cmd.append("--mps")
        return cmd

    def _measure_once(self) -> dict | None:
        cmd = self.command()
        env = bench_env(self.gpus)
        with self._lock:
            if self._running_tasks or self.stopping.is_set():
                return None
            self._proc = proc = subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                stdin=subprocess.DEVNULL, **procs.group_kwargs())
        try:
            out, err = proc.communicate(timeout=PROCESS_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            _kill(proc)
            proc.communicate()
            log.warning("the benchmark took over %.0fs; stopped", PROCESS_TIMEOUT_S)
            return None
        finally:
            with self._lock:
                self._proc = None
        if proc.returncode != 0:
            if proc.returncode != -getattr(signal, "SIGKILL", 9):  # (not killed for a task)
                log.warning("the benchmark failed (exit %s): %s", proc.returncode,
                            err.decode(errors="replace")[-500:])
            return None
        try:
            line = out.decode().strip().splitlines()[-1]
            result = json.loads(line)
        except (ValueError, IndexError):
            log.warning("the benchmark printed no result")
            return None
        return result if isinstance(result, dict) else None

    def close(self) -> None:
        self.stopping.set()
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                _kill(self._proc)
            self._lock.notify_all()


def bench_env(gpus: list[int]) -> dict:
    """The benchmark process's environment: CUDA device k is NVML GPU ``gpus[k]``."""
    from .runner import SCRUBBED_ENV
    env = {k: v for k, v in os.environ.items() if k not in SCRUBBED_ENV}
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in gpus)
    return env


def _kill(proc: subprocess.Popen) -> None:
    procs.kill_tree(proc.pid)


def describe(scores: dict, info: dict) -> list[str]:
    """The lines ``gpumesh join`` prints once scores are in: ``device=CPU AMD EPYC
    score=132.650 GFLOP/s``, one per device (GPUs first)."""
    names = {f"cuda:{g['index']}": g.get("name", "GPU") for g in info.get("gpus") or ()}
    lines = []
    for key in sorted(scores, key=lambda k: (k == "cpu", k)):
        s = scores[key]
        score = float(s.get("score", 0) if isinstance(s, dict) else s)
        if key == "cpu":
            label = f"CPU {info.get('cpu', '?')}"
        elif key == "mps":
            label = f"GPU Apple {info.get('cpu', '')} (mps)".replace("  ", " ")
        else:
            label = f"GPU {names.get(key, key)} ({key})"
        lines.append(f"device={label} score={score:.3f} GFLOP/s")
    return lines
