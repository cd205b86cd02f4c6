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
from pathlib import Path

import pytest

import gpumesh
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
    # (PYTHONPATH: this gpumesh, not whichever the interpreter has installed)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(gpumesh.__file__).parents[1])}
    done = subprocess.run([sys.executable, "-c", _LOAD, str(out), *paths], cwd=work,
                          capture_output=True, text=True, timeout=60, env=env)
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


_LOCKMOD = """
    import threading
    _lock = threading.Lock()
    LIMIT = 2
    def above(xs):
        return [x for x in xs if x > LIMIT]
    def locked():
        with _lock:
            return 1
"""


def _error_elsewhere(tmp_path, task) -> str:
    """The ``AttributeError`` text that ``task()`` raises in another Python process."""
    def catching():
        try:
            task()
        except AttributeError as e:
            return f"AttributeError: {e}"
        return "no error"
    return _run_elsewhere(tmp_path, catching)


def test_a_value_that_cannot_be_pickled_stays_behind_when_the_task_never_reads_it(
        module, tmp_path):
    """``lockmod.above(xs)`` (the module object read, so its whole namespace travels)
    failed with "global 'lockmod' of the function b cannot be sent to a worker: cannot
    pickle '_thread.lock' object", though the task never touches ``_lock``."""
    lockmod = module(_LOCKMOD)

    def task(xs):
        return lockmod.above(xs)

    assert _run_elsewhere(tmp_path, task, [1, 2, 3, 4]) == [3, 4]
    # Read there, a name left behind says where it is and why, not just "no attribute".
    text = _error_elsewhere(tmp_path, lambda: lockmod._lock)
    assert text == (
        f"AttributeError: module {lockmod.__name__!r} has no attribute '_lock' here: it "
        f"stayed on the caller, because its value cannot be pickled (TypeError: cannot "
        f"pickle '_thread.lock' object), so it did not travel with the function. A task that "
        f"needs it must make its own (inside the function, or lazily in the module), or it "
        f"must be made picklable")
    # A function that reads it stays too, and names the global it fails on.
    text = _error_elsewhere(tmp_path, lambda: lockmod.locked())
    assert "has no attribute 'locked' here: it stayed on the caller, because its value " \
           "cannot be pickled (it reads the global '_lock', which cannot be pickled: " \
           "TypeError: cannot pickle '_thread.lock' object)" in text


def test_a_modules_own_getattr_still_answers_beside_the_names_left_behind(module, tmp_path):
    lazy = module("""
        import threading
        _lock = threading.Lock()
        def __getattr__(name):
            if name == "LAZY":
                return 42
            raise AttributeError(f"lazy has no {name}")
    """)

    def task():
        try:
            _ = lazy._lock
        except AttributeError as e:
            left = "stayed on the caller" in str(e)
        try:
            _ = lazy.OTHER
        except AttributeError as e:
            other = str(e)
        return lazy.LAZY, left, other

    assert _run_elsewhere(tmp_path, task) == (42, True, "lazy has no OTHER")


def test_only_a_failure_tries_the_modules_values_one_by_one(module, monkeypatch):
    """The normal path pickles each value once: the one-by-one tries are the failure's."""
    plain = module("""
        LIMIT = 2
        def above(xs):
            return [x for x in xs if x > LIMIT]
    """)
    tried: list[object] = []
    real = wire._why_not
    monkeypatch.setattr(wire, "_why_not", lambda v: tried.append(v) or real(v))

    def task(xs):
        return plain.above(xs)

    wire.dumps(task, code=True)
    assert tried == []
    lockmod = module(_LOCKMOD)

    def task2(xs):
        return lockmod.above(xs)

    wire.dumps(task2, code=True)
    assert lockmod._lock in tried and lockmod.above in tried
    # A failure with no module of the caller's in it is not tried again.
    import threading
    tried.clear()
    with pytest.raises(TypeError, match="cannot pickle '_thread.lock' object"):
        wire.dumps([threading.Lock()], code=True)
    assert tried == []


def test_a_payload_that_leaves_a_name_behind_drops_the_value_an_earlier_one_brought():
    with namespaces.Scope():
        mod = namespaces.module("d" * 16, "gm_ns_left")
        namespaces._update(mod, {"X": 1, "Y": 2})
        namespaces._update(mod, {"Y": 3, namespaces._LEFT: {"X": "TypeError: no"}})
        assert mod.Y == 3
        with pytest.raises(AttributeError, match="'X' here: it stayed on the caller"):
            _ = mod.X
        # a later payload that does not leave X behind keeps it known as left behind
        namespaces._update(mod, {"Y": 4})
        with pytest.raises(AttributeError, match="stayed on the caller"):
            _ = mod.X


def test_run_locally_a_value_that_cannot_be_pickled_stays_behind(module, monkeypatch):
    lockmod = module(_LOCKMOD)
    monkeypatch.setenv("GPUMESH_LOCAL", "1")
    from gpumesh import mesh

    @mesh
    def b(xs):
        return lockmod.above(xs)

    @mesh
    def needs_it():
        with lockmod._lock:
            return 1

    assert b([1, 2, 3, 4]) == [3, 4]
    with pytest.raises(AttributeError, match="'_lock' here: it stayed on the caller"):
        needs_it()


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
