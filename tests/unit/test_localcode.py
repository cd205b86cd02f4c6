"""gpumesh.localcode: which loaded modules are the caller's own code (sent by value), the
cache that keeps the per-call look cheap, the off switch, and wire.dumps with such a
module registered (plain data still goes through the C pickler)."""

from __future__ import annotations

import importlib
import json
import pickle
import struct
import sys
import textwrap
import uuid

import cloudpickle
import numpy
import pytest

import gpumesh
from gpumesh import localcode, wire


def _registry() -> set[str]:
    return cloudpickle.cloudpickle._PICKLE_BY_VALUE_MODULES


def _stream(p: wire.Payload) -> bytes:
    """The pickle stream of a payload (wire.py's layout)."""
    raw = p.to_bytes()
    nbuf, n = struct.unpack_from("<IQ", raw, 4)
    off = 16 + 8 * nbuf
    off += (-off) % wire.ALIGN
    return raw[off:off + n]


@pytest.fixture
def fresh(monkeypatch):
    """localcode with nothing classified or registered, before and after."""
    monkeypatch.delenv("GPUMESH_SHIP_LOCAL", raising=False)
    monkeypatch.delenv("GPUMESH_IN_TASK", raising=False)
    localcode.reset()
    yield
    localcode.reset()


@pytest.fixture
def on_path(tmp_path, monkeypatch):
    """``make(source, package=False)``: a module of a new name in a temp dir on sys.path,
    imported; removed from sys.modules afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    made: list[str] = []

    def make(source: str = "", package: bool = False, name: str | None = None):
        name = name or f"gm_lc_{uuid.uuid4().hex[:8]}"
        if package:
            (tmp_path / name).mkdir()
            (tmp_path / name / "__init__.py").write_text("")
            (tmp_path / name / "sub.py").write_text(textwrap.dedent(source))
        else:
            (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        importlib.invalidate_caches()
        made.append(name)
        return importlib.import_module(name + (".sub" if package else ""))

    yield make
    for name in made:
        for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
            del sys.modules[key]


def test_a_module_in_a_directory_on_sys_path_is_local(fresh, on_path):
    mod = on_path("X = 1\n")
    assert localcode.is_local(mod.__name__, mod) is True
    assert mod.__name__ in localcode.local_modules()


def test_a_package_in_a_directory_on_sys_path_is_local(fresh, on_path):
    sub = on_path("X = 1\n", package=True)
    top = sub.__name__.partition(".")[0]
    assert localcode.is_local(top, sys.modules[top]) is True
    assert top in localcode.local_modules()
    assert sub.__name__ not in localcode.local_modules()  # (the top-level name covers it)


def test_stdlib_site_packages_gpumesh_and_main_are_not_local(fresh):
    assert localcode.is_local("json", json) is False
    assert localcode.is_local("numpy", numpy) is False
    assert localcode.is_local("gpumesh", gpumesh) is False
    assert localcode.is_local("pytest", pytest) is False
    assert localcode.is_local("__main__", sys.modules["__main__"]) is False
    assert localcode.is_local("sys", sys) is False  # built in: no file
    local = localcode.local_modules()
    for name in ("json", "numpy", "gpumesh", "pytest", "cloudpickle", "__main__", "sys"):
        assert name not in local


def test_a_module_an_installed_distribution_provides_is_not_local(fresh, on_path, tmp_path):
    name = f"gm_lc_dist_{uuid.uuid4().hex[:8]}"
    info = tmp_path / f"{name}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "top_level.txt").write_text(name + "\n")
    mod = on_path("X = 1\n", name=name)
    assert localcode.is_local(name, mod) is False
    other = on_path("X = 2\n")  # beside it, provided by nothing
    assert localcode.is_local(other.__name__, other) is True


def test_names_starting_with_an_underscore_are_not_local(fresh, on_path):
    mod = on_path("X = 1\n", name=f"_gm_lc_{uuid.uuid4().hex[:8]}")
    assert localcode.is_local(mod.__name__, mod) is False


def test_ship_registers_local_modules_by_value(fresh, on_path):
    mod = on_path("X = 1\n")
    localcode.ship()
    assert mod.__name__ in _registry()
    assert "numpy" not in _registry() and "json" not in _registry()
    localcode.reset()
    assert mod.__name__ not in _registry()


def test_no_rescan_while_sys_modules_is_unchanged(fresh, on_path, monkeypatch):
    on_path("X = 1\n")
    localcode.ship()
    looked: list[str] = []
    real = localcode.is_local
    monkeypatch.setattr(localcode, "is_local", lambda n, m: looked.append(n) or real(n, m))
    for _ in range(100):
        localcode.ship()
    assert looked == []
    mod = on_path("Y = 2\n")  # one module more: only it is classified
    localcode.ship()
    assert looked == [mod.__name__]
    assert mod.__name__ in _registry()


def test_ship_local_0_registers_nothing_and_unregisters(fresh, on_path, monkeypatch):
    mod = on_path("X = 1\n")
    monkeypatch.setenv("GPUMESH_SHIP_LOCAL", "0")
    localcode.ship()
    assert mod.__name__ not in _registry()
    monkeypatch.delenv("GPUMESH_SHIP_LOCAL")
    localcode.ship()
    assert mod.__name__ in _registry()
    monkeypatch.setenv("GPUMESH_SHIP_LOCAL", "0")
    localcode.ship()
    assert mod.__name__ not in _registry()


def test_inside_a_task_nothing_is_registered(fresh, on_path, monkeypatch):
    mod = on_path("X = 1\n")
    monkeypatch.setenv("GPUMESH_IN_TASK", "1")
    localcode.ship()
    assert mod.__name__ not in _registry()


def test_a_module_the_user_registered_stays_registered(fresh, on_path, monkeypatch):
    mod = on_path("X = 1\n")
    cloudpickle.register_pickle_by_value(mod)
    try:
        localcode.ship()
        monkeypatch.setenv("GPUMESH_SHIP_LOCAL", "0")
        localcode.ship()
        assert mod.__name__ in _registry()
    finally:
        cloudpickle.unregister_pickle_by_value(mod)


def test_plain_data_still_uses_the_c_pickler_with_a_local_module_registered(fresh, on_path):
    on_path("class Point:\n    def __init__(self, x):\n        self.x = x\n")
    localcode.ship()
    assert _registry()
    data = {i: i for i in range(100)}
    p = wire.dumps(data)
    assert p.by_value is False
    assert _stream(p) == pickle.dumps(data, protocol=wire.PROTOCOL)
    assert wire.loads(bytearray(p.to_bytes())) == data


def test_an_object_of_a_local_class_goes_by_value(fresh, on_path):
    mod = on_path("class Point:\n    def __init__(self, x):\n        self.x = x\n")
    plain = wire.dumps(mod.Point(3))
    assert plain.by_value is False  # not registered: by reference, as before
    localcode.ship()
    p = wire.dumps([1, mod.Point(3)])
    assert p.by_value is True
    # by value: it loads where the module cannot be imported
    saved = sys.modules[mod.__name__]
    sys.modules[mod.__name__] = None  # type: ignore[assignment]  # (importing it fails)
    try:
        back = wire.loads(bytearray(p.to_bytes()))
    finally:
        sys.modules[mod.__name__] = saved
    assert back[0] == 1 and back[1].x == 3
    assert isinstance(back[1], mod.Point)  # cloudpickle's class tracker: the caller's class


def test_a_function_of_a_local_package_submodule_goes_by_value(fresh, on_path):
    sub = on_path("def double(x):\n    return 2 * x\n", package=True)
    localcode.ship()
    p = wire.dumps(sub.double, code=True)
    assert p.by_value is True
    top = sub.__name__.partition(".")[0]
    saved = {k: sys.modules[k] for k in list(sys.modules) if k == top or k.startswith(top + ".")}
    sys.modules.update(dict.fromkeys(saved))  # (importing them fails)
    try:
        fn = wire.loads(bytearray(p.to_bytes()))
        assert fn(21) == 42
    finally:
        sys.modules.update(saved)


def test_a_module_of_a_project_installed_in_editable_mode_is_not_local(fresh, on_path, tmp_path,
                                                                       monkeypatch):
    # pip install -e PROJECT writes PROJECT's path into a direct_url.json (PEP 610) beside
    # the site-packages records: its modules are installed (workers can install them too).
    site_dir = tmp_path / "fake-site"
    info = site_dir / "gmproj-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "direct_url.json").write_text(json.dumps(
        {"url": tmp_path.as_uri(), "dir_info": {"editable": True}}))
    prefixes = localcode._not_local_prefixes() + (str(site_dir) + "/",)
    monkeypatch.setattr(localcode, "_prefixes", prefixes)
    assert str(tmp_path.resolve()) + "/" in localcode._editable_roots()
    mod = on_path("X = 1\n")  # (in tmp_path: inside the editable project)
    assert localcode.is_local(mod.__name__, mod) is False
    # The same record without "editable" (a direct, non-editable install) names no project.
    localcode.reset()
    (info / "direct_url.json").write_text(json.dumps({"url": tmp_path.as_uri(), "dir_info": {}}))
    monkeypatch.setattr(localcode, "_prefixes", prefixes)
    assert str(tmp_path.resolve()) + "/" not in localcode._editable_roots()
    assert localcode.is_local(mod.__name__, mod) is True
