"""``requires=``: task environments built by uv on workers that allow installs, cached,
reused across jobs and kept within a size cap; refused where installs are not allowed."""

from __future__ import annotations

import os
import time

import pytest

from gpumesh import Unsatisfiable, accelerate
from gpumesh.worker.envs import find_uv

from ..conftest import Proc

pytestmark = pytest.mark.skipif(find_uv() is None, reason="uv is not installed (the installs extra)")


def _join(mesh, name: str, *flags: str, **env) -> Proc:
    e = dict(mesh.env, GM_WORKER_NAME=name, **env)
    before = mesh.alive()
    proc = Proc(["join", mesh.url, *flags], e, mesh.root / f"worker-{name}.log")
    mesh.procs.append(proc)
    mesh.wait_alive(before + 1, proc)
    return proc


def _where(mod: str):
    def where(i):
        import importlib
        import os as _os
        m = importlib.import_module(mod)
        return i, _os.environ["GM_WORKER_NAME"], m.__file__
    where.__name__ = where.__qualname__ = f"where_{mod}"
    return where


def _envs(root):
    return sorted(p for p in root.iterdir() if not p.name.startswith(".")) if root.exists() else []


@pytest.mark.timeout(600)
def test_environment_is_built_once_and_reused_across_jobs(make_mesh, tmp_path):
    envs = tmp_path / "envs"
    mesh = make_mesh(workers=0)
    _join(mesh, "installs", "--allow-installs", GPUMESH_ENV_DIR=str(envs))
    (w,) = mesh.workers()
    assert w["allow_installs"] is True
    m = mesh.client()
    fn = accelerate(m, requires=["six"])(_where("six"))

    t0 = time.monotonic()
    first = fn(1)
    built_s = time.monotonic() - t0
    (env,) = _envs(envs)
    assert first[:2] == (1, "installs")
    assert first[2].startswith(str(env / "site"))  # imported from the environment
    inode, made = (env / "site").stat().st_ino, (env / "ready").stat().st_mtime

    t0 = time.monotonic()
    again = fn.map([2, 3, 4])  # another job, the same requirements
    reused_s = time.monotonic() - t0
    assert [r[:2] for r in again] == [(2, "installs"), (3, "installs"), (4, "installs")]
    assert all(r[2] == first[2] for r in again)
    assert _envs(envs) == [env] and (env / "site").stat().st_ino == inode  # not rebuilt
    assert (env / "ready").stat().st_mtime >= made  # used again: most recent for LRU
    print(f"\nrequires=['six']: first call (build) {built_s:.2f} s, next job (reuse) {reused_s:.2f} s")


def test_a_worker_without_allow_installs_never_gets_it(make_mesh):
    mesh = make_mesh(workers=0)
    _join(mesh, "plain")
    assert mesh.workers()[0]["allow_installs"] is False
    m = mesh.client()
    with pytest.raises(Unsatisfiable) as e:
        accelerate(m, requires=["six", "cloudpickle"])(_where("six"))(1)
    assert "six" in str(e.value) and "--allow-installs" in str(e.value)
    # what it has already is enough, without installing anything
    got = accelerate(m, requires=["cloudpickle>=3"])(_where("cloudpickle"))(1)
    assert got[:2] == (1, "plain") and "site-packages" in got[2]


@pytest.mark.timeout(600)
def test_only_workers_that_allow_installs_take_it(make_mesh, tmp_path):
    mesh = make_mesh(workers=0)
    _join(mesh, "plain")
    _join(mesh, "installs", "--allow-installs", GPUMESH_ENV_DIR=str(tmp_path / "envs"))
    m = mesh.client()
    got = accelerate(m, requires=["six"])(_where("six")).map(list(range(6)))
    assert [g[:2] for g in got] == [(i, "installs") for i in range(6)]
    # a call without requires= still goes to either
    names = {accelerate(m)(lambda i: os.environ["GM_WORKER_NAME"]).map(range(8))[i] for i in range(8)}
    assert names <= {"plain", "installs"}


@pytest.mark.timeout(600)
def test_the_cache_stays_within_its_cap_least_recently_used_first(make_mesh, tmp_path):
    envs = tmp_path / "envs"
    mesh = make_mesh(workers=0)
    # six is ~40 KB installed, colorama ~80 KB: both do not fit in 100 KB
    _join(mesh, "installs", "--allow-installs", GPUMESH_ENV_DIR=str(envs),
          GPUMESH_ENV_CACHE_MB=str(100 / 1024))
    m = mesh.client()
    six_file = accelerate(m, requires=["six"])(_where("six"))(1)[2]
    assert len(_envs(envs)) == 1 and os.path.exists(six_file)
    color_file = accelerate(m, requires=["colorama"])(_where("colorama"))(1)[2]
    (left,) = _envs(envs)  # the least recently used (six) was evicted
    assert color_file.startswith(str(left)) and not os.path.exists(six_file)
    total = sum(f.stat().st_size for f in left.rglob("*") if f.is_file())
    assert total <= 100 * 1024
    # six again: rebuilt, and colorama's goes in turn
    assert accelerate(m, requires=["six"])(_where("six"))(2)[:2] == (2, "installs")
    assert len(_envs(envs)) == 1 and not os.path.exists(color_file)


def test_requires_is_validated_when_decorating(make_mesh):
    m = make_mesh(workers=0).client()
    for bad in ("six", ["six; python_version<'3'"], ["not a req !!"], [3], ["x @ https://e.x/x.whl"]):
        with pytest.raises(ValueError, match="requires"):
            accelerate(m, requires=bad)(lambda: 1)
