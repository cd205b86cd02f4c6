"""The caller API against a real mesh (shared: a coordinator and two one-slot workers).

Every test here must run on the mesh: an autouse fixture makes the local fallback raise,
so a test that silently ran in this process fails instead of passing trivially.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass

import cloudpickle
import numpy as np
import pandas as pd
import pytest

from gpumesh import (GPUMesh, MeshError, RemoteError, RemoteTraceback, TaskCrashed, TaskFailed,
                     TaskTimeout, Unsatisfiable, accelerate)
from gpumesh.client import pipeline
from gpumesh.client import remote as remote_mod
from gpumesh.errors import RequestRejected
from gpumesh.limits import TASK_SLICE_ROWS

from ..conftest import alive, wait_for

# Module-level functions and classes of this file travel by value, as they would from a
# user's script (__main__): the workers need not import the test suite.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
_real_inline_run = pipeline.InlineBackend.run


@pytest.fixture(scope="module")
def client(shared_mesh):
    c = shared_mesh.client()
    yield c
    c.close()


@pytest.fixture(autouse=True)
def mesh_only(monkeypatch):
    """Fail loudly if a call falls back to running in this process."""
    def refuse(backend, job):
        raise AssertionError(f"{job.fn!r} ran locally although the mesh is up")
    monkeypatch.setattr(pipeline.InlineBackend, "run", refuse)
    monkeypatch.delenv("GPUMESH_LOCAL", raising=False)


def same_as_local(remote_fn, *args, **kwargs):
    """Call on the mesh and locally; assert equal values; return the mesh value."""
    got = remote_fn(*args, **kwargs)
    want = remote_fn.local(*args, **kwargs)
    assert got == want
    assert type(got) is type(want)
    return got


# ---------------------------------------------------------------- the spec's demo ----

def test_spec_demo_with_default_mesh(shared_mesh, monkeypatch):
    monkeypatch.setenv("GPUMESH_URL", shared_mesh.url)
    monkeypatch.setenv("GPUMESH_TOKEN", shared_mesh.token)
    monkeypatch.setattr(remote_mod.mesh, "_mesh", None)  # connect afresh from the env
    from gpumesh import mesh

    @mesh
    def train(lr, epochs):
        return {"lr": lr, "accuracy": round(0.90 + lr, 3)}

    assert train(lr=0.01, epochs=100) == {"lr": 0.01, "accuracy": 0.91}
    assert train.map([{"lr": 0.01, "epochs": 100}, {"lr": 0.05, "epochs": 200}]) == [
        {"lr": 0.01, "accuracy": 0.91}, {"lr": 0.05, "accuracy": 0.95}]
    assert mesh.url == shared_mesh.url
    mesh.close()


def test_workers_lists_both_workers(client):
    deadline = time.monotonic() + 30  # the benchmark runs after joining: scores come later
    while not all(w.get("scores") for w in client.workers()) and time.monotonic() < deadline:
        time.sleep(0.05)
    ws = client.workers()
    assert len(ws) == 2
    for w in ws:
        assert {"id", "device", "device_name", "hostname", "score", "alive"} <= set(w)
        assert w["alive"] is True
        assert w["device"] in ("CPU", "GPU")
        # 0 until the worker's background benchmark has finished
        assert isinstance(w["score"], (int, float)) and w["score"] >= 0
    assert len({w["id"] for w in ws}) == 2


def test_distribute(client):
    def power(x, p=2):
        return x ** p

    assert client.distribute(function=power, params=[{"x": 2}, {"x": 3, "p": 3}, 4], timeout=30) == [4, 27, 16]
    assert client.distribute(power, []) == []


# ---------------------------------------------------------------- arguments ----------

def test_positional_keyword_defaults(client):
    @accelerate(client)
    def f(a, b, c=10, d="x"):
        return (a, b, c, d)

    assert same_as_local(f, 1, 2) == (1, 2, 10, "x")
    assert same_as_local(f, 1, b=2, d="y") == (1, 2, 10, "y")
    assert same_as_local(f, a=[1], b={"k": None}, c=None) == ([1], {"k": None}, None, "x")


def test_keyword_only_and_positional_only(client):
    @accelerate(client)
    def f(a, /, b, *, c, d=4):
        return [a, b, c, d]

    assert same_as_local(f, 1, 2, c=3) == [1, 2, 3, 4]
    assert same_as_local(f, 1, b=2, c=3, d=5) == [1, 2, 3, 5]


def test_var_args_and_var_kwargs(client):
    @accelerate(client)
    def f(*args, **kwargs):
        return args, kwargs

    assert same_as_local(f) == ((), {})
    assert same_as_local(f, 1, "two", 3.0, x=1, y=[2]) == ((1, "two", 3.0), {"x": 1, "y": [2]})


def test_underscore_names(client):
    @accelerate(client)
    def f(*a, _k=1, **kw):
        return a, _k, kw

    assert same_as_local(f) == ((), 1, {})
    assert same_as_local(f, 1, 2, _k=5, _private=6, __dunder=7) == ((1, 2), 5, {"_private": 6, "__dunder": 7})

    @accelerate(client)
    def g(_x, __y=2):
        return _x - __y

    assert same_as_local(g, _x=10) == 8
    assert same_as_local(g, 10, __y=3) == 7


def test_closure(client):
    offset = 10
    table = {"a": 1, "b": 2}

    @accelerate(client)
    def f(key):
        return table[key] + offset

    assert same_as_local(f, "b") == 12


def test_lambda(client):
    f = accelerate(client)(lambda x, y=2: x ** y)
    assert same_as_local(f, 3) == 9
    assert f.map([1, 2, (3, 3)]) == [1, 4, 27]


def test_recursive_nested_functions(client):
    def fact(n):
        return 1 if n <= 1 else n * fact(n - 1)

    def is_even(n):
        return True if n == 0 else is_odd(n - 1)

    def is_odd(n):
        return False if n == 0 else is_even(n - 1)

    @accelerate(client)
    def both(n):
        return fact(n), is_even(n), is_odd(n)

    assert same_as_local(both, 10) == (3628800, True, False)
    rfact = accelerate(client)(fact)
    assert same_as_local(rfact, 20) == 2432902008176640000


def test_method_of_a_local_class(client):
    class Model:
        def __init__(self, k):
            self.k = k

        @accelerate(client)
        def predict(self, x, bias=0):
            return self.k * x + bias

        def plain(self, x):
            return self.k - x

    m = Model(3)
    assert m.predict(4) == 12
    assert m.predict(4, bias=1) == 13
    assert Model.predict(m, 2) == 6
    bound = accelerate(client)(m.plain)
    assert bound(1) == 2
    assert m.predict(4) == Model.predict.local(m, 4)


@dataclass
class Point:
    x: int
    y: float
    tag: str = "p"


def test_callers_dataclass_as_argument_and_result(client):
    @dataclass(frozen=True)
    class Local:
        name: str
        values: tuple

    @accelerate(client)
    def shift(p, d, meta):
        return Point(p.x + d, p.y * 2, p.tag + "!"), Local(meta.name.upper(), meta.values[::-1])

    p, loc = same_as_local(shift, Point(1, 1.5), 2, Local("ab", (1, 2, 3)))
    assert p == Point(3, 3.0, "p!")
    assert type(p) is Point
    assert type(loc) is Local
    assert loc == Local("AB", (3, 2, 1))


def test_argument_of_a_module_registered_by_value(client, tmp_path, monkeypatch):
    import importlib
    import uuid
    name = f"gm_byval_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(
        "class Config:\n    def __init__(self, v):\n        self.v = v\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # only the caller has this module
    mod = importlib.import_module(name)
    cloudpickle.register_pickle_by_value(mod)
    try:
        @accelerate(client)
        def use(cfg):
            return cfg.v * 2

        assert use(mod.Config(21)) == 42
    finally:
        cloudpickle.unregister_pickle_by_value(mod)
        sys.modules.pop(name, None)


# ---------------------------------------------------------------- values -------------

def test_numpy_arrays_keep_dtype_order_and_are_writable(client):
    @accelerate(client)
    def inspect_arrays(c, f, small, scalar):
        return (c.dtype.str, c.flags.c_contiguous, f.dtype.str, f.flags.f_contiguous,
                f.flags.c_contiguous, c.flags.writeable, f.flags.writeable,
                c * 2, f.copy(order="F"), small[::2], scalar * 2)

    c = np.arange(300_000, dtype=np.float32).reshape(600, 500)
    f = np.asfortranarray(np.arange(60_000, dtype=np.int16).reshape(200, 300))
    out = inspect_arrays(c, f, np.arange(10, dtype=np.uint8), np.float32(1.5))
    assert out[:7] == ("<f4", True, "<i2", True, False, True, True)
    c2, f2, small, scalar = out[7:]
    assert c2.dtype == np.float32 and c2.flags.c_contiguous and np.array_equal(c2, c * 2)
    assert f2.dtype == np.int16 and f2.flags.f_contiguous and not f2.flags.c_contiguous
    assert np.array_equal(f2, f)
    assert small.dtype == np.uint8 and small.tolist() == [0, 2, 4, 6, 8]
    assert type(scalar) is np.float32 and scalar == np.float32(3.0)
    for arr in (c2, f2, small):
        assert arr.flags.writeable
        arr.flat[0] = 1
        assert arr.flat[0] == 1


def test_numpy_zero_dim_and_structured(client):
    @accelerate(client)
    def echo(x):
        return x

    dt = np.dtype([("a", "<i4"), ("b", "<f8")])
    s = np.array([(1, 2.0), (3, 4.0)], dtype=dt)
    got = echo(s)
    assert got.dtype == dt and got.tolist() == [(1, 2.0), (3, 4.0)]
    z = echo(np.array(7, dtype=np.int64))
    assert z.ndim == 0 and z.dtype == np.int64 and int(z) == 7


def test_pandas_dataframe_round_trip(client):
    @accelerate(client)
    def enrich(df, series):
        out = df.copy()
        out["z"] = out["x"] * 2
        out["s"] = series.values
        return out, out.dtypes.astype(str).to_dict()

    df = pd.DataFrame({"x": np.arange(5, dtype=np.int32), "name": list("abcde"),
                       "t": pd.date_range("2024-01-01", periods=5),
                       "cat": pd.Categorical(list("xyxyx"))},
                      index=pd.Index([10, 20, 30, 40, 50], name="id"))
    series = pd.Series([0.5, 1.5, 2.5, 3.5, 4.5], name="s")
    got, dtypes = enrich(df, series)
    want, want_dtypes = enrich.local(df, series)
    pd.testing.assert_frame_equal(got, want)
    assert dtypes == want_dtypes
    assert got.index.name == "id"
    got.loc[10, "z"] = -1  # the result is a normal, writable frame
    assert got.loc[10, "z"] == -1


def test_unicode_and_big_values(client):
    @accelerate(client)
    def echo(**kw):
        return kw

    kw = {"cyr": "Привет", "cjk": "漢字", "emoji": "😀", "nul": "a\x00b", "sur": "\ud800",
          "bytes": bytes(range(256)) * 4000, "neg0": -0.0, "big": 2 ** 200, "set": {1, 2},
          "keys": {1: "int", (1, 2): "tuple"}}
    assert echo(**kw) == kw


# ---------------------------------------------------------------- errors -------------

def test_remote_key_error_is_a_key_error_with_remote_traceback(client):
    @accelerate(client)
    def lookup_missing(d):
        return d["x"]

    with pytest.raises(KeyError) as ei:
        lookup_missing({})
    try:
        lookup_missing({"y": 1})
    except KeyError as e:  # the spec's promise: plain `except KeyError` catches it
        caught = e
    assert caught.args == ("x",)
    exc = ei.value
    assert type(exc) is KeyError and exc.args == ("x",)
    cause = exc.__cause__
    assert isinstance(cause, RemoteTraceback)
    assert "Traceback (most recent call last)" in cause.tb
    assert "lookup_missing" in cause.tb
    assert "KeyError: 'x'" in cause.tb
    # the worker has no source file, but the frame names the caller's line
    code = lookup_missing.__gpumesh_wrapped__.__code__
    line = max(ln for _, _, ln in code.co_lines() if ln)  # the `return d["x"]` line
    assert f"line {line}, in lookup_missing" in cause.tb


def test_custom_exception_keeps_type_message_and_attributes(client):
    class QuotaExceeded(RuntimeError):
        def __init__(self, msg, limit=0):
            super().__init__(msg)
            self.limit = limit

    @accelerate(client)
    def f():
        raise QuotaExceeded("too many", limit=3)

    with pytest.raises(QuotaExceeded) as ei:
        f()
    assert str(ei.value) == "too many"
    assert isinstance(ei.value.__cause__, RemoteTraceback)


def test_exception_with_an_unpicklable_attribute_arrives_as_itself_without_it(client):
    class LockedError(Exception):
        def __init__(self, msg):
            super().__init__(msg)
            self.lock = threading.Lock()
            self.retry_after = 30

    @accelerate(client)
    def f():
        raise LockedError("cannot travel whole")

    with pytest.raises(LockedError) as ei:
        f()
    e = ei.value
    assert e.args == ("cannot travel whole",) and e.retry_after == 30
    assert not hasattr(e, "lock")
    assert isinstance(e.__cause__, RemoteTraceback) and "Traceback" in e.__cause__.tb
    if sys.version_info >= (3, 11):
        assert "[gpumesh] not sent back, as it cannot be pickled: attribute 'lock'" in e.__notes__


def test_exception_that_pickle_cannot_rebuild_arrives_as_itself(client):
    """pickle rebuilds an exception by calling its class with .args: TwoArgs("left/right")
    fails (a missing argument), at a multiprocessing pool's caller too. gpumesh rebuilds it
    without calling __init__."""
    class TwoArgs(Exception):
        def __init__(self, a, b):
            super().__init__(f"{a}/{b}")
            self.b = b

    @accelerate(client)
    def f():
        raise TwoArgs("left", "right")

    with pytest.raises(TwoArgs) as ei:
        f()
    assert ei.value.args == ("left/right",) and ei.value.b == "right"
    assert str(ei.value) == "left/right"


def test_exception_whose_class_cannot_travel_arrives_as_remote_error(client):
    @accelerate(client)
    def f():
        import threading

        class GuardedError(Exception):
            guard = threading.Lock()  # the class, shipped by value, cannot be pickled
        raise GuardedError("cannot travel")

    with pytest.raises(RemoteError) as ei:
        f()
    e = ei.value
    assert isinstance(e, TaskFailed) and isinstance(e, MeshError)
    assert "GuardedError" in e.remote_type
    assert e.remote_message == "cannot travel"
    assert "GuardedError" in str(e) and "cannot travel" in str(e)
    assert "Traceback" in e.remote_traceback


def test_os_exit_is_task_crashed_and_worker_survives(client, shared_mesh):
    before = shared_mesh.alive()

    @accelerate(client)
    def die():
        os._exit(7)

    with pytest.raises(TaskCrashed) as ei:
        die()
    assert "code 7" in str(ei.value)

    @accelerate(client)
    def ok(x):
        return x + 1

    assert ok.map(list(range(4))) == [1, 2, 3, 4]
    assert shared_mesh.alive() == before == 2


@pytest.mark.parametrize("isolation", ["task", "job"])
def test_os_exit_0_is_task_crashed_at_once_not_a_lost_worker(client, shared_mesh, isolation):
    # A host reports a clean exit only when asked (every task process exits 0 after its
    # reply): one without a reply was taken for its host's death, re-run up to WorkerLost.
    @accelerate(client, isolation=isolation)
    def leave_quietly(x):
        os._exit(0)

    got = leave_quietly.map([1, 2], return_exceptions=True)
    assert [type(e) for e in got] == [TaskCrashed, TaskCrashed], got
    assert all("exited with code 0 before returning a result" in str(e) for e in got), got
    assert shared_mesh.alive() == 2


def test_sys_exit_is_task_failed_not_system_exit(client):
    @accelerate(client)
    def leave():
        sys.exit(3)

    with pytest.raises(TaskFailed) as ei:
        leave()
    assert not isinstance(ei.value, SystemExit)
    assert "sys.exit(3)" in str(ei.value)
    # its remote traceback starts in the function, as a raised exception's does
    tb = ei.value.remote_traceback
    assert "in leave" in tb and "sys.exit(3)" in tb and "runner.py" not in tb, tb


def test_unpicklable_result_is_remote_error(client):
    @accelerate(client)
    def make_lock():
        return threading.Lock()

    with pytest.raises(RemoteError) as ei:
        make_lock()
    assert "lock" in str(ei.value).lower()
    assert "cannot be pickled" in str(ei.value)


def test_an_unpicklable_argument_is_named_before_anything_is_sent(client):
    @accelerate(client)
    def use(a, b=None):
        return a

    with pytest.raises(TypeError, match=r"argument 1 of .*use cannot be sent to a worker: "
                                        r"cannot pickle '_thread.lock'"):
        use(1, threading.Lock())
    with pytest.raises(TypeError, match=r"keyword argument 'b' of .*use \(item 2 of the map\)"):
        use.map([{"a": 1}, {"a": 2}, {"a": 3, "b": threading.Lock()}])
    assert use(5) == 5  # nothing was left half-sent


def _wait_released(client, job_id: str, within: float) -> None:
    """Until asking for ``job_id``'s results is a 410 (released); fails after ``within`` s."""
    deadline = time.monotonic() + within
    while True:
        try:
            client.http.request("GET", f"/v1/jobs/{job_id}/results", params={"after": -1, "wait": 0})
        except RequestRejected as e:
            assert e.status == 410
            return
        assert time.monotonic() < deadline, f"job {job_id} was never released"
        time.sleep(0.05)


def test_jobs_are_released_in_batches_and_bad_batches_are_refused(client):
    def one(x):
        return x
    ids = []
    for x in range(3):
        assert client.run_calls(one, [((x,), {})]) == [x]
        ids.append(client.jobs(limit=1)[0]["id"])
    # The caller's janitor batches its releases; wait for them, then ask again by hand:
    # every job is known, so each counts once, duplicates and unknown ids do not.
    _wait_released(client, ids[-1], 10)
    r = client.http.request("POST", "/v1/jobs/release", json={"jobs": ids + ids[:1] + ["00ff00ff00ff"]})
    assert r.json() == {"released": 3}
    for jid in ids:
        with pytest.raises(RequestRejected) as ei:
            client.http.request("GET", f"/v1/jobs/{jid}/results", params={"after": -1, "wait": 0})
        assert ei.value.status == 410
    for body in ({}, {"jobs": []}, {"jobs": "abcd"}, {"jobs": ["not hex!"]}, {"jobs": [1]},
                 {"jobs": ["abcd1234"] * 1001}):
        with pytest.raises(RequestRejected) as ei:
            client.http.request("POST", "/v1/jobs/release", json=body)
        assert ei.value.status == 400, body


def test_a_map_of_more_tasks_than_a_release_slice_is_released(client):
    """A job of more than TASK_SLICE_ROWS tasks is released a slice per transaction, in
    the background of the release request (Coordinator.release): it still ends released."""
    n = TASK_SLICE_ROWS + 50

    @accelerate(client, isolation="job")
    def double(x):
        return 2 * x

    assert double.map(range(n)) == [2 * x for x in range(n)]
    _wait_released(client, client.jobs(limit=1)[0]["id"], 30)
    assert client.run_calls(double, [((4,), {})]) == [8]  # and the coordinator goes on


def test_timeout(client):
    @accelerate(client, timeout=0.5)
    def sleepy():
        import time as _t
        _t.sleep(10)
        return "late"

    t0 = time.monotonic()
    with pytest.raises(TaskTimeout) as ei:
        sleepy()
    elapsed = time.monotonic() - t0
    assert elapsed < 5, elapsed
    assert isinstance(ei.value, TimeoutError)
    assert "0.5" in str(ei.value)

    @accelerate(client)
    def quick():
        return "fine"

    assert quick() == "fine"  # the slot was freed


def test_timeout_kills_the_tasks_whole_process_tree(client, tmp_path):
    pid_file = tmp_path / "child.pid"

    @accelerate(client, timeout=1)
    def spawn_and_hang(path):
        import subprocess as _sp
        import time as _t
        child = _sp.Popen(["sleep", "60"])
        with open(path, "w") as fh:
            fh.write(str(child.pid))
        _t.sleep(30)

    with pytest.raises(TaskTimeout):
        spawn_and_hang(str(pid_file))
    child = int(pid_file.read_text())

    wait_for(lambda: not alive(child), 5, "the task's own child process to end with its timeout")


def test_concurrent_calls_from_threads_share_one_client(client):
    @accelerate(client)
    def tag(t, i):
        return t * 100 + i

    results: dict = {}
    errors: list = []

    def caller(t):
        try:
            results[t] = [tag(t, i) for i in range(5)] + tag.map([(t, i) for i in range(5, 10)])
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=caller, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors, errors
    assert results == {t: [t * 100 + i for i in range(10)] for t in range(4)}


def test_imap_timeout_overrides_the_decorators_for_that_batch(client):
    # (.map's, on the mesh and locally: tests/integration/test_inline_vs_mesh.py)
    @accelerate(client, timeout=60)
    def nap(s):
        import time as _t
        _t.sleep(s)
        return s

    # the decorator's own timeout is untouched afterwards
    streamed = dict(nap.imap([0, 10], timeout=0.5, return_exceptions=True))
    assert streamed[0] == 0 and type(streamed[1]) is TaskTimeout, streamed
    assert nap.map([0.2]) == [0.2]


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), "5", True])
def test_bad_map_timeout_is_refused_before_anything_is_submitted(client, bad):
    @accelerate(client)
    def one(x):
        return x

    before = [j["id"] for j in client.jobs(limit=5)]
    for call in (lambda: one.map([1, 2], timeout=bad), lambda: one.imap([1], timeout=bad),
                 lambda: one.map([1], timeout=bad, ordered=False)):
        with pytest.raises(ValueError, match="timeout must be a number of seconds > 0"):
            call()
    assert [j["id"] for j in client.jobs(limit=5)] == before


def test_bad_timeout_is_value_error(client):
    with pytest.raises(ValueError, match="timeout"):
        accelerate(client, timeout=0)(lambda: 1)
    with pytest.raises(ValueError, match="timeout"):
        accelerate(client, timeout="5")(lambda: 1)


def test_unknown_option_is_type_error(client):
    with pytest.raises(TypeError, match="retrys"):
        accelerate(client, retrys=3)(lambda: 1)
    with pytest.raises(ValueError, match="retry_on"):  # retries= alone: which exceptions?
        accelerate(client, retries=3)(lambda: 1)


# ---------------------------------------------------------------- map ----------------

def test_map_empty_returns_fast(client):
    @accelerate(client)
    def f(x):
        return x

    t0 = time.monotonic()
    assert f.map([]) == []
    assert f.map(iter(())) == []
    assert time.monotonic() - t0 < 0.5


def test_map_preserves_order_with_duplicates(client):
    @accelerate(client)
    def sq(x):
        import time as _t
        _t.sleep(0.02 * (x % 3))  # finish out of order
        return x * x

    items = [3, 1, 3, 2, 1, 0, 3, 5, 2, 2]
    assert sq.map(items) == [x * x for x in items]
    assert sq.map([{"x": 4}, (2,), 7]) == [16, 4, 49]


def test_map_many_items(client):
    @accelerate(client)
    def inc(i):
        return i + 1

    assert inc.map(range(300)) == list(range(1, 301))


def test_map_hint_keys_stripped_unless_named(client):
    @accelerate(client)
    def f(x):
        return x * 10

    assert f.map([{"x": 1, "cost": 5}, {"x": 2, "gpu_memory_mb": 0},
                  {"x": 3, "cost": 1, "gpu_memory_mb": 0}]) == [10, 20, 30]
    # a GPU memory hint asks for a GPU, and this pool has none
    with pytest.raises(Unsatisfiable, match="gpu_memory_mb=256"):
        f.map([{"x": 2, "gpu_memory_mb": 256}])

    @accelerate(client)
    def g(x, cost):
        return x * cost

    assert g.map([{"x": 2, "cost": 5}, {"x": 3, "cost": 0.5}]) == [10, 1.5]

    @accelerate(client)
    def h(**kw):
        return sorted(kw)

    assert h.map([{"a": 1, "cost": 2}]) == [["a"]]
    with pytest.raises(TypeError, match="cost"):
        f.map([{"x": 1, "cost": "lots"}])


def test_map_first_failure_raises(client):
    @accelerate(client)
    def f(x):
        if x == 3:
            raise ValueError(f"bad {x}")
        return x

    with pytest.raises(ValueError, match="bad 3"):
        f.map(range(6))
    assert f.map([0, 1]) == [0, 1]


# ---------------------------------------------------------------- routing & API ------

def test_install_then_bare_accelerate(client, monkeypatch):
    monkeypatch.setattr(accelerate, "_installed", None)
    accelerate.install(client)

    @accelerate
    def where(x):
        import os as _os
        return x * 2, _os.getpid()

    value, pid = where(21)
    assert value == 42
    assert pid != os.getpid()

    @accelerate(timeout=30)
    def where2(x):
        return x - 1

    assert where2.map([1, 2]) == [0, 1]
    assert where.mesh is client

    from gpumesh import mesh  # bare @mesh too: the installed mesh, not the saved config

    @mesh
    def where3(x):
        import os as _os
        return x + 1, _os.getpid()

    value, pid = where3(41)
    assert value == 42 and pid != os.getpid()
    assert where3.mesh is client
    with pytest.raises(TypeError):
        accelerate.install("http://127.0.0.1:1")


def test_gpumesh_local_forces_local(client, monkeypatch, capsys):
    monkeypatch.setattr(pipeline.InlineBackend, "run", _real_inline_run)
    monkeypatch.setattr(pipeline, "_notices", set())
    monkeypatch.setenv("GPUMESH_LOCAL", "1")

    @accelerate(client)
    def pid():
        import os as _os
        return _os.getpid()

    assert pid() == os.getpid()
    assert pid.map([(), ()]) == [os.getpid(), os.getpid()]
    err = capsys.readouterr().err
    assert err.count("[gpumesh] GPUMESH_LOCAL=1: running locally") == 1



def test_tasks_run_in_fresh_processes(client):
    @accelerate(client)
    def bump(_):
        import os as _os
        import sys as _sys
        _sys._gpumesh_test_counter = getattr(_sys, "_gpumesh_test_counter", 0) + 1
        return _sys._gpumesh_test_counter, _os.getpid()

    out = [bump(i) for i in range(4)] + bump.map(range(4))
    counters = [c for c, _ in out]
    pids = [p for _, p in out]
    assert counters == [1] * 8          # no task sees another task's global
    assert os.getpid() not in pids
    assert len(set(pids[:4])) == 4      # sequential calls: a new process each


def test_closure_state_is_not_shared_between_tasks(client):
    box = {"n": 0}

    @accelerate(client)
    def bump(_):
        box["n"] += 1
        return box["n"]

    assert bump.map(range(5)) == [1] * 5
    assert box["n"] == 0  # the caller's copy is untouched


def test_task_environment_has_no_credentials(client, shared_mesh):
    @accelerate(client)
    def env():
        import os as _os
        return dict(_os.environ)

    e = env()
    assert "GPUMESH_TOKEN" not in e
    assert "GPUMESH_CONFIG" not in e
    assert "GPUMESH_URL" not in e
    assert e.get("GPUMESH_IN_TASK") == "1"
    assert not any(shared_mesh.token in v for v in e.values())


def test_nested_decorated_call_runs_inline_in_the_task(client):
    @accelerate(client)
    def inner(x):
        import os as _os
        return x + 1, _os.getpid()

    @accelerate(client)
    def outer(x):
        import os as _os
        v, pid = inner(x)
        return v, pid == _os.getpid(), inner.map([1, 2])

    v, same, mapped = outer(1)
    assert v == 2 and same is True
    assert [m[0] for m in mapped] == [2, 3]


# The public API (gpumesh.__all__, exactly) is pinned in tests/unit/test_conventions.py.


def test_gpumesh_constructor_validates_url():
    with pytest.raises(ValueError, match="http://"):
        GPUMesh("127.0.0.1:8000", token="t")
    with pytest.raises(ValueError):
        GPUMesh("ftp://x", token="t")


def test_mesh_and_decorated_function_pickle_without_token(client):
    import pickle

    @accelerate(client)
    def f(x):
        return x

    assert client.token.encode() not in pickle.dumps(client)
    assert client.token.encode() not in cloudpickle.dumps(f)
    assert pickle.loads(pickle.dumps(client)).url == client.url


def test_a_task_runs_in_the_workers_directory_with_the_workers_environment(make_mesh, tmp_path,
                                                                           monkeypatch):
    # README: "A task runs in the worker's working directory with the worker's environment
    # variables (those `gpumesh join` started with), not the caller's".
    from ..conftest import Proc
    lender = tmp_path / "lender-dir"
    lender.mkdir()
    mesh = make_mesh(workers=0)
    proc = Proc(["join", mesh.url], dict(mesh.env, GM_WHOSE="the worker's"),
                mesh.root / "worker-elsewhere.log", cwd=lender)
    mesh.procs.append(proc)
    mesh.wait_alive(1, proc)
    monkeypatch.setenv("GM_WHOSE", "the caller's")

    def where_and_whose():
        return os.getcwd(), os.environ.get("GM_WHOSE")

    assert accelerate(mesh.client())(where_and_whose)() == (str(lender), "the worker's")


def test_a_tasks_exception_carries_one_frame_of_gpumesh(client):
    # The worker's traceback is the cause; below the call, gpumesh's frames (mesh,
    # pipeline, decoding) say nothing more and are taken off (client/remote.py).
    import traceback

    @accelerate(client)
    def fails(x):
        raise KeyError(x)

    for call in (lambda: fails(1), lambda: fails.map([1, 2])):
        with pytest.raises(KeyError) as e:
            call()
        files = [f.filename for f in traceback.extract_tb(e.value.__traceback__)]
        ours = [f for f in files if "/gpumesh/" in f]
        assert len(ours) == 1 and ours[0].endswith("gpumesh/client/remote.py"), files
        assert isinstance(e.value.__cause__, RemoteTraceback)  # kept
