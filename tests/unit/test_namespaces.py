"""gpumesh.namespaces: a module of the caller's own code, shipped by value, arrives as one
module: what a task sets in it is what the module's own functions read, a cache the module
keeps is the one the task sees, and payloads loaded apart (a job's function, each task's
arguments) share it. Each payload is loaded in another Python process, as on a worker
where the module cannot be imported."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import textwrap
import uuid

import pytest

from gpumesh import localcode, namespaces, wire

_LOAD = """
import ast, sys
from gpumesh import wire
out, paths = sys.argv[1], sys.argv[2:]
loaded = [wire.loads(bytearray(open(p, "rb").read())) for p in paths]
fn, rest = loaded[0], loaded[1:]
value = fn(*rest)
open(out, "wb").write(wire.dumps(value).to_bytes())  # (the result, as a worker posts it)
print(repr(value))
"""


@pytest.fixture
def module(tmp_path, monkeypatch):
    """``make(source)``: a module of a new name, imported from a folder only this process
    has on sys.path, and registered by value as the caller's own code."""
    monkeypatch.delenv("GPUMESH_SHIP_LOCAL", raising=False)
    monkeypatch.delenv("GPUMESH_IN_TASK", raising=False)
    folder = tmp_path / "code"
    folder.mkdir()
    monkeypatch.syspath_prepend(str(folder))
    made: list[str] = []
    localcode.reset()

    def make(source: str):
        name = f"gm_ns_{uuid.uuid4().hex[:8]}"
        (folder / f"{name}.py").write_text(textwrap.dedent(source))
        importlib.invalidate_caches()
        made.append(name)
        mod = importlib.import_module(name)
        localcode.ship()
        assert name in localcode._registered
        return mod

    yield make
    localcode.reset()
    for name in made:
        sys.modules.pop(name, None)


def _run_elsewhere(tmp_path, *objs, result: bool = False) -> object:
    """Pickle ``objs`` as the caller does (the first as a function blob, each apart), load
    them in a new Python process that cannot import the caller's modules, and return the
    value of ``objs[0](*objs[1:])`` there: its repr read back, or with ``result`` the value
    itself, pickled there and loaded here, as a result comes back."""
    paths = []
    for i, obj in enumerate(objs):
        path = tmp_path / f"payload{i}"
        path.write_bytes(wire.dumps(obj, code=i == 0).to_bytes())
        paths.append(str(path))
    work = tmp_path / "elsewhere"
    work.mkdir(exist_ok=True)
    out = tmp_path / "result"
    done = subprocess.run([sys.executable, "-c", _LOAD, str(out), *paths], cwd=work,
                          capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    if result:
        return wire.loads(bytearray(out.read_bytes()))
    return ast.literal_eval(done.stdout.strip())


def test_a_setting_the_task_changes_is_what_the_modules_functions_read(module, tmp_path):
    cfg = module("""
        THRESHOLD = 1
        def above(xs):
            return [x for x in xs if x > THRESHOLD]
    """)
    cfg.THRESHOLD = 2  # the caller configures it before the call

    def task(t):
        before = cfg.above([1, 2, 3, 4])
        cfg.THRESHOLD = t
        return before, cfg.above([1, 2, 3, 4])

    assert _run_elsewhere(tmp_path, task, 3) == ([3, 4], [4])
    assert cfg.THRESHOLD == 2  # (the caller's module is its own)


def test_a_cache_the_module_keeps_is_the_one_the_task_sees(module, tmp_path):
    cache = module("""
        _MODEL = None
        LOADS = 0
        def get_model():
            global _MODEL, LOADS
            if _MODEL is None:
                LOADS += 1
                _MODEL = {"weights": [1, 2, 3]}
            return _MODEL
        def predict(x):
            return sum(get_model()["weights"]) * x
    """)
    predict = cache.predict  # (as `from cache import predict` at the top of a script)

    def task(x):
        y = predict(x)
        return y, cache.LOADS, cache.get_model() is cache._MODEL

    assert _run_elsewhere(tmp_path, task, 2) == (12, 1, True)
    assert cache.LOADS == 0


def test_a_function_of_the_module_in_the_arguments_shares_the_functions_module(module, tmp_path):
    counter = module("""
        CALLS = 0
        def count():
            global CALLS
            CALLS += 1
            return CALLS
    """)

    def task(fn_from_args):
        fn_from_args()
        fn_from_args()
        return counter.count(), counter.CALLS

    # the job's function and a task's arguments are two payloads, loaded one after the other
    assert _run_elsewhere(tmp_path, task, counter.count) == (3, 3)


def test_two_callers_modules_of_one_name_stay_apart():
    a = namespaces.module("a" * 16, "gm_ns_shared")
    b = namespaces.module("b" * 16, "gm_ns_shared")
    assert a is not b and a.__name__ == b.__name__ == "gm_ns_shared"
    assert namespaces.module("a" * 16, "gm_ns_shared") is a
    with namespaces.Scope():
        inside = namespaces.module("a" * 16, "gm_ns_shared")
    assert inside is not a  # a scope (the inline backend's job) has modules of its own


def test_the_registry_drops_the_oldest_module_past_its_bound(monkeypatch):
    monkeypatch.setattr(namespaces, "MAX_MODULES", 3)
    with namespaces.Scope():
        first = namespaces.module("c" * 16, "m0")
        for i in range(1, 4):
            namespaces.module("c" * 16, f"m{i}")
        assert namespaces.module("c" * 16, "m0") is not first


def test_run_locally_the_task_changes_its_own_copy_of_the_module(module, monkeypatch):
    cfg = module("""
        THRESHOLD = 1
        def above(xs):
            return [x for x in xs if x > THRESHOLD]
    """)
    cfg.THRESHOLD = 2
    monkeypatch.setenv("GPUMESH_LOCAL", "1")
    from gpumesh import mesh

    @mesh
    def task(t):
        before = cfg.above([1, 2, 3, 4])
        cfg.THRESHOLD = t
        return before, cfg.above([1, 2, 3, 4])

    assert task(3) == ([3, 4], [4])
    assert task(1) == ([3, 4], [2, 3, 4])  # (each call a job of its own: the caller's module as it is)
    assert cfg.THRESHOLD == 2  # not the caller's module: a worker's copy, as on the mesh


SCALER = """
    THRESHOLD = 1
    class Scaler:
        def __init__(self, k):
            self.k = k
        def scale(self, x):
            return x * self.k * THRESHOLD
"""


def test_a_returned_instance_of_the_callers_class_leaves_that_class_as_it_was(module, tmp_path):
    settings = module(SCALER)
    method = settings.Scaler.scale

    def task(t):
        settings.THRESHOLD = t
        s = settings.Scaler(2)
        return s, s.scale(10)

    got, there = _run_elsewhere(tmp_path, task, 7, result=True)
    assert there == 140 and type(got) is settings.Scaler and got.k == 2
    # the caller's class was not given the task's methods (which read the task's module)
    assert settings.Scaler.scale is method and settings.Scaler(2).scale(10) == 20
    settings.THRESHOLD = 3
    assert got.scale(10) == 60


def test_run_locally_a_class_of_the_callers_module_reads_the_tasks_copy(module, monkeypatch):
    settings = module(SCALER)
    method = settings.Scaler.scale
    monkeypatch.setenv("GPUMESH_LOCAL", "1")
    from gpumesh import mesh

    @mesh
    def task(t, s):
        settings.THRESHOLD = t
        return s.scale(10), isinstance(s, settings.Scaler), s

    (value, same_class, back), = task.map([(5, settings.Scaler(2))])
    assert (value, same_class) == (100, True)  # as on a worker: the task's THRESHOLD
    assert type(back) is settings.Scaler  # a returned one is the caller's class
    assert settings.THRESHOLD == 1 and settings.Scaler.scale is method
    assert settings.Scaler(2).scale(10) == 20
