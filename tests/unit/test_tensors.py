"""A tensor saved on a device the receiver lacks arrives on the CPU (gpumesh.tensors).

CI has no torch and no GPU, so this drives wire.loads with a stand-in ``torch`` module
that behaves like the real one where it matters: a storage pickles as
``torch.storage._load_from_bytes(saved bytes)``, and loading bytes saved on "cuda:0"
without ``map_location`` raises torch's own RuntimeError text. scripts/gpu_check.sh runs
the real thing (../shared/cases/c07) on a machine with a GPU.
"""

from __future__ import annotations

import sys
import types

import pytest

from gpumesh import wire

CUDA_ERROR = ("Attempting to deserialize object on a CUDA device but torch.cuda.is_available() "
              "is False. If you are running on a CPU-only machine, please use torch.load with "
              "map_location=torch.device('cpu') to map your storages to the CPU.")


class FakeTensor:
    def __init__(self, values, device):
        self.values, self.device = list(values), device

    def __reduce__(self):
        # like a storage: (torch.storage._load_from_bytes, (what torch.save wrote,))
        saved = f"{self.device}|{','.join(map(str, self.values))}".encode()
        return (sys.modules["torch.storage"]._load_from_bytes, (saved,))


@pytest.fixture
def fake_torch(monkeypatch):
    loads = []

    def load(fh, map_location=None, weights_only=None):
        device, _, values = fh.read().decode().partition("|")
        loads.append(map_location)
        if device.startswith("cuda") and map_location is None:
            raise RuntimeError(CUDA_ERROR)
        return FakeTensor([int(v) for v in values.split(",")], map_location or device)

    def _load_from_bytes(b):
        import io
        return load(io.BytesIO(b))

    torch = types.ModuleType("torch")
    torch.load = load
    storage = types.ModuleType("torch.storage")
    storage._load_from_bytes = _load_from_bytes
    _load_from_bytes.__module__ = "torch.storage"      # pickled by reference, as torch's is
    _load_from_bytes.__qualname__ = "_load_from_bytes"
    torch.storage = storage
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setitem(sys.modules, "torch.storage", storage)
    return loads


def test_cuda_tensor_arrives_on_the_cpu(fake_torch):
    value = {"x": FakeTensor([1, 2, 3], "cuda:0"), "nested": [FakeTensor([4], "cuda:0")], "n": 7}
    got = wire.loads(bytearray(wire.dumps(value).to_bytes()))
    assert got["n"] == 7
    assert (got["x"].values, got["x"].device) == ([1, 2, 3], "cpu")
    assert (got["nested"][0].values, got["nested"][0].device) == ([4], "cpu")
    assert fake_torch == [None, "cpu", "cpu"]   # tried as is first, then mapped to the CPU


def test_cpu_tensor_takes_the_ordinary_path(fake_torch):
    got = wire.loads(wire.dumps(FakeTensor([5], "cpu")).to_bytes())
    assert (got.values, got.device) == ([5], "cpu")
    assert fake_torch == [None]


def test_other_runtime_errors_are_not_swallowed(fake_torch):
    class Boom:
        def __reduce__(self):
            return (_explode, ())
    with pytest.raises(RuntimeError, match="something else"):
        wire.loads(wire.dumps(Boom()).to_bytes())


def _explode():
    raise RuntimeError("something else")


def test_when_the_cpu_fallback_fails_too_the_error_names_both(fake_torch, monkeypatch):
    def broken(fh, map_location=None, weights_only=None):
        if map_location is None:
            raise RuntimeError(CUDA_ERROR)
        raise OSError("disk on fire")
    monkeypatch.setattr(sys.modules["torch"], "load", broken)
    with pytest.raises(RuntimeError) as e:
        wire.loads(wire.dumps(FakeTensor([1], "cuda:0")).to_bytes())
    msg = str(e.value)
    assert "CUDA device" in msg and "on the CPU instead also failed" in msg and "disk on fire" in msg
