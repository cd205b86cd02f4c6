"""Scheduling hints (``cost``, ``gpu_memory_mb``) of a single call and of script payloads,
read the way ``.map`` items are read."""

from __future__ import annotations

import pytest

from gpumesh.client import calls, scripts
from gpumesh.client.remote import RemoteFunction


class Recorder:
    """Stands in for a GPUMesh: records what run_calls was given."""

    def __init__(self):
        self.seen = []

    def run_calls(self, fn, call_list, *, hints=None, **kw):
        self.seen.append((call_list, hints))
        return [fn(*a, **k) for a, k in call_list]


def test_a_single_call_takes_hints_as_keywords(monkeypatch):
    monkeypatch.delenv("GPUMESH_IN_TASK", raising=False)
    rec = Recorder()

    def f(x):
        return x + 1

    remote = RemoteFunction(f, rec, {})
    assert remote(1, gpu_memory_mb=6000, cost=2) == 2           # the hints never reach f
    assert rec.seen[-1] == ([((1,), {})], [{"gpu_memory_mb": 6000.0, "cost": 2.0}])
    assert remote(x=5) == 6
    assert rec.seen[-1] == ([((), {"x": 5})], None)              # no hint: nothing changes

    def g(x, gpu_memory_mb=0):
        return gpu_memory_mb

    assert RemoteFunction(g, rec, {})(1, gpu_memory_mb=512) == 512   # named: an argument too
    assert rec.seen[-1][1] == [{"gpu_memory_mb": 512.0}]
    with pytest.raises(TypeError, match="call hint 'gpu_memory_mb' must be a number >= 0"):
        remote(1, gpu_memory_mb="lots")
    for bad in (-1, float("nan")):  # a number, out of range: a ValueError
        with pytest.raises(ValueError, match="call hint 'cost' must be a number >= 0"):
            remote(1, cost=bad)


def test_inside_a_task_a_single_call_drops_its_hints(monkeypatch):
    monkeypatch.setenv("GPUMESH_IN_TASK", "1")
    rec = Recorder()
    assert RemoteFunction(lambda x: x * 3, rec, {})(2, gpu_memory_mb=100) == 6
    assert rec.seen == []                                       # ran inline


def test_script_payload_hints():
    payloads = [{"lr": 0.1, "cost": 10}, {"gpu_memory_mb": 4096, "cost": 0.5}, {"cost": None},
                [1, 2], "text", 7, {"x": {"cost": 3}}]
    assert scripts.payload_hints(payloads) == [
        {"cost": 10.0}, {"gpu_memory_mb": 4096.0, "cost": 0.5}, {}, {}, {}, {}, {}]
    for bad in ("high", True, -1, [1]):
        with pytest.raises(ValueError, match=r"payload #1: 'gpu_memory_mb' is a scheduling hint"):
            scripts.payload_hints([{}, {"gpu_memory_mb": bad}])


def test_split_hints_leaves_the_callers_dict_alone():
    given = {"x": 1, "cost": 4}
    kwargs, hint = calls.split_hints(set(), given)
    assert (kwargs, hint, given) == ({"x": 1}, {"cost": 4.0}, {"x": 1, "cost": 4})


def test_status_result_text_for_the_terminal():
    from gpumesh.client.jobview import RELEASED_NOTE, jsonable, result_text
    assert result_text({"state": "done", "result": {"a": [1, 2]}}, False) == '{"a": [1, 2]}'
    assert result_text({"state": "done", "result": {1, 2}}, False) == "{1, 2}"
    assert result_text({"state": "done"}, True) == RELEASED_NOTE
    assert result_text({"state": "failed"}, True) is None
    assert result_text({"state": "done", "result_error": "ValueError: no"}, False) == \
        "(cannot be shown here: ValueError: no)"
    long = result_text({"state": "done", "result": "x" * 5000}, False)
    assert long.startswith('"' + "x" * 3999 + "...") and long.endswith("(5002 characters in all; --json shows it whole)")
    view = {"tasks": [{"id": "a", "result": {1}}, {"id": "b", "result": None}, {"id": "c"}]}
    assert jsonable(view)["tasks"] == [{"id": "a", "result": "{1}", "result_repr": True},
                                       {"id": "b", "result": None}, {"id": "c"}]
    assert view["tasks"][0]["result"] == {1}                     # the caller's view is left alone
