"""The same calls on a real mesh and on the inline backend (GPUMESH_LOCAL=1, what local
fallback runs) give the same values, the same exceptions and the same timeouts."""

from __future__ import annotations

import functools
import os
import sys
import time

import cloudpickle
import pytest

from gpumesh import RemoteTraceback, TaskTimeout, accelerate

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # as a user's script ships


class Point:
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __eq__(self, other):
        return type(other) is Point and (self.x, self.y) == (other.x, other.y)


class Refused(Exception):
    def __init__(self, code, why):
        super().__init__(code, why)
        self.code = code


def values(n):
    return {"n": n, "squares": [i * i for i in range(n)], "t": (n, "a"), "p": Point(n, -n),
            "b": bytes(range(n))}


def mutate(box):
    box.append("task")
    return box


def refuse(code):
    if code:
        raise Refused(code, f"refused {code}")
    return "ok"


def sleepy(s):
    time.sleep(s)
    return s


@pytest.fixture(scope="module")
def client(shared_mesh):
    c = shared_mesh.client()
    c.output = False
    yield c
    c.close()


def both(monkeypatch, fn, *args, **kwargs):
    """``fn(*args)`` on the mesh, then with GPUMESH_LOCAL=1: ``(mesh outcome, inline
    outcome)``, each a value or the exception raised."""
    out = []
    for local in (False, True):
        if local:
            monkeypatch.setenv("GPUMESH_LOCAL", "1")
        else:
            monkeypatch.delenv("GPUMESH_LOCAL", raising=False)
        try:
            out.append(fn(*args, **kwargs))
        except Exception as e:  # noqa: BLE001 - compared below
            out.append(e)
    monkeypatch.delenv("GPUMESH_LOCAL", raising=False)
    return out


def test_values_are_equal_and_of_the_same_types(client, monkeypatch):
    f = accelerate(client)(values)
    remote, local = both(monkeypatch, f.map, [0, 3, 7])
    assert remote == local == [values(n) for n in (0, 3, 7)]
    assert [type(v["p"]) for v in remote] == [type(v["p"]) for v in local] == [Point] * 3
    box = ["mine"]
    remote, local = both(monkeypatch, accelerate(client)(mutate), box)
    assert remote == local == ["mine", "task"]
    assert box == ["mine"]  # neither changed the caller's list


def scale_in_place(a):
    import numpy as np
    a *= 2  # the argument is the task's own copy, writable
    return a, np.arange(3.0)


def test_arrays_are_writable_copies_on_both(client, monkeypatch):
    np = pytest.importorskip("numpy")
    a = np.ones(4)
    remote, local = both(monkeypatch, accelerate(client)(scale_in_place), a)
    for doubled, fresh in (remote, local):
        assert doubled.tolist() == [2.0] * 4 and fresh.tolist() == [0.0, 1.0, 2.0]
        doubled[0] = -1.0  # the caller may write into what it got back
        fresh[0] = -1.0
        assert doubled.flags.writeable and fresh.flags.writeable
    assert a.tolist() == [1.0] * 4  # neither changed the caller's array


def test_exceptions_are_the_same_objects(client, monkeypatch):
    f = accelerate(client)(refuse)
    remote, local = both(monkeypatch, f, 7)
    for e in (remote, local):
        assert type(e) is Refused and e.args == (7, "refused 7") and e.code == 7
        assert isinstance(e.__cause__, RemoteTraceback)
        assert 'raise Refused(code, f"refused {code}")' in e.__cause__.tb
    remote, local = both(monkeypatch, f.map, [0, 5, 0], return_exceptions=True)
    for got in (remote, local):
        assert got[0] == got[2] == "ok"
        assert type(got[1]) is Refused and got[1].args == (5, "refused 5")
        assert isinstance(got[1].__cause__, RemoteTraceback) and got[1].__cause__.index == 1


def test_timeouts_are_the_same(client, monkeypatch):
    f = accelerate(client, timeout=1)(sleepy)
    remote, local = both(monkeypatch, f.map, [0, 30], return_exceptions=True)
    for got in (remote, local):
        assert got[0] == 0 and isinstance(got[1], TaskTimeout)


def test_a_maps_timeout_replaces_the_decorators_on_both(client, monkeypatch):
    f = accelerate(client, timeout=60)(sleepy)
    t0 = time.monotonic()
    remote, local = both(monkeypatch, f.map, [0, 30], timeout=0.5, return_exceptions=True)
    assert time.monotonic() - t0 < 12  # neither waited for the decorator's 60 s (nor 30 s)
    for got in (remote, local):
        assert got[0] == 0 and isinstance(got[1], TaskTimeout) and "0.5" in str(got[1]), got


def give_lock():
    import threading
    return threading.Lock()


def give_generator(n):
    return (i for i in range(n))


class LockedError(Exception):
    def __init__(self, msg):
        super().__init__(msg)
        import threading
        self.code = 7
        self.lock = threading.Lock()


class TwoArgs(Exception):
    def __init__(self, a, b):
        super().__init__(f"{a}/{b}")
        self.a = a


def raise_untravelled(which):
    if which == "lock":
        raise LockedError("half travels")
    if which == "two-args":
        raise TwoArgs("left", "right")
    import threading

    class GuardedError(Exception):  # its class cannot be pickled: it cannot travel at all
        guard = threading.Lock()
    raise GuardedError("cannot travel")


def first(a, b=None):
    return a


def _same_remote_error(remote, local):
    """Both a RemoteError of one remote type and message, and the same text up to where
    each names the place it ran (a worker; this machine)."""
    from gpumesh import RemoteError
    assert type(remote) is type(local) is RemoteError, (remote, local)
    assert remote.remote_type == local.remote_type
    assert remote.remote_message == local.remote_message
    assert str(remote).split(" (")[0] == str(local).split(" (")[0]


@pytest.mark.parametrize("fn, args, words", [
    (give_lock, (), "the return value (lock) cannot be pickled: cannot pickle '_thread.lock' object"),
    (give_generator, (3,), "the return value (generator) cannot be pickled: cannot pickle "
                           "'generator' object"),
])
def test_an_unpicklable_value_fails_the_same_on_both(client, monkeypatch, fn, args, words):
    remote, local = both(monkeypatch, accelerate(client)(fn), *args)
    _same_remote_error(remote, local)
    assert local.remote_message == words and local.remote_type == "TypeError"
    # in a batch, each in its own place, the others' values intact
    remote, local = both(monkeypatch, accelerate(client)(first).map, [1, 2])
    assert remote == local == [1, 2]


def test_an_exception_pickle_cannot_rebuild_arrives_as_itself_on_both(client, monkeypatch):
    """A class whose __init__ takes other arguments than it gives super().__init__ (pickle
    calls it again with .args, and fails) comes back as itself with its attributes."""
    remote, local = both(monkeypatch, accelerate(client)(raise_untravelled), "two-args")
    for e in (remote, local):
        assert type(e) is TwoArgs and e.args == ("left/right",) and e.a == "left", e
        assert str(e) == "left/right" and isinstance(e.__cause__, RemoteTraceback)


def test_an_exception_with_an_unpicklable_attribute_arrives_without_it_on_both(client,
                                                                              monkeypatch):
    remote, local = both(monkeypatch, accelerate(client)(raise_untravelled), "lock")
    for e in (remote, local):
        assert type(e) is LockedError and e.args == ("half travels",) and e.code == 7, e
        assert not hasattr(e, "lock")
        if sys.version_info >= (3, 11):
            assert ("[gpumesh] not sent back, as it cannot be pickled: attribute 'lock'"
                    in e.__notes__)


def test_an_exception_that_cannot_travel_fails_the_same_on_both(client, monkeypatch):
    remote, local = both(monkeypatch, accelerate(client)(raise_untravelled), "guarded")
    _same_remote_error(remote, local)
    assert local.remote_message == "cannot travel"
    assert local.remote_type.endswith("GuardedError")


def test_an_unpicklable_argument_fails_the_same_on_both(client, monkeypatch):
    import threading
    f = accelerate(client)(first)
    remote, local = both(monkeypatch, f.map, [{"a": 1}, {"a": 2, "b": threading.Lock()}])
    assert type(remote) is type(local) is TypeError
    assert str(remote) == str(local)
    assert "keyword argument 'b' of first (item 1 of the map) cannot be sent to a worker" in str(local)


def stop_at(x):
    if x == "empty":
        return next(iter([]))
    if x:
        raise StopIteration(x)
    return "ran"


def test_a_stop_iteration_arrives_as_itself_on_both(client, monkeypatch):
    """Not PEP 479's bare ``RuntimeError: generator raised StopIteration``."""
    f = accelerate(client)(stop_at)
    for got in both(monkeypatch, f, 5):
        assert type(got) is StopIteration and got.args == (5,) and got.value == 5, repr(got)
        assert isinstance(got.__cause__, RemoteTraceback)
        assert "raise StopIteration(x)" in got.__cause__.tb
    for got in both(monkeypatch, f, "empty"):
        assert type(got) is StopIteration and got.args == (), repr(got)
    for got in both(monkeypatch, f.map, [0, 7, 0]):
        assert type(got) is StopIteration and got.args == (7,) and got.__cause__.index == 1
    for got in both(monkeypatch, f.map, [0, 7], return_exceptions=True):
        assert got[0] == "ran" and type(got[1]) is StopIteration and got[1].args == (7,)
    for pairs in both(monkeypatch, lambda: dict(f.imap([0, 7], return_exceptions=True))):
        assert pairs[0] == "ran" and type(pairs[1]) is StopIteration and pairs[1].args == (7,)
    # .imap's next() cannot raise it (a for loop would end silently): its cause
    for got in both(monkeypatch, lambda: list(f.imap([7]))):
        assert type(got) is not StopIteration and isinstance(got, RuntimeError), repr(got)
        assert type(got.__cause__) is StopIteration and got.__cause__.args == (7,)


class Held:
    def __init__(self):
        import threading
        self.lock = threading.Lock()

    def work(self, x):
        return x


def test_an_unpicklable_function_fails_the_same_on_both(client, monkeypatch):
    f = accelerate(client)(Held().work)
    remote, local = both(monkeypatch, f.map, [1, 2])
    assert type(remote) is type(local) is TypeError
    assert str(remote) == str(local) == (
        "the Held object that the method Held.work is bound to cannot be sent to a worker: "
        "cannot pickle '_thread.lock' object")
    assert type(remote.__cause__) is TypeError


@functools.cache
def drawn(x):
    import random
    return x, os.getpid(), random.random()


def test_a_cache_function_runs_with_a_cache_per_process_on_both(make_mesh, monkeypatch):
    """``@mesh`` over ``@functools.cache`` failed to pickle ("it's not the same object as
    ...drawn"). It runs with an empty cache of the process's that runs the tasks: a job's
    process keeps it for the job's tasks (isolation="job"), a fresh process starts empty."""
    mesh = make_mesh(workers=1)
    client = mesh.client(output=False)
    try:
        per_job = accelerate(client, isolation="job")(drawn)
        for one, again, other in both(monkeypatch, per_job.map, [1, 1, 2]):
            assert one == again and one[0] == 1 and other[0] == 2 and other[1] == one[1]
        remote, local = both(monkeypatch, accelerate(client)(drawn).map, [1, 1])
        assert remote[0][0] == remote[1][0] == 1
        assert remote[0][1] != remote[1][1] and remote[0] != remote[1]  # a process per task
        assert local[0][0] == 1 and local[1][0] == 1
        assert drawn.cache_info().currsize == 0  # the caller's cache is its own
    finally:
        client.close()
