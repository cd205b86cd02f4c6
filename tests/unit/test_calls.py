"""Unit tests for gpumesh.client.calls: .map items -> calls, and failures -> exceptions."""

from __future__ import annotations

import threading

import pytest

from gpumesh import wire
from gpumesh.client import calls
from gpumesh.errors import (Cancelled, MeshError, RemoteError, RemoteTraceback, TaskCrashed,
                            TaskFailed, TaskTimeout, WorkerLost)
from gpumesh.protocol import ResultItem


# ---------------------------------------------------------------- map_items ----------

def two(a, b=0):
    return a + b


def test_dict_is_kwargs_tuple_is_args_scalar_is_single_arg():
    got, hints = calls.map_items(two, [{"a": 1, "b": 2}, (3, 4), 5, [6, 7], None])
    assert got == [((), {"a": 1, "b": 2}), ((3, 4), {}), ((5,), {}), (([6, 7],), {}), ((None,), {})]
    assert hints == [{}, {}, {}, {}, {}]
    assert [two(*a, **kw) for a, kw in got[:3]] == [3, 7, 5]


def test_empty_items():
    assert calls.map_items(two, []) == ([], [])


def test_items_from_a_generator():
    got, _ = calls.map_items(two, (i for i in range(3)))
    assert got == [((0,), {}), ((1,), {}), ((2,), {})]


def test_hint_keys_removed_when_not_in_signature():
    def f(x):
        return x

    got, hints = calls.map_items(f, [{"x": 1, "cost": 5}, {"x": 2, "gpu_memory_mb": 512},
                                     {"x": 3, "cost": 2.5, "gpu_memory_mb": 0}])
    assert got == [((), {"x": 1}), ((), {"x": 2}), ((), {"x": 3})]
    assert hints == [{"cost": 5.0}, {"gpu_memory_mb": 512.0}, {"cost": 2.5, "gpu_memory_mb": 0.0}]
    assert all(isinstance(v, float) for h in hints for v in h.values())


def test_hint_keys_kept_when_named_in_signature():
    def f(x, cost):
        return x * cost

    def g(x, *, gpu_memory_mb=0):
        return gpu_memory_mb

    got, hints = calls.map_items(f, [{"x": 2, "cost": 5}])
    assert got == [((), {"x": 2, "cost": 5})]
    assert hints == [{"cost": 5}]
    got, _ = calls.map_items(g, [{"x": 1, "gpu_memory_mb": 1024, "cost": 1}])
    assert got == [((), {"x": 1, "gpu_memory_mb": 1024})]


def test_named_hint_that_is_not_a_number_is_just_an_argument():
    def f(x, cost):
        return cost

    got, hints = calls.map_items(f, [{"x": 1, "cost": "high"}])
    assert got == [((), {"x": 1, "cost": "high"})]
    assert hints == [{}]


def test_var_kwargs_functions_still_get_hints_removed():
    def f(**kw):
        return kw

    got, hints = calls.map_items(f, [{"a": 1, "cost": 3, "gpu_memory_mb": 100}])
    assert got == [((), {"a": 1})]
    assert hints == [{"cost": 3.0, "gpu_memory_mb": 100.0}]


def test_a_hint_taken_from_a_var_kwargs_functions_items_is_said_once(capsys):
    def total(**row):
        return row

    def named(cost=None, **row):
        return row

    calls.map_items(total, [{"item": "a", "cost": 3.5, "qty": 2}] * 3)
    calls.map_items(total, [{"item": "b", "cost": 1}])
    err = capsys.readouterr().err
    assert err.count("[gpumesh] ") == 1, err
    assert ("test_a_hint_taken_from_a_var_kwargs_functions_items_is_said_once.<locals>.total: "
            "the .map items' 'cost' went to the scheduler as a hint, not to its **kwargs; "
            "to get it too, name it as a parameter (def f(..., cost=None, **rest))") in err
    calls.map_items(named, [{"item": "a", "cost": 3.5}])  # named: an argument, nothing said
    calls.map_items(two, [{"a": 1, "cost": 2}])  # no **kwargs: nothing to say
    assert capsys.readouterr().err == ""


def test_hints_in_tuples_and_scalars_are_untouched():
    got, hints = calls.map_items(two, [("cost", 5), {"cost": 1, "a": 1}])
    assert got[0] == (("cost", 5), {})
    assert got[1] == ((), {"a": 1})
    assert hints == [{}, {"cost": 1.0}]


@pytest.mark.parametrize("bad, error", [("5", TypeError), (None, TypeError), (True, TypeError),
                                        ([1], TypeError), ({"x": 1}, TypeError),
                                        (-1, ValueError), (float("nan"), ValueError)])
def test_a_bad_hint_is_a_type_error_and_a_negative_one_a_value_error(bad, error):
    def f(x):
        return x

    with pytest.raises(error) as ei:
        calls.map_items(f, [{"x": 1, "cost": bad}])
    assert "cost" in str(ei.value)
    with pytest.raises(error, match="gpu_memory_mb"):
        calls.map_items(f, [{"x": 1, "gpu_memory_mb": bad}])


def test_map_items_does_not_mutate_the_callers_dict():
    def f(x):
        return x

    item = {"x": 1, "cost": 2}
    calls.map_items(f, [item])
    assert item == {"x": 1, "cost": 2}


def test_explicit_params():
    def f(a, /, b, *args, c, d=1, **kw):
        pass

    assert calls.explicit_params(f) == {"b", "c", "d"}
    assert calls.explicit_params(object()) == set()


# ---------------------------------------------------------------- failure() ----------

def item(kind, message="boom", **err):
    return ResultItem(index=0, task_id="t1", state="failed", seq=0,
                      error=dict(kind=kind, message=message,
                                 traceback="Traceback (most recent call last):\n  remote\n", **err))


def test_raised_with_pickled_exception_is_the_same_type():
    payload = memoryview(wire.dumps(KeyError("x")).to_bytes())
    exc = calls.failure(item("raised", "'x'", type="KeyError", worker="w1"), payload)
    assert type(exc) is KeyError
    assert exc.args == ("x",)
    assert isinstance(exc.__cause__, RemoteTraceback)
    assert "remote" in exc.__cause__.tb
    assert "remote" in str(exc.__cause__)
    notes = getattr(exc, "__notes__", [])
    assert any("t1" in n and "w1" in n for n in notes)


def test_raised_custom_exception_keeps_attributes():
    class Custom(ValueError):
        def __init__(self, msg, code):
            super().__init__(msg, code)
            self.code = code

    payload = memoryview(wire.dumps(Custom("bad", 42)).to_bytes())
    exc = calls.failure(item("raised"), payload)
    assert isinstance(exc, ValueError)
    assert type(exc).__name__ == "Custom"
    assert exc.code == 42


def test_raised_with_unloadable_payload_is_remote_error():
    exc = calls.failure(item("raised", "it broke", type="mod.Weird"), memoryview(b"not a payload"))
    assert type(exc) is RemoteError
    assert exc.remote_type == "mod.Weird"
    assert exc.remote_message == "it broke"
    assert "mod.Weird: it broke" in str(exc)
    assert isinstance(exc.__cause__, RemoteTraceback)


def test_unpicklable_exception_is_remote_error_with_type_and_message():
    exc = calls.failure(item("raised", "holds a lock", type="tests.LockError"), None)
    assert isinstance(exc, RemoteError)
    assert isinstance(exc, TaskFailed) and isinstance(exc, MeshError)
    assert exc.remote_type == "tests.LockError"
    assert exc.remote_message == "holds a lock"
    assert exc.remote_traceback.startswith("Traceback")
    assert exc.task_id == "t1"


def test_timeout_is_task_timeout_and_timeout_error():
    exc = calls.failure(item("timeout", "the task ran longer than its timeout of 0.5s"), None)
    assert isinstance(exc, TaskTimeout)
    assert isinstance(exc, TimeoutError)
    assert isinstance(exc, MeshError)
    assert "0.5s" in str(exc) and "t1" in str(exc)


def test_crashed_is_task_crashed():
    exc = calls.failure(item("crashed", "the task process exited with code 7", worker="wx"), None)
    assert type(exc) is TaskCrashed
    assert "code 7" in str(exc)
    assert exc.worker == "wx"
    assert exc.task_id == "t1"


def test_lost_cancelled_exit_unknown():
    assert type(calls.failure(item("lost"), None)) is WorkerLost
    assert type(calls.failure(item("cancelled"), None)) is Cancelled
    ex = calls.failure(item("exit", "the task called sys.exit(3)", type="SystemExit"), None)
    assert type(ex) is RemoteError and "sys.exit(3)" in str(ex)
    assert type(calls.failure(item("whatever"), None)) is TaskFailed
    assert type(calls.failure(ResultItem(0, "t", "failed", 0), None)) is TaskFailed


def test_decode_result_done_and_failed():
    payload = memoryview(bytearray(wire.dumps({"v": [1, 2]}).to_bytes()))
    assert calls.decode_result(ResultItem(0, "t1", "done", 0, has_payload=True), payload) == {"v": [1, 2]}
    with pytest.raises(TaskCrashed):
        calls.decode_result(item("crashed"), None)


def test_exception_holding_a_lock_cannot_be_pickled():
    """The premise of RemoteError: such an exception cannot travel as itself."""
    class LockError(Exception):
        def __init__(self):
            super().__init__("holds a lock")
            self.lock = threading.Lock()

    with pytest.raises(TypeError, match="cannot pickle '_thread.lock'"):
        wire.dumps(LockError())


def test_where_never_doubles_a_comma():
    """Each part of an item's description once, joined by ", " whatever is unknown (a
    cancelled task has no worker: it used to read ``f(3),, task ...``)."""
    bare = ResultItem(index=3, task_id="76bafb25214a", state="failed", seq=0)
    assert calls.where(bare, ((3,), {}), 10, "f") == ".map item 3 of 10, f(3), task 76bafb25214a"
    assert calls.where(bare, None, 10) == ".map item 3 of 10, task 76bafb25214a"
    assert calls.where(bare, ((3,), {}), 1, "f") == "f(3), task 76bafb25214a"
    assert calls.where(bare) == "task 76bafb25214a"
    ran = ResultItem(index=3, task_id="t9", state="failed", seq=0,
                     error={"worker": "0afecb2d", "hostname": "laptop-a", "attempt": 2})
    assert calls.where(ran, ((), {"lr": 0.5}), 20, "train") == \
        ".map item 3 of 20, train(lr=0.5), on worker laptop-a (0afecb2d), attempt 2, task t9"
    assert calls.where(ran, ((3,), {}), 1, "f") == "f(3) on worker laptop-a (0afecb2d), attempt 2, task t9"
    assert calls.where(ran) == "task t9 on worker laptop-a (0afecb2d), attempt 2"


def test_a_cancelled_item_gets_no_return_exceptions_hint():
    hint = calls.keep_going()
    cancelled = ResultItem(index=3, task_id="76bafb25214a", state="failed", seq=0,
                           error={"kind": "cancelled", "type": "Cancelled",
                                  "message": "the job was cancelled"})
    exc = calls.failure(cancelled, None, call=((3,), {}), n=10, hint=hint, name="f")
    assert type(exc) is Cancelled
    assert str(exc) == "the job was cancelled (.map item 3 of 10, f(3), task 76bafb25214a)"
    # a failure of the function's own still says how to keep the other items' results
    crashed = ResultItem(index=3, task_id="t1", state="failed", seq=0,
                         error={"kind": "crashed", "message": "the task process exited with code 7"})
    assert str(calls.failure(crashed, None, n=10, hint=hint)).endswith("; " + hint)


def test_a_crash_names_its_attempt_once_and_a_progress_tail_as_shown():
    err = {"kind": "crashed", "message": "the task process exited with code 5; attempt 3 of 3",
           "worker": "w1", "attempt": 3,
           "stderr_tail": "\r 10%\r 50%\r 90%\nTraceback: boom\n"}
    it = ResultItem(index=0, task_id="t1", state="failed", seq=1, worker="w1", error=err)
    text = str(calls.failure(it, None))
    assert text.count("attempt 3") == 1, text
    assert text.endswith("--- last lines the task wrote to stderr ---\n 90%\nTraceback: boom"), text


def test_a_missing_module_the_caller_ships_by_value_says_to_import_it_at_the_top(monkeypatch):
    """``import helper`` in the function's body runs on the worker by name: "install it
    there" alone sent the user looking for the wrong fix."""
    import sys
    import types

    import cloudpickle
    helper = types.ModuleType("helper_shipped_here")
    monkeypatch.setitem(sys.modules, helper.__name__, helper)
    cloudpickle.register_pickle_by_value(helper)
    try:
        said = ("No module named {0!r} on any worker that could run this task: w (w1, Python "
                "3.11) lacks it; install it there (or join a worker that has it) and call again")
        for name in ("helper_shipped_here", "helper_shipped_here.sub"):
            exc = calls.failure(item("missing_module", said.format(name), module=name), None)
            assert type(exc) is ModuleNotFoundError and exc.name == name
            # (not "install it there ... and call again" first: that is not the fix here)
            assert str(exc).startswith(
                f"No module named {name!r} on any worker that could run this task: w (w1, "
                f"Python 3.11) lacks it. But {name!r} is one of this caller's own modules, "
                f"which travel with the "
                f"function by value only where it uses them from module level: an `import "
                f"{name}` inside the function's body runs on the worker, by name. Import it at "
                f"the top of your script (module level) instead, drop the import from the "
                f"function's body, and use the module-level name there: it then travels with "
                f"the function ("), str(exc)
    finally:
        cloudpickle.unregister_pickle_by_value(helper)
    # an installed package the workers lack (or one no longer shipped): no such words
    for name in ("torch", "helper_shipped_here"):
        exc = calls.failure(item("missing_module", f"No module named {name!r}", module=name), None)
        assert type(exc) is ModuleNotFoundError and "own modules" not in str(exc)


def test_a_missing_module_the_caller_never_imported_but_owns_says_to_import_it_at_the_top(
        tmp_path, monkeypatch):
    """``import helper`` only inside the body, ``helper.py`` next to the script: the
    advice came only when the caller had imported it, so the user read "install it there"
    for a file of their own project. It is found as an import would find it, without
    importing it."""
    import sys
    monkeypatch.delenv("GPUMESH_SHIP_LOCAL", raising=False)
    (tmp_path / "gm_body_helper.py").write_text("VALUE = 1\n")
    (tmp_path / "gm_body_pkg").mkdir()
    (tmp_path / "gm_body_pkg" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    said = ("No module named {0!r} on any worker that could run this task: w (w1, Python "
            "3.11) lacks it; install it there (or join a worker that has it) and call again")
    for name in ("gm_body_helper", "gm_body_pkg.sub"):
        exc = calls.failure(item("missing_module", said.format(name), module=name), None)
        assert type(exc) is ModuleNotFoundError
        text = str(exc)
        assert text.startswith(
            f"No module named {name!r} on any worker that could run this task: w (w1, Python "
            f"3.11) lacks it. But {name!r} is one of this caller's own modules, which travel "
            f"with the function by value only where it uses them from module level: an "
            f"`import {name}` inside the function's body runs on the worker, by name. Import "
            f"it at the top of your script"), text
        assert "install it there" not in text and "call again" not in text
    assert "gm_body_helper" not in sys.modules and "gm_body_pkg" not in sys.modules
    # A module of the standard library or an installed one the workers lack, or none the
    # caller has either: install it there, as before.
    for name in ("antigravity", "pytest", "gm_nowhere_at_all"):
        exc = calls.failure(item("missing_module", said.format(name), module=name), None)
        assert str(exc).startswith(said.format(name) + " ("), str(exc)
    # Not sent even from the top (GPUMESH_SHIP_LOCAL=0): importing it there would not help.
    monkeypatch.setenv("GPUMESH_SHIP_LOCAL", "0")
    exc = calls.failure(item("missing_module", said.format("gm_body_helper"),
                             module="gm_body_helper"), None)
    assert str(exc).startswith(said.format("gm_body_helper") + " ("), str(exc)
