"""Tensors that were on a device the receiver lacks (a CUDA tensor sent to a CPU-only caller).

torch pickles a tensor's storage with ``torch.save`` and unpickles it with
``torch.storage._load_from_bytes``, which calls ``torch.load`` *without* ``map_location``:
a storage saved on ``cuda:0`` is restored on ``cuda:0``, and a process without CUDA (or
with fewer GPUs, or without MPS) fails with "Attempting to deserialize object on a CUDA
device but torch.cuda.is_available() is False".

:func:`gpumesh.wire.loads` catches exactly that error and unpickles the payload again
with :class:`CPUUnpickler`, which maps every such storage to the CPU. The caller gets the
same values, on the CPU; a caller that has the device keeps getting tensors on it (the
first, ordinary unpickling succeeds). Nothing changes for the sender, and values without
tensors never take this path.
"""

from __future__ import annotations

import io

from .classes import ClassKeepingUnpickler

#: Text of torch's error for a storage saved on a device this process does not have.
DEVICE_ERROR = "Attempting to deserialize object on"


def is_device_error(exc: BaseException) -> bool:
    """Whether ``exc`` is torch refusing to restore a storage on a missing device."""
    return isinstance(exc, RuntimeError) and DEVICE_ERROR in str(exc)


def load_from_bytes_cpu(b: bytes):
    """``torch.storage._load_from_bytes`` with every storage mapped to the CPU."""
    import torch
    try:
        return torch.load(io.BytesIO(b), map_location="cpu", weights_only=False)
    except TypeError:  # torch before 1.13 has no weights_only
        return torch.load(io.BytesIO(b), map_location="cpu")


class CPUUnpickler(ClassKeepingUnpickler):
    """An unpickler that restores torch storages on the CPU, wherever they were saved
    (and, as :func:`gpumesh.wire.loads` does, keeps this process's classes as they are)."""

    def find_class(self, module: str, name: str):
        if module == "torch.storage" and name == "_load_from_bytes":
            return load_from_bytes_cpu
        return super().find_class(module, name)


def loads_on_cpu(stream, buffers, original: BaseException):
    """Unpickle ``stream`` (with its out-of-band ``buffers``) with tensors on the CPU.

    If even that fails, raises a ``RuntimeError`` naming both devices, chained to the
    failure, instead of torch's bare deserialisation error.
    """
    try:
        return CPUUnpickler(io.BytesIO(stream), buffers=buffers).load()
    except Exception as e:  # noqa: BLE001 - report both failures together
        raise RuntimeError(
            f"the value holds torch tensors saved on a device this process does not have "
            f"({original}); loading them on the CPU instead also failed: "
            f"{type(e).__name__}: {e}") from e
