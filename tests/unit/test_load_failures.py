"""A call whose arguments (or function) do not load on the worker says so, and names the
worker's versions of the packages involved; a submodule missing from a package the worker
has is a version gap, not a module the worker lacks (gpumesh.worker.loadfail).

The caller's and the worker's versions of one fake package, ``gmverpkg``, are two
directories: this process pickles with version 2, the task runs with version 1 first on
its ``sys.path`` (as a task environment is put there), on both runtimes."""

from __future__ import annotations

import os
import sys

import pytest

from gpumesh import packages, wire
from gpumesh.protocol import TaskGrant
from gpumesh.worker import loadfail, procs, runner
from gpumesh.worker.executor import Executor
from gpumesh.worker.spawn import SpawnExecutor

from ..conftest import function_blob

PKG = "gmverpkg"

RUNTIMES = [pytest.param(Executor, id="fork", marks=pytest.mark.skipif(
    bool(procs.fork_missing()), reason="no fork runtime here")), pytest.param(SpawnExecutor, id="spawn")]


def _version(root, version: str, files: dict[str, str]):
    """``root``: an installed ``gmverpkg`` of ``version`` (a dist-info names it)."""
    for rel, text in files.items():
        p = root / PKG / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    info = root / f"{PKG}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {PKG}\nVersion: {version}\n")
    return root


@pytest.fixture
def versions(tmp_path):
    """``(new, old)``: version 2.0 (a ``_core.arrays`` submodule; ``Frame`` pickles as
    ``make(1, 2)``) and 1.0 (no ``_core``; its ``make`` takes one argument less)."""
    new = _version(tmp_path / "new", "2.0", {
        "__init__.py": ("from ._core.arrays import Frame\n"
                        "def make(*args):\n"
                        "    if len(args) != 2:\n"
                        "        raise TypeError('make() takes 2 positional arguments')\n"
                        "    return Frame()\n"),
        "_core/__init__.py": "",
        "_core/arrays.py": (
            "class Frame:\n"
            "    def __reduce__(self):\n"
            "        import gmverpkg\n"
            "        return gmverpkg.make, (1, 2)\n"
            "class Array:\n    pass\n")})
    old = _version(tmp_path / "old", "1.0", {
        "__init__.py": ("def make(*args):\n"
                        "    if len(args) != 1:\n"
                        "        raise TypeError(f'make() takes 1 positional argument but "
                        "{len(args)} were given')\n")})
    sys.path.insert(0, str(new))
    try:
        yield new, old
    finally:
        sys.path.remove(str(new))
        for name in [m for m in sys.modules if m == PKG or m.startswith(PKG + ".")]:
            del sys.modules[name]


@pytest.fixture(params=RUNTIMES)
def ex(request, tmp_path):
    e = request.param(spool=tmp_path / "spool")
    yield e
    e.close()


def _identity(x):
    return x


def _run_with(ex, tmp_path, old, value):
    h, path = function_blob(tmp_path, _identity)
    ex.new_output()
    body = b"".join(bytes(c) for c in wire.dumps(((value,), {})).chunks)
    return ex.run(TaskGrant(os.urandom(8).hex(), "-", h, timeout=60), path, body,
                  sys_path=[str(old)])


def test_a_submodule_missing_from_the_workers_version_is_a_version_gap(ex, tmp_path, versions):
    from gmverpkg._core.arrays import Array
    new, old = versions
    out = _run_with(ex, tmp_path, old, Array())
    assert out.status == "error", out
    err = out.error
    assert err["kind"] == "unpickle"
    assert err["type"] == "ModuleNotFoundError"
    # still a module (the coordinator tries another worker), but with the package it is of
    assert err["module"] == "gmverpkg._core"
    assert (err["package"], err["package_version"]) == ("gmverpkg", "1.0")
    assert err["message"] == (
        "No module named 'gmverpkg._core' (raised while loading the call's arguments on "
        "the worker, before the function ran; this worker has gmverpkg 1.0, which has no "
        "gmverpkg._core: the caller's gmverpkg is likely another version)")


def test_a_package_that_raises_while_loading_arguments_is_named_with_its_version(ex, tmp_path, versions):
    from gmverpkg import Frame
    new, old = versions
    out = _run_with(ex, tmp_path, old, Frame())
    err = out.error
    assert (err["kind"], err["type"]) == ("unpickle", "TypeError")
    assert "module" not in err and "package" not in err
    assert err["message"] == (
        "make() takes 1 positional argument but 2 were given (raised while loading the "
        "call's arguments on the worker, before the function ran; this worker has "
        "gmverpkg 1.0: compare with the caller's versions)")


def test_a_package_missing_altogether_is_not_a_version_gap():
    try:
        import gm_absent_pkg.sub  # noqa: F401
    except ModuleNotFoundError as e:
        err = runner.describe_exception(e, "raised")
    assert err["module"] == "gm_absent_pkg"  # (the top level is what is missing)
    assert "package" not in err
    # a missing submodule of the standard library's packages is a gap of nothing to name
    try:
        import json.gm_nothing_here  # noqa: F401
    except ModuleNotFoundError as e:
        assert loadfail.version_gap(e) is None
        assert "package" not in runner.describe_exception(e, "raised")


def test_traceback_packages_leave_out_the_machinery_and_the_standard_library(versions):
    import json
    import pickle

    import gmverpkg
    try:  # frames of this test (no distribution), pickle and json (stdlib), gmverpkg
        pickle.loads(pickle.dumps(gmverpkg.Frame()))
        json.loads("[1]", object_hook=None, parse_int=lambda s: gmverpkg.make(s))
    except TypeError as e:
        assert packages.traceback_packages(e.__traceback__) == {"gmverpkg": "2.0"}
    try:
        json.loads("{")
    except ValueError as e:
        assert packages.traceback_packages(e.__traceback__) == {}
    assert packages.module_distribution(PKG) == ("gmverpkg", "2.0")
    assert packages.module_distribution("gm_absent_pkg") is None
