"""Choosing a backend by URL, resource mapping and the local fallback (no cluster needed,
except where marked)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gpumesh import GPUMesh, accelerate
from gpumesh.client.backends.base import EngineCannotExpress
from gpumesh.client.backends.dask import DaskMesh, dask_resources
from gpumesh.client.backends.ray import RayMesh, ray_options
from gpumesh.client.mesh import GPUMesh as NativeMesh
from gpumesh.hardware import Requirements
from tests.conftest import free_port


def test_scheme_picks_the_backend():
    assert type(GPUMesh("http://127.0.0.1:1", token="t")) is NativeMesh
    assert type(GPUMesh("dask://127.0.0.1:8786")) is DaskMesh
    assert type(GPUMesh("tcp://127.0.0.1:8786")) is DaskMesh
    assert type(GPUMesh("ray://127.0.0.1:10001")) is RayMesh
    assert GPUMesh("ray://auto").address == "auto"
    assert isinstance(GPUMesh("dask://h:1"), GPUMesh)
    with pytest.raises(ValueError, match="http://"):
        GPUMesh("ftp://x", token="t")


def test_env_url_picks_the_backend(monkeypatch):
    monkeypatch.setenv("GPUMESH_URL", "dask://127.0.0.1:8786")
    assert type(GPUMesh()) is DaskMesh


def test_engines_are_imported_only_when_used():
    code = ("import sys; from gpumesh import GPUMesh, accelerate\n"
            "m = GPUMesh('ray://127.0.0.1:1'); d = GPUMesh('dask://127.0.0.1:1')\n"
            "@accelerate(m)\ndef f(): return 1\n"
            "assert 'ray' not in sys.modules and 'distributed' not in sys.modules, sorted(sys.modules)\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_dask_resources():
    assert dask_resources(None) == {}
    assert dask_resources(Requirements.from_options(gpu="cuda", cores=4, memory="8GB")) == \
        {"GPU": 1, "CPU": 4, "MEMORY": 8_000_000_000}
    assert dask_resources(Requirements.from_options(gpu="cpu")) == {}
    for bad in (dict(gpu="A100"), dict(gpu="mps"), dict(gpu_memory="16GB")):
        with pytest.raises(EngineCannotExpress):
            dask_resources(Requirements.from_options(**bad))


def test_ray_options():
    assert ray_options(Requirements.from_options(gpu="gpu", cores=2, memory="1GiB")) == \
        {"num_gpus": 1, "num_cpus": 2, "memory": 2**30}
    assert ray_options(Requirements.from_options(gpu="A100")) == {"num_gpus": 1, "accelerator_type": "A100"}
    assert ray_options(Requirements.from_options(gpu="cpu")) == {"num_gpus": 0}
    for bad in (dict(gpu="mps"), dict(gpu_memory="16GB")):
        with pytest.raises(EngineCannotExpress):
            ray_options(Requirements.from_options(**bad))


def test_inexpressible_hint_is_a_clear_error_before_connecting():
    m = GPUMesh(f"dask://127.0.0.1:{free_port()}")

    @accelerate(m)
    def f(x):
        return x

    with pytest.raises(EngineCannotExpress, match="gpu_memory_mb"):
        f.map([{"x": 1, "gpu_memory_mb": 512}])
    with pytest.raises(EngineCannotExpress, match="A100"):
        accelerate(m, gpu="A100")(f)(1)


def test_retry_on_is_refused_by_engines_before_anything_runs():
    m = GPUMesh(f"dask://127.0.0.1:{free_port()}")
    f = accelerate(m, retries=1, retry_on=OSError)(abs)
    for call in (lambda: f(-1), lambda: f.map([-1, -2]), lambda: f.imap([-1])):
        with pytest.raises(EngineCannotExpress, match="retry_on"):
            call()


def test_native_only_features_say_so():
    m = GPUMesh("dask://127.0.0.1:1")
    with pytest.raises(EngineCannotExpress, match="native"):
        m.jobs()
    with pytest.raises(EngineCannotExpress, match="strict"):
        GPUMesh("ray://auto", strict=True)


@pytest.mark.parametrize("scheme", [
    pytest.param("dask", marks=[pytest.mark.dask, pytest.mark.skipif(
        __import__("importlib").util.find_spec("distributed") is None, reason="dask.distributed is not installed")]),
    pytest.param("ray", marks=[pytest.mark.ray, pytest.mark.skipif(
        __import__("importlib").util.find_spec("ray") is None, reason="ray is not installed")]),
])
def test_unreachable_engine_runs_locally_with_the_notice(scheme, capsys):
    url = f"{scheme}://127.0.0.1:{free_port()}"
    m = GPUMesh(url)

    @accelerate(m)
    def f(x):
        return x + 1

    assert f(1) == 2 and f.map([1, 2]) == [2, 3]
    assert f"[gpumesh] coordinator at {url} is unreachable; running locally" in capsys.readouterr().err
