"""A value that comes back but cannot be unpickled at the caller: raised as itself, with
a note (3.11+; the cause before) saying where the task ran and the likely reason."""

from __future__ import annotations

import platform
import sys
import types
from importlib import metadata

import pytest

from gpumesh import wire
from gpumesh.client import calls
from gpumesh.protocol import ResultItem


def done(worker: str = "w1") -> ResultItem:
    return ResultItem(index=3, task_id="t9", state="done", seq=1, worker=worker, has_payload=True)


def said(exc: BaseException) -> str:
    """What the note (3.11+) or the cause (3.10) says."""
    if sys.version_info >= (3, 11):
        return "\n".join(getattr(exc, "__notes__", []))
    return str(exc.__cause__)


def rebuild(obj, about: dict | None, **kw) -> BaseException:
    payload = memoryview(wire.dumps(obj).to_bytes())
    asked: list[str] = []

    def about_worker(wid):
        asked.append(wid)
        return about

    with pytest.raises(Exception) as e:
        calls.decode_result(done(), payload, about_worker=about_worker, **kw)
    assert asked == ["w1"]
    return e.value


class Gone:
    """Pickled by reference under a module this process then forgets."""


@pytest.fixture
def vanished(monkeypatch):
    """An object whose class lives in ``module`` at pickling time and nowhere after."""
    def make(module: str):
        mod = types.ModuleType(module)
        Gone.__module__ = module
        mod.Gone = Gone
        monkeypatch.setitem(sys.modules, module, mod)
        payload = wire.dumps(Gone())
        monkeypatch.delitem(sys.modules, module)
        return payload
    yield make
    Gone.__module__ = __name__


def test_a_module_missing_here_is_named_as_missing_on_this_machine(vanished):
    payload = memoryview(vanished("gm_worker_only_mod").to_bytes())
    with pytest.raises(ModuleNotFoundError) as e:
        calls.decode_result(done(), payload, call=((5,), {}), n=10, name="make",
                            hint="the batch's other tasks were cancelled",
                            about_worker=lambda wid: {"python": platform.python_version()})
    text = said(e.value)
    assert ".map item 3 of 10, make(5), on worker w1" in text
    assert "the task returned, but this process (Python " in text
    assert "could not rebuild its value; it is not run again" in text
    assert "this machine lacks the module 'gm_worker_only_mod'" in text
    assert "the batch's other tasks were cancelled" in text


def test_a_submodule_missing_here_is_a_version_gap_of_its_package(vanished):
    numpy_here = metadata.version("numpy")
    payload = memoryview(vanished("numpy._gm_not_in_this_numpy").to_bytes())
    with pytest.raises(ModuleNotFoundError) as e:
        calls.decode_result(done(), payload,
                            about_worker=lambda wid: {"packages": {"numpy": "9.9.9"}})
    text = said(e.value)
    assert (f"this machine has numpy {numpy_here} but not numpy._gm_not_in_this_numpy: the worker "
            f"made it with numpy 9.9.9; install the same version on both") in text


class MadeElsewhere:
    """Rebuilt with arguments this Python's constructor refuses (as a code object made by
    another minor version is)."""

    def __reduce__(self):
        return (int, ("1", 2, 3))


def other_minor() -> str:
    return f"3.{sys.version_info[1] + 1}.0"


def test_a_worker_of_another_python_is_named_with_both_versions():
    exc = rebuild(MadeElsewhere(), {"python": other_minor(), "packages": {}})
    assert isinstance(exc, TypeError)
    text = said(exc)
    assert f"this process (Python {platform.python_version()}) could not rebuild" in text
    assert f"the worker runs Python {other_minor()}" in text
    assert "loads only on the Python minor version that made it" in text


class BadVersion:
    """Rebuilt by a third-party constructor (packaging's) that raises."""

    def __reduce__(self):
        from packaging.version import Version
        return (Version, ("not a version",))


def test_a_failure_inside_a_package_names_its_two_versions():
    mine = metadata.version("packaging")
    exc = rebuild(BadVersion(), {"python": platform.python_version(),
                                 "packages": {"packaging": "0.1"}})
    assert f"versions differ: packaging {mine} here, 0.1 on the worker" in said(exc)
    # The same versions: nothing to compare, and no such line.
    exc = rebuild(BadVersion(), {"python": platform.python_version(),
                                 "packages": {"packaging": mine}})
    assert "versions differ" not in said(exc)
    assert "could not rebuild its value" in said(exc)


def test_without_a_way_to_look_the_worker_up_the_note_still_says_where():
    payload = memoryview(wire.dumps(MadeElsewhere()).to_bytes())
    with pytest.raises(TypeError) as e:
        calls.decode_result(done(), payload)
    assert "task t9 on worker w1: the task returned, but this process" in said(e.value)


def test_code_made_on_another_python_minor_is_refused_before_it_loads():
    # 3.11 and 3.12 build code objects alike: such a function would load, then crash
    # this interpreter when called. It is refused with where it came from.
    from gpumesh.errors import TaskFailed
    payload = memoryview(wire.dumps(lambda y: y * 7).to_bytes())
    asked: list[str] = []

    def about(python):
        def look(wid):
            asked.append(wid)
            return {"python": python, "hostname": "laptop-b"}
        return look

    with pytest.raises(TaskFailed) as e:
        calls.decode_result(done(), payload, call=((2,), {}), n=4, name="make",
                            hint="the batch's other tasks were cancelled",
                            about_worker=about(other_minor()))
    text = str(e.value)
    assert text.startswith(".map item 3 of 4, make(2), on worker laptop-b (w1)")
    assert f"whose bytecode is Python {other_minor().rsplit('.', 1)[0]}'s" in text
    assert f"this process runs Python {platform.python_version()}" in text
    assert text.endswith("the batch's other tasks were cancelled")
    assert e.value.task_id == "t9" and e.value.worker == "w1"
    # The caller's own Python: it loads and runs.
    fn = calls.decode_result(done(), payload, about_worker=about(platform.python_version()))
    assert fn(3) == 21
    # Plain data never asks where it came from.
    asked.clear()
    data = memoryview(wire.dumps({"a": [1, 2]}).to_bytes())
    assert calls.decode_result(done(), data, about_worker=about(other_minor())) == {"a": [1, 2]}
    assert asked == []


def test_holds_code_reads_only_the_pickle_stream():
    import numpy as np
    assert wire.holds_code(wire.dumps(lambda: 1).to_bytes())
    assert not wire.holds_code(wire.dumps({"x": "no code"}).to_bytes())
    # an array's bytes travel out of band: the word inside them is not searched
    arr = np.frombuffer(b"CodeType" * 1000, dtype=np.uint8)
    assert not wire.holds_code(wire.dumps(arr).to_bytes())
