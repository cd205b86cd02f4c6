"""``GPUMesh("dask://host:8786")`` (or ``"tcp://host:8786"``): tasks on a Dask scheduler.

Needs ``pip install 'gpumesh[dask]'`` on the caller; the workers need only what the
function itself imports (the task wrapper travels by value).

Resources: ``gpu="cuda"``/``"gpu"`` -> the worker resource ``GPU=1``, ``cores=N`` ->
``CPU=N``, ``memory=`` -> ``MEMORY=<bytes>`` (the names the Dask docs use; start workers
with e.g. ``dask worker tcp://host:8786 --resources "GPU=1 CPU=8 MEMORY=64e9"``).
``gpu="cpu"`` asks for nothing. A GPU model, ``gpu="mps"`` and ``gpu_memory=`` have no
Dask equivalent: :class:`~gpumesh.errors.EngineCannotExpress`.

``timeout=``: the task runs in a thread of the worker that the wrapper stops waiting for;
Python cannot kill a thread, so a timed-out task keeps running in the background of its
worker process until it returns (the caller gets TaskTimeout at once either way).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from ... import hardware
from ...errors import EngineCannotExpress
from ...limits import PROBE_TIMEOUT_S, MiB
from .base import EngineMesh, run_task, tcp_reachable


def dask_resources(require: hardware.Requirements | None) -> dict:
    """``@accelerate`` requirements -> Dask worker resources (see the module docstring)."""
    if not require:
        return {}
    if require.requires:
        raise EngineCannotExpress("requires=: gpumesh builds no environments on a Dask cluster; "
                                  "install the packages on its workers, or use the native mesh")
    out: dict = {}
    if require.gpu is not None and require.gpu != "cpu":
        if require.gpu not in ("cuda", "gpu"):
            raise EngineCannotExpress(
                f"gpu={require.gpu!r}: Dask resources have no GPU models nor kinds other than "
                f"'cuda'/'gpu' (resource GPU=1); use gpu='cuda', or Ray (accelerator_type)")
        out["GPU"] = 1
    if require.gpu_memory is not None:
        raise EngineCannotExpress("gpu_memory=: Dask cannot select GPUs by their memory; "
                                  "drop it, or use the native mesh")
    if require.cores is not None:
        out["CPU"] = require.cores
    if require.memory is not None:
        out["MEMORY"] = require.memory
    return out


class DaskMesh(EngineMesh):
    engine = "Dask"

    @property
    def address(self) -> str:
        return f"tcp://{self.host}:{self.port or 8786}"

    def _connect(self) -> Any:
        try:
            from distributed import Client
        except ImportError as e:
            raise ImportError(f"{self.url} needs Dask: pip install 'gpumesh[dask]' ({e})") from None
        if not tcp_reachable(self.host, self.port or 8786):
            raise ConnectionError(f"nothing answers at {self.address}")
        return Client(self.address, timeout=max(5.0, PROBE_TIMEOUT_S), set_as_default=False)

    def _disconnect(self, engine: Any) -> None:
        engine.close()

    def _resources(self, require: hardware.Requirements | None) -> dict:
        return dask_resources(require)

    def _engine_workers(self) -> list[dict]:
        info = self._engine.scheduler_info(n_workers=-1)
        out = []
        for addr, w in sorted(info.get("workers", {}).items()):
            res = dict(w.get("resources") or {})
            n_gpu = int(res.get("GPU", 0))
            nthreads = int(w.get("nthreads") or 1)
            gpus = [{"index": i, "name": "GPU (Dask resource)", "memory_total_mb": 0} for i in range(n_gpu)]
            metrics = w.get("metrics") or {}
            out.append({
                "id": str(w.get("name", addr)), "address": addr, "engine": "dask",
                "hostname": w.get("host") or addr, "alive": w.get("status", "running") in ("running", "paused"),
                "slots": n_gpu + nthreads, "slot_list": hardware.slot_list(gpus, nthreads),
                "gpus": gpus, "cores": int(res.get("CPU", nthreads)),
                "ram_mb": int((w.get("memory_limit") or 0) // MiB), "cpu": "CPU",
                "scores": {}, "score": None, "busy_slots": [],
                "running": int(metrics.get("executing", 0) or 0), "resources": res,
                "device": "cuda" if n_gpu else "cpu",
            })
        return out

    def _unsatisfiable(self, resources: dict, workers: list[dict]) -> str | None:
        if not resources:
            return None
        for w in workers:
            if all(float(w["resources"].get(k, 0)) >= v for k, v in resources.items()):
                return None
        have = "; ".join(f"{w['id']}: {w['resources'] or 'no resources'}" for w in workers)
        return (f"it needs the worker resources {resources}, the workers have {have} "
                f"(declare them with dask worker --resources \"GPU=1 CPU=8 MEMORY=64e9\")")

    def _run(self, fn: Callable, calls: list, resources: dict, timeout: float | None,
             name: str) -> Iterator[tuple[int, tuple]]:
        from distributed import as_completed
        client = self._engine
        futures = [client.submit(run_task, fn, args, kwargs, timeout, key=f"{name}-{i}", pure=False,
                                 resources=resources or None)
                   for i, (args, kwargs) in enumerate(calls)]
        index = {f.key: i for i, f in enumerate(futures)}
        finished = False
        try:
            for fut in as_completed(futures, loop=client.loop):
                yield index[fut.key], fut.result()
            finished = True
        finally:
            if not finished:
                client.cancel(futures)
            del futures
