"""gpumesh: pool the CPUs and GPUs of a few machines into one compute mesh for plain Python.

    from gpumesh import GPUMesh, accelerate

    mesh = GPUMesh("http://127.0.0.1:8000", token=TOKEN)

    @accelerate(mesh)
    def train(lr, epochs):
        return {"lr": lr}

    train(lr=0.01, epochs=10)                       # one task on the mesh (or here)
    train.map([{"lr": 0.01, "epochs": 10}, ...])    # one task per item, values in order

The public API is exactly ``__all__``. Names are imported lazily so that the worker's
task processes, which import ``gpumesh.wire``, do not pay for the HTTP client.
"""

from __future__ import annotations

from typing import Any

from ._version import __version__

__all__ = [
    "GPUMesh",
    "accelerate",
    "mesh",
    "RemoteFunction",
    "MeshError",
    "AuthError",
    "LockedOut",
    "RequestRejected",
    "MeshUnavailable",
    "WireError",
    "PayloadTooLarge",
    "VersionMismatch",
    "Unsatisfiable",
    "TaskFailed",
    "RemoteError",
    "TaskCrashed",
    "WorkerLost",
    "Cancelled",
    "TaskTimeout",
    "StartFailed",
    "EngineCannotExpress",
    "RemoteTraceback",
    "load_ipython_extension",
    "unload_ipython_extension",
    "__version__",
]

_LAZY = {
    "GPUMesh": "gpumesh.client.mesh",
    "accelerate": "gpumesh.client.remote",
    "mesh": "gpumesh.client.remote",
    "RemoteFunction": "gpumesh.client.remote",
    "load_ipython_extension": "gpumesh.jupyter",
    "unload_ipython_extension": "gpumesh.jupyter",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if name in __all__:
        import importlib
        return getattr(importlib.import_module("gpumesh.errors"), name)
    raise AttributeError(f"module 'gpumesh' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
