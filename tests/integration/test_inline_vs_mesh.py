"""The same calls on a real mesh and on the inline backend (GPUMESH_LOCAL=1, what local
fallback runs) give the same values, the same exceptions and the same timeouts."""

from __future__ import annotations

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
