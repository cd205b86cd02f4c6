"""``gpumesh doctor`` compares the pool: Python and gpumesh versions, and packages."""

from __future__ import annotations

import json
import os
import platform

from click.testing import CliRunner

from gpumesh._version import __version__
from gpumesh.cli import main
from gpumesh.cli import doctor
from gpumesh.cli.doctor import pool_checks

from ..conftest import Proc


def _w(wid, host, python, version=__version__, packages=None):
    return {"id": wid, "hostname": host, "python": python, "version": version, "alive": True,
            "packages": packages if packages is not None else {"cloudpickle": "3.1.1"}}


def test_pool_checks_name_the_workers_that_differ(monkeypatch):
    monkeypatch.setattr(doctor, "installed", lambda: {"cloudpickle": "3.1.1"})
    here = platform.python_version()
    other = "3.99.0"
    checks = {c.name: c for c in pool_checks(
        [_w("aaaaaaaa11", "laptop-a", here, packages={"cloudpickle": "3.1.1", "numpy": "1.26.4"}),
         _w("bbbbbbbb22", "laptop-b", other, "0.0.9", {"cloudpickle": "3.0.0"})],
        "http://192.0.2.10:8000")}
    py = checks["pool python"]
    assert py.status == "warn"
    assert "Python 3.99: laptop-b (bbbbbbbb)" in py.detail and "laptop-a (aaaaaaaa)" in py.detail
    gm = checks["pool gpumesh"]
    assert gm.status == "fail" and "gpumesh 0.0.9: laptop-b (bbbbbbbb)" in gm.detail
    assert gm.fix.endswith(f"pip install http://192.0.2.10:8000/v1/dist/gpumesh-{__version__}-py3-none-any.whl")
    pk = checks["pool packages"]
    assert pk.status == "warn"
    assert "numpy (1 of 2: laptop-a (aaaaaaaa))" in pk.detail
    assert "cloudpickle 3.0.0/3.1.1" in pk.detail
    same = {c.name: c.status for c in pool_checks(
        [_w("a1a1", "a", here), _w("b2b2", "b", here)], "http://x:1")}
    assert same == {"pool python": "ok", "pool gpumesh": "ok", "pool packages": "ok"}


def test_pool_packages_lead_with_what_pickles_carry_and_compare_this_machine(monkeypatch):
    monkeypatch.setattr(doctor, "installed", lambda: {"numpy": "2.5.5", "pip": "1", "zzz": "1"})
    here = platform.python_version()
    a = {"aaa": "1", "numpy": "1.26.4", "pip": "24.0", "setuptools": "1", "cloudpickle": "3.0.0"}
    b = {"aaa": "2", "numpy": "1.26.4", "pip": "25.1", "setuptools": "2", "cloudpickle": "3.1.3"}
    checks = {c.name: c for c in pool_checks([_w("a1a1", "a", here, packages=a),
                                              _w("b2b2", "b", here, packages=b)], "http://x:1")}
    detail = checks["pool packages"].detail
    # cloudpickle first, then numpy (the same on both workers, another version here); the
    # installers (pip, setuptools) are left out, whatever their versions.
    assert detail == ("in different versions: cloudpickle 3.0.0/3.1.3, numpy 1.26.4 (here 2.5.5), "
                      "aaa 1/2")
    # A pool that differs only in its installers is the same pool.
    same = {**a, "aaa": "1", "cloudpickle": "3.0.0", "numpy": "2.5.5"}
    checks = {c.name: c for c in pool_checks([_w("a1a1", "a", here, packages=same),
                                              _w("b2b2", "b", here, packages=dict(same, pip="9"))],
                                             "http://x:1")}
    assert checks["pool packages"].status == "ok"


def test_doctor_on_a_pool_where_one_worker_has_an_extra_package(make_mesh, tmp_path):
    mesh = make_mesh(workers=1)
    extra = tmp_path / "site"
    (extra / "gmextra-2.5.dist-info").mkdir(parents=True)
    (extra / "gmextra-2.5.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: gmextra\nVersion: 2.5\n")
    env = dict(mesh.env, PYTHONPATH=os.pathsep.join(filter(None, [str(extra), mesh.env.get("PYTHONPATH")])))
    proc = Proc(["join", mesh.url], env, mesh.root / "worker-extra.log")
    mesh.procs.append(proc)
    mesh.wait_alive(2, proc)
    with_it = next(w for w in mesh.workers() if "gmextra" in w["packages"])
    r = CliRunner().invoke(main, ["doctor", "--json"], env={
        "GPUMESH_URL": mesh.url, "GPUMESH_TOKEN": mesh.token,
        "GPUMESH_CONFIG": mesh.env["GPUMESH_CONFIG"], "NO_COLOR": None})
    checks = {c["name"]: c for c in json.loads(r.output)["checks"]}
    assert checks["pool python"]["status"] == "ok"
    assert checks["pool gpumesh"]["status"] == "ok"
    assert checks["pool gpumesh"]["detail"].startswith(f"gpumesh {__version__}: ")
    assert checks["pool packages"]["status"] == "warn"
    assert f"gmextra (1 of 2: {with_it['hostname']} ({with_it['id'][:8]}))" in checks["pool packages"]["detail"]
    assert r.exit_code == 0, r.output  # warnings only
