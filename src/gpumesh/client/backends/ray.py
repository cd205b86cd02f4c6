"""``GPUMesh("ray://host:10001")`` (Ray Client) or ``GPUMesh("ray://auto")`` (the Ray
cluster this machine belongs to, as ``ray start`` left it): tasks on Ray.

Needs ``pip install 'gpumesh[ray]'`` (Ray with its client) on the caller; the workers need
only what the function itself imports.

Resources: ``gpu="cuda"``/``"gpu"`` -> ``num_gpus=1``; a model (``gpu="A100"``) ->
``num_gpus=1`` and ``accelerator_type`` set to the cluster's own name for it (Ray's
``accelerator_type:<name>`` node resources, matched like the native mesh matches GPU
names); ``gpu="cpu"`` -> ``num_gpus=0``; ``cores=N`` -> ``num_cpus=N``; ``memory=`` ->
``memory=<bytes>`` (a reservation). ``gpu="mps"`` and ``gpu_memory=`` have no Ray
equivalent: :class:`~gpumesh.errors.EngineCannotExpress`.

``timeout=``: a function with a timeout runs with ``max_calls=1``, so the worker process of
a timed-out task exits once the caller has its TaskTimeout (which kills the task).

One process holds one Ray connection (``ray.init``); a second ``GPUMesh`` to another Ray
address in the same process raises ``ValueError``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

from ... import hardware
from ...errors import EngineCannotExpress
from ...limits import MiB
from .base import EngineMesh, run_task, tcp_reachable

_init_lock = threading.Lock()
_connected_to: str | None = None


def ray_options(require: hardware.Requirements | None) -> dict:
    """``@accelerate`` requirements -> Ray task options (``accelerator_type`` is a GPU model
    still to be matched against the cluster's names: see :meth:`RayMesh._unsatisfiable`)."""
    out: dict = {}
    if not require:
        return out
    if require.requires:
        raise EngineCannotExpress("requires=: gpumesh builds no environments on a Ray cluster; "
                                  "use Ray's runtime_env on the cluster, or the native mesh")
    if require.gpu is not None:
        if require.gpu == "cpu":
            out["num_gpus"] = 0
        elif require.gpu == "mps":
            raise EngineCannotExpress("gpu='mps': Ray has no Apple GPU resource; use the native mesh")
        else:
            out["num_gpus"] = 1
            if require.gpu not in ("cuda", "gpu"):
                out["accelerator_type"] = require.gpu
    if require.gpu_memory is not None:
        raise EngineCannotExpress("gpu_memory=: Ray cannot select GPUs by their memory; use a "
                                  "model (gpu='A100') or the native mesh")
    if require.cores is not None:
        out["num_cpus"] = require.cores
    if require.memory is not None:
        out["memory"] = require.memory
    return out


class RayMesh(EngineMesh):
    engine = "Ray"

    @property
    def address(self) -> str:
        return "auto" if self.host == "auto" else f"ray://{self.host}:{self.port or 10001}"

    def _connect(self) -> Any:
        global _connected_to
        try:
            import ray
        except ImportError as e:
            raise ImportError(f"{self.url} needs Ray: pip install 'gpumesh[ray]' ({e})") from None
        with _init_lock:
            if ray.is_initialized():
                if _connected_to not in (None, self.address):
                    raise ValueError(f"this process is already connected to Ray at {_connected_to}; "
                                     f"one process holds one Ray connection")
                return ray
            if self.address != "auto" and not tcp_reachable(self.host, self.port or 10001):
                raise ConnectionError(f"nothing answers at {self.address}")
            import logging
            ray.init(address=self.address, log_to_driver=self.output, logging_level=logging.WARNING,
                     configure_logging=False)
            _connected_to = self.address
            return ray

    def _disconnect(self, engine: Any) -> None:
        pass  # the connection is the process's (ray.init), shared by every RayMesh

    def _resources(self, require: hardware.Requirements | None) -> dict:
        return ray_options(require)

    def _engine_workers(self) -> list[dict]:
        ray = self._engine
        out = []
        for node in ray.nodes():
            res = dict(node.get("Resources") or {})
            n_gpu, n_cpu = int(res.get("GPU", 0)), int(res.get("CPU", 0))
            types = [k.split(":", 1)[1] for k in res if k.startswith("accelerator_type:")]
            gpus = [{"index": i, "name": types[0] if types else "GPU", "memory_total_mb": 0}
                    for i in range(n_gpu)]
            out.append({
                "id": node.get("NodeID", "")[:12], "engine": "ray",
                "hostname": node.get("NodeManagerHostname") or node.get("NodeManagerAddress", ""),
                "alive": bool(node.get("Alive")), "slots": n_gpu + n_cpu,
                "slot_list": hardware.slot_list(gpus, n_cpu), "gpus": gpus, "cores": n_cpu,
                "ram_mb": int(res.get("memory", 0) // MiB), "cpu": "CPU", "scores": {}, "score": None,
                "busy_slots": [], "running": 0, "resources": res,
                "device": "cuda" if n_gpu else "cpu",
            })
        return out

    def _unsatisfiable(self, resources: dict, workers: list[dict]) -> str | None:
        if not resources:
            return None
        alive = [w for w in workers if w["alive"]]
        model = resources.get("accelerator_type")
        for w in alive:
            res = w["resources"]
            if resources.get("num_gpus", 0) > res.get("GPU", 0):
                continue
            if resources.get("num_cpus", 0) > res.get("CPU", 0):
                continue
            if resources.get("memory", 0) > res.get("memory", 0):
                continue
            if model is not None:
                names = [k.split(":", 1)[1] for k in res if k.startswith("accelerator_type:")]
                match = [n for n in names if hardware.gpu_matches(model, n) or hardware.gpu_matches(n, model)]
                if not match:
                    continue
                resources["accelerator_type"] = match[0]  # the cluster's own name for the model
            return None
        have = "; ".join(
            f"{w['id']}: " + ", ".join(f"{k}={v:g}" for k, v in sorted(w["resources"].items())
                                       if not k.startswith("node:") and k != "object_store_memory")
            for w in alive)
        return f"it needs {resources}; the nodes offer {have or 'nothing'}"

    def _run(self, fn: Callable, calls: list, resources: dict, timeout: float | None,
             name: str) -> Iterator[tuple[int, tuple]]:
        ray = self._engine
        opts = dict(resources, name=name.rsplit("-", 1)[0] or "task", max_retries=3)
        # With a timeout the worker exits after each task: a timed-out task dies with it.
        remote = (ray.remote(max_calls=1)(run_task) if timeout is not None
                  else ray.remote(run_task)).options(**opts)
        fn_ref = ray.put(fn)  # the function travels once, not once per task
        refs = [remote.remote(fn_ref, args, kwargs, timeout) for args, kwargs in calls]
        index = {r: i for i, r in enumerate(refs)}
        pending = list(refs)
        finished = False
        try:
            while pending:
                ready, pending = ray.wait(pending, num_returns=1)
                if pending:
                    more, pending = ray.wait(pending, num_returns=len(pending), timeout=0)
                    ready += more
                for ref, outcome in zip(ready, ray.get(ready)):
                    yield index[ref], outcome
            finished = True
        finally:
            if not finished:
                for r in pending:
                    try:
                        ray.cancel(r, force=True)
                    except Exception:  # noqa: BLE001 - best effort
                        pass
