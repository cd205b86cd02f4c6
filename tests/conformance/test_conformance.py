"""The decorator, ``.map`` and pool API mean the same thing on every backend.

Every test runs against the native mesh, a Dask LocalCluster and a local Ray instance
(see conftest.py). An autouse fixture makes the local fallback raise, so a test that
silently ran in this process fails instead of passing trivially.
"""

from __future__ import annotations

import os
import pickle
import sys
import time

import cloudpickle
import pytest

from gpumesh import (RemoteTraceback, TaskTimeout, Unsatisfiable, accelerate)
from gpumesh.client import pipeline
from gpumesh.client import remote as remote_mod

cloudpickle.register_pickle_by_value(sys.modules[__name__])
try:  # Ray ships functions with its own copy of cloudpickle
    from ray import cloudpickle as _ray_cp
    _ray_cp.register_pickle_by_value(sys.modules[__name__])
except ImportError:
    pass


@pytest.fixture
def m(backend):
    return backend[1]


@pytest.fixture(autouse=True)
def engine_only(monkeypatch):
    def refuse(backend, job):
        raise AssertionError(f"{job.fn!r} ran locally although the backend is up")
    monkeypatch.setattr(pipeline.InlineBackend, "run", refuse)  # every local fallback
    monkeypatch.delenv("GPUMESH_LOCAL", raising=False)


def test_single_call_runs_elsewhere(m):
    @accelerate(m)
    def where(x, y=2, *, z=3):
        import os as _os
        return x + y + z, _os.getpid()

    value, pid = where(1, z=10)
    assert value == 13
    assert pid != os.getpid()


def test_closure_and_local_class(m):
    k = 7

    class Point:
        def __init__(self, x):
            self.x = x

    @accelerate(m)
    def f(p):
        return Point(p.x * k)

    got = f(Point(3))
    assert type(got).__name__ == "Point" and got.x == 21


def test_map_preserves_order(m):
    @accelerate(m)
    def sq(x):
        import time as _t
        _t.sleep(0.02 * (x % 3))  # finish out of order
        return x * x

    items = [3, 1, 3, 2, 1, 0, 3, 5, 2, 2]
    assert sq.map(items) == [x * x for x in items]
    assert sq.map([{"x": 4}, (2,), 7]) == [16, 4, 49]


def test_map_empty_and_many(m):
    @accelerate(m)
    def inc(i):
        return i + 1

    t0 = time.monotonic()
    assert inc.map([]) == []
    assert time.monotonic() - t0 < 0.5
    assert inc.map(range(200)) == list(range(1, 201))


def test_map_cost_hint_is_stripped(m):
    @accelerate(m)
    def f(x):
        return x * 10

    assert f.map([{"x": 1, "cost": 5}, {"x": 2}]) == [10, 20]


def test_exception_keeps_type_and_remote_traceback(m):
    @accelerate(m)
    def lookup_missing(d):
        return d["x"]

    with pytest.raises(KeyError) as ei:
        lookup_missing({})
    exc = ei.value
    assert type(exc) is KeyError and exc.args == ("x",)
    assert isinstance(exc.__cause__, RemoteTraceback)
    assert "lookup_missing" in exc.__cause__.tb
    assert "KeyError: 'x'" in exc.__cause__.tb


def test_custom_exception_keeps_attributes(m):
    class QuotaExceeded(RuntimeError):
        def __init__(self, msg, limit=0):
            super().__init__(msg)
            self.limit = limit

    @accelerate(m)
    def f():
        raise QuotaExceeded("too many", limit=3)

    with pytest.raises(QuotaExceeded) as ei:
        f()
    assert str(ei.value) == "too many" and ei.value.limit == 3


def test_exceptions_pickle_cannot_rebuild_arrive_as_themselves(m):
    """A class whose __init__ wants other arguments than its .args (pickle's rebuild
    fails), and an attribute that cannot be pickled (left behind, and named)."""
    import threading

    class FieldError(ValueError):
        def __init__(self, field, msg):
            super().__init__(msg)
            self.field = field
            if field == "lock":
                self.lock = threading.Lock()

    @accelerate(m)
    def check(field):
        raise FieldError(field, f"{field} is wrong")

    got = check.map(["age", "lock"], return_exceptions=True)
    assert [type(e) for e in got] == [FieldError, FieldError], got
    assert [e.args for e in got] == [("age is wrong",), ("lock is wrong",)]
    assert [e.field for e in got] == ["age", "lock"] and not hasattr(got[1], "lock")
    assert all(isinstance(e.__cause__, RemoteTraceback) for e in got)
    if sys.version_info >= (3, 11):
        assert "[gpumesh] not sent back, as it cannot be pickled: attribute 'lock'" in got[1].__notes__


def test_map_first_failure_raises(m):
    @accelerate(m)
    def f(x):
        if x == 3:
            raise ValueError(f"bad {x}")
        return x

    with pytest.raises(ValueError, match="bad 3"):
        f.map(range(6))
    assert f.map([0, 1]) == [0, 1]


def test_map_return_exceptions_keeps_every_result(m):
    @accelerate(m)
    def f(x):
        if x in (2, 5):
            raise ValueError(f"bad {x}")
        return x * 10

    got = f.map(range(8), return_exceptions=True)
    assert [v for i, v in enumerate(got) if i not in (2, 5)] == [0, 10, 30, 40, 60, 70]
    for i in (2, 5):
        assert type(got[i]) is ValueError and str(got[i]) == f"bad {i}"
        assert isinstance(got[i].__cause__, RemoteTraceback) and got[i].__cause__.index == i
    with pytest.raises(ValueError) as ei:  # the default: the first failure, saying how to keep going
        f.map(range(8))
    text = "\n".join(getattr(ei.value, "__notes__", [])) + str(ei.value.__cause__)
    if sys.version_info >= (3, 11):
        assert "return_exceptions=True" in text


def test_imap_yields_each_index_once(m):
    @accelerate(m)
    def f(x):
        if x == 4:
            raise KeyError(x)
        return x + 1

    got = list(f.imap(range(10), return_exceptions=True))
    assert sorted(i for i, _ in got) == list(range(10))
    values = dict(got)
    assert type(values.pop(4)) is KeyError
    assert values == {i: i + 1 for i in range(10) if i != 4}
    with f.imap(range(5, 10)) as it:  # closing early is fine (the rest is cancelled)
        i, v = next(it)
    assert 0 <= i < 5 and v == i + 6  # index i is item 5 + i


def test_timeout(m):
    @accelerate(m, timeout=0.5)
    def sleepy():
        import time as _t
        _t.sleep(5)
        return "late"

    t0 = time.monotonic()
    with pytest.raises(TaskTimeout) as ei:
        sleepy()
    assert time.monotonic() - t0 < 5
    assert isinstance(ei.value, TimeoutError) and "0.5" in str(ei.value)

    @accelerate(m)
    def quick():
        return "fine"

    assert quick() == "fine"


def test_nested_decorated_call_runs_inline(m):
    @accelerate(m)
    def inner(x):
        import os as _os
        return _os.getpid()

    @accelerate(m)
    def outer():
        import os as _os
        return _os.getpid(), inner(1)

    a, b = outer()
    assert a == b != os.getpid()


def test_pool_calls(m):
    workers = m.workers()
    assert workers and all({"id", "hostname", "alive", "slots"} <= set(w) for w in workers)
    devices = m.devices()
    assert devices
    assert all({"worker", "kind", "device", "name", "slots", "busy"} <= set(d) for d in devices)
    assert sum(d["slots"] for d in devices) >= 2
    assert m.gpu_count() == sum(1 for d in devices if d["kind"] != "cpu")
    assert isinstance(m.total_score(), float)
    assert m.device_count() == len({d["hostname"] or d["worker"] for d in devices})  # machines


def test_impossible_requirement_is_unsatisfiable(m):
    @accelerate(m, cores=100_000)
    def f():
        return 1

    with pytest.raises(Unsatisfiable):
        f()


def test_default_mesh_from_env(m, monkeypatch):
    monkeypatch.setenv("GPUMESH_URL", m.url)
    if m.token:
        monkeypatch.setenv("GPUMESH_TOKEN", m.token)
    monkeypatch.setattr(remote_mod.mesh, "_mesh", None)
    from gpumesh import mesh

    @mesh
    def double(x):
        return 2 * x

    assert double.map([1, 2, 3]) == [2, 4, 6]
    assert type(remote_mod.mesh.resolve()) is type(m)


def test_mesh_pickles_to_the_same_backend(m):
    back = pickle.loads(pickle.dumps(m))
    assert type(back) is type(m) and back.url == m.url
    if m.token:
        assert m.token.encode() not in pickle.dumps(m)
