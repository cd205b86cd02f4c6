"""``accelerate.install(m)`` makes ``m`` the mesh of bare ``@accelerate`` *and* bare
``@mesh`` (and ``from gpumesh import mesh``): the README's ``@accelerate(m)  # ... or bare
@mesh`` holds once a program installed ``m``."""

from __future__ import annotations

import os

import pytest

from gpumesh import GPUMesh, accelerate, mesh
from gpumesh.client import pipeline, remote

from ..conftest import free_port


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """No mesh installed, the default mesh not yet connected; $GPUMESH_URL names one
    nothing answers for (no saved config)."""
    monkeypatch.setattr(accelerate, "_installed", None)
    monkeypatch.setattr(remote.mesh, "_mesh", None)
    monkeypatch.setattr(pipeline, "_notices", set())
    monkeypatch.setenv("GPUMESH_CONFIG", str(tmp_path / "config.json"))
    monkeypatch.setenv("GPUMESH_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("GPUMESH_TOKEN", "t")
    for name in ("GPUMESH_LOCAL", "GPUMESH_IN_TASK"):
        monkeypatch.delenv(name, raising=False)
    yield
    if remote.mesh._mesh is not None:
        remote.mesh._mesh.close()


def test_bare_mesh_uses_the_installed_mesh_like_bare_accelerate(fresh):
    @mesh
    def before(x):  # decorated before the install: looked up at each call
        return x + 1

    default = before.mesh
    assert isinstance(default, GPUMesh) and default.url == os.environ["GPUMESH_URL"]

    m = GPUMesh(f"http://127.0.0.1:{free_port()}", token="t", output=False)
    accelerate.install(m)

    @mesh
    def after(x):
        return x * 2

    @mesh(timeout=30)
    def with_options(x):
        return x - 1

    @accelerate
    def bare(x):
        return x

    assert before.mesh is m and after.mesh is m and with_options.mesh is m and bare.mesh is m
    assert mesh.resolve() is m and mesh.url == m.url  # attribute access: the same mesh
    # nothing answers there: run here, with the same values
    assert (before(1), after(2), with_options.map([1, 2])) == (2, 4, [0, 1])

    # a mesh named on the decorator keeps it
    other = GPUMesh(f"http://127.0.0.1:{free_port()}", token="t", output=False)

    @accelerate(other)
    def own(x):
        return x

    assert own.mesh is other

    # installed again: the latest one
    accelerate.install(other)
    assert before.mesh is other and after.mesh is other and mesh.url == other.url


def test_installing_the_default_mesh_itself_keeps_it_lazy(fresh):
    accelerate.install(mesh)

    @mesh
    def f(x):
        return x

    assert f.mesh.url == os.environ["GPUMESH_URL"]
    assert f.mesh is mesh.resolve()
    assert "accelerate.install()" in repr(mesh)
