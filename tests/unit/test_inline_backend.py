"""The inline backend: a call that runs here (mesh unreachable, GPUMESH_LOCAL=1, inside a
task) has a remote call's semantics: a pickle round trip, timeout=, the exception wrapping.
(tests/integration/test_inline_vs_mesh.py compares it with a real mesh.)"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

import pytest

from gpumesh import (GPUMesh, RemoteError, RemoteTraceback, TaskFailed, TaskTimeout, Unsatisfiable,
                     accelerate)
from gpumesh.client import pipeline
from gpumesh.hardware import Requirements

from ..conftest import free_port

STORE: list = []


@pytest.fixture
def m(monkeypatch):
    """A mesh nothing answers for: every call falls back to the inline backend."""
    monkeypatch.setattr(pipeline, "_notices", set())
    monkeypatch.delenv("GPUMESH_LOCAL", raising=False)
    monkeypatch.delenv("GPUMESH_IN_TASK", raising=False)
    return GPUMesh(f"http://127.0.0.1:{free_port()}", token="t", output=False)


def test_arguments_and_results_are_copies_as_on_a_worker(m):
    @accelerate(m)
    def grow(items):
        items.append("added by the task")
        return items

    mine = [1, 2]
    got = grow(mine)
    assert got == [1, 2, "added by the task"]
    assert mine == [1, 2]  # the caller's object is not the task's
    assert got is not mine

    @accelerate(m)
    def shared():
        return STORE

    assert shared() == STORE and shared() is not STORE


def test_timeout_is_enforced_locally(m):
    @accelerate(m, timeout=0.3)
    def sleepy(s):
        time.sleep(s)
        return s

    assert sleepy(0) == 0
    t0 = time.monotonic()
    # the words a worker's timeout has (protocol.timeout_message), then the call and where
    # it ran, as a local run's other failures say them
    with pytest.raises(TaskTimeout, match=r"^the task ran longer than its timeout of 0\.3s \(\S*sleepy\(5\) "
                                          r"on this machine\)$"):
        sleepy(5)
    assert time.monotonic() - t0 < 4  # the caller is not held for the function's 5 s
    got = sleepy.map([0, 5, 0], return_exceptions=True)
    assert got[0] == 0 and got[2] == 0 and isinstance(got[1], TaskTimeout)


def test_an_exception_arrives_as_itself_with_its_traceback_as_cause(m):
    @accelerate(m)
    def boom(x):
        raise KeyError(f"no {x}")

    with pytest.raises(KeyError) as e:
        boom("key")
    assert e.value.args == ("no key",)
    cause = e.value.__cause__
    assert isinstance(cause, RemoteTraceback)
    assert "raise KeyError" in cause.tb and cause.index == 0
    if sys.version_info >= (3, 11):
        (note,) = e.value.__notes__
        assert note.startswith("[gpumesh] raised by ")
        # it ran here (no coordinator): the note says so, not "remote traceback"
        assert note.endswith(".boom('key') on this machine, in this process (not on a worker); "
                             "the function's traceback above")
        assert "remote" not in note


def test_a_map_failure_names_its_item_and_stops_the_rest(m):
    ran = []

    @accelerate(m)
    def half(x):
        ran.append(x)
        if x == 1:
            raise ValueError("odd")
        return x / 2

    with pytest.raises(ValueError) as e:
        half.map([0, 1, 2])
    assert isinstance(e.value.__cause__, RemoteTraceback) and e.value.__cause__.index == 1
    if sys.version_info >= (3, 11):
        note = e.value.__notes__[0]
        assert note.startswith("[gpumesh] raised by .map item 1 of 3, ")
        assert (".half(1), on this machine, in this process (not on a worker); the function's "
                "traceback above\n") in note
        assert "the items after it did not run; pass return_exceptions=True to .map() " in note
    # the same batch made by distribute(): its advice names distribute(), not .map()
    with pytest.raises(ValueError) as e:
        m.distribute(function=half, params=[0, 1, 2])
    if sys.version_info >= (3, 11):
        assert "pass return_exceptions=True to distribute() to run every item" in e.value.__notes__[0]
    # and .map(ordered=False)'s names it as called, not the .imap() it goes through
    with pytest.raises(ValueError) as e:
        list(half.map([0, 1, 2], ordered=False))
    if sys.version_info >= (3, 11):
        assert "pass return_exceptions=True to .map(ordered=False) to run every item" \
            in e.value.__notes__[0], e.value.__notes__


def test_return_exceptions_puts_each_wrapped_exception_in_its_place(m):
    @accelerate(m)
    def inv(x):
        return 1 / x

    got = inv.map([1, 0, 4], return_exceptions=True)
    assert got[0] == 1.0 and got[2] == 0.25
    assert type(got[1]) is ZeroDivisionError
    assert isinstance(got[1].__cause__, RemoteTraceback) and "1 / x" in got[1].__cause__.tb
    assert sorted(inv.imap([1, 0], return_exceptions=True), key=lambda p: p[0])[0] == (0, 1.0)


def test_unpicklable_argument_or_result_fails_as_on_a_mesh(m):
    # tests/integration/test_inline_vs_mesh.py compares these with a real mesh
    lock = threading.Lock()
    ran: list = []

    @accelerate(m)
    def held(lk):
        ran.append(lk)
        return 1

    with pytest.raises(TypeError, match=r"argument 0 of .*held cannot be sent to a worker: "
                                        r"cannot pickle '_thread.lock'"):
        held(lock)
    with pytest.raises(TypeError, match=r"argument 0 of .*held \(item 2 of the map\)"):
        held.map([1, 2, lock])
    assert ran == []  # nothing ran: every argument is pickled first, as for a submit

    @accelerate(m)
    def make(kind):
        import threading as _th  # (a lock of the caller's would make the function unpicklable)
        return _th.Lock() if kind == "lock" else (i for i in range(2)) if kind == "gen" else kind

    with pytest.raises(RemoteError) as ei:
        make("lock")
    assert ei.value.remote_type == "TypeError"
    assert ei.value.remote_message == ("the return value (lock) cannot be pickled: "
                                       "cannot pickle '_thread.lock' object")
    assert "on this machine" in str(ei.value)
    got = make.map(["ok", "gen", "fine"], return_exceptions=True)
    assert got[0] == "ok" and got[2] == "fine"
    assert isinstance(got[1], RemoteError) and "(generator) cannot be pickled" in str(got[1])


def test_sys_exit_is_a_task_failure_not_the_callers_exit(m):
    @accelerate(m)
    def quits():
        sys.exit(3)

    with pytest.raises(TaskFailed, match=r"sys.exit\(3\)"):
        quits()


def test_ctrl_c_still_interrupts_the_caller(m):
    @accelerate(m)
    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        interrupted()


def test_retries_rerun_with_fresh_arguments(m):
    @accelerate(m, retries=2, retry_on=OSError)
    def flaky(box):
        box.append(1)
        if len(box) < 2:  # fresh copies each attempt: the box never grows past one
            raise OSError("flaky")
        return len(box)

    with pytest.raises(OSError, match="flaky"):
        flaky([])
    assert flaky([0]) == 2


def test_gpumesh_local_and_in_task_use_the_inline_backend(m, monkeypatch):
    @accelerate(m, timeout=0.2)
    def sleepy():
        time.sleep(3)

    monkeypatch.setenv("GPUMESH_LOCAL", "1")
    with pytest.raises(TaskTimeout):
        sleepy()
    monkeypatch.delenv("GPUMESH_LOCAL")
    monkeypatch.setenv("GPUMESH_IN_TASK", "1")  # a decorated call inside a task
    with pytest.raises(TaskTimeout):
        sleepy()
    with pytest.raises(TaskTimeout):
        sleepy.map([()])


def test_a_call_inside_a_task_meets_its_requirements_on_the_tasks_worker(m, monkeypatch):
    monkeypatch.setenv("GPUMESH_IN_TASK", "1")  # a decorated call inside a task

    @accelerate(m, requires=["gm-definitely-not-installed-xyz"])
    def needs_package(x):
        return x

    @accelerate(m, memory="100000GB")
    def needs_memory(x):
        return x

    @accelerate(m, cores=1)
    def fits(x):
        return x + 1

    inline = "^a decorated call inside a task runs inline, on the task's worker, and this machine"
    for fn in (needs_package, needs_memory):
        with pytest.raises(Unsatisfiable, match=inline):
            fn(1)
        with pytest.raises(Unsatisfiable, match=inline):
            fn.map([1, 2])
    assert fits(1) == 2 and fits.map([1, 2]) == [2, 3]


def test_a_cache_function_called_inside_a_task_keeps_the_tasks_cache(m, monkeypatch):
    import functools
    monkeypatch.setenv("GPUMESH_IN_TASK", "1")  # decorated calls inside a task run inline
    ran = []

    @accelerate(m)
    @functools.cache
    def doubled(x):
        ran.append(x)
        return 2 * x

    @accelerate(m)
    def grow(items):
        items.append("added")
        return len(items)

    # the task process's own cache: a nested call is the function itself, not a copy
    assert [doubled(3), doubled(3), doubled.map([4, 3])] == [6, 6, [8, 6]]
    assert ran == [3, 4] and doubled.cache_info().hits == 2
    mine = [1]
    assert grow(mine) == 2 and mine == [1]  # arguments are still copies


def test_local_does_not_take_part(m):
    mine = []

    @accelerate(m, timeout=0.1)
    def grow(items):
        items.append(1)
        return items

    assert grow.local(mine) is mine and mine == [1]  # a plain call


class _Refusing(pipeline.Backend):
    """A backend that stores nothing: the pipeline falls back to the inline backend."""

    def __init__(self, why):
        self.why = why

    def run(self, job):
        raise pipeline.Fallback(self.why, "stub: running locally")
        yield  # pragma: no cover


def test_a_fallback_runs_inline_after_the_local_check(monkeypatch, capsys):
    monkeypatch.setattr(pipeline, "_notices", set())
    monkeypatch.setattr(pipeline, "_this_machine", {"gpus": [], "mps": False, "cores": 4,
                                                    "ram_mb": 8000, "cpu": "CPU"})

    class Stub:
        def _backend(self):
            return _Refusing("no worker is alive in the stub")

    job = pipeline.Job(lambda x: x + 1, [((1,), {}), ((2,), {})], [{}, {}])
    assert list(pipeline.run(Stub(), job)) == [(0, 2), (1, 3)]
    assert "stub: running locally" in capsys.readouterr().err
    job = pipeline.Job(lambda x: x, [((1,), {})], [{}], require=Requirements(gpu="cuda"))
    with pytest.raises(Unsatisfiable, match="^no worker is alive in the stub, and this machine"):
        list(pipeline.run(Stub(), job))


def test_inline_pid_is_this_process(m):
    @accelerate(m)
    def pid():
        return os.getpid()

    assert pid() == os.getpid()


def test_a_tasks_stop_iteration_reaches_the_caller_as_itself(m, monkeypatch):
    """PEP 479 turned a StopIteration raised inside the pipeline's generator into a bare
    ``RuntimeError: generator raised StopIteration``; ``.local()`` raises StopIteration."""
    @accelerate(m)
    def stop(x):
        if x == "empty":
            return next(iter([]))
        if x:
            raise StopIteration(x)
        return "ran"

    with pytest.raises(StopIteration) as ei:
        stop.local(5)
    assert ei.value.args == (5,)
    for in_task in (False, True):  # inside a task, decorated calls run inline too
        if in_task:
            monkeypatch.setenv("GPUMESH_IN_TASK", "1")
        with pytest.raises(StopIteration) as ei:
            stop(5)
        assert type(ei.value) is StopIteration and ei.value.args == (5,) and ei.value.value == 5
        assert isinstance(ei.value.__cause__, RemoteTraceback)
        assert "raise StopIteration(x)" in ei.value.__cause__.tb
        with pytest.raises(StopIteration) as ei:
            stop("empty")
        assert ei.value.args == () and "next(iter([]))" in ei.value.__cause__.tb
        with pytest.raises(StopIteration) as ei:
            stop.map([0, 7, 0])
        assert ei.value.args == (7,) and ei.value.__cause__.index == 1
        got = stop.map([0, 7], return_exceptions=True)
        assert got[0] == "ran" and type(got[1]) is StopIteration and got[1].args == (7,)
        pairs = dict(stop.imap([0, 7], return_exceptions=True))
        assert pairs[0] == "ran" and type(pairs[1]) is StopIteration and pairs[1].args == (7,)
    monkeypatch.delenv("GPUMESH_IN_TASK")
    with pytest.raises(StopIteration) as ei:
        m.distribute(stop, [0, 3])
    assert ei.value.args == (3,)
    # From .imap's next() a StopIteration would end the caller's for loop silently, as if
    # every result had come: it arrives as a RuntimeError whose cause is the task's.
    seen = []
    with pytest.raises(RuntimeError, match=r"raised StopIteration\(7\), which an iterator's "
                                           r"next\(\) cannot raise") as ei:
        for pair in stop.imap([0, 7]):
            seen.append(pair)
    assert type(ei.value.__cause__) is StopIteration and ei.value.__cause__.args == (7,)
    assert isinstance(ei.value.__cause__.__cause__, RemoteTraceback)
    assert seen == [(0, "ran")]
    assert str(ei.value).startswith("a task of .imap() raised StopIteration(7)")
    # .map(ordered=False) is named as called, here and inside a task
    for in_task in (False, True):
        if in_task:
            monkeypatch.setenv("GPUMESH_IN_TASK", "1")
        with pytest.raises(RuntimeError) as ei:
            list(stop.map([0, 7], ordered=False))
        assert str(ei.value).startswith("a task of .map(ordered=False) raised StopIteration(7), "
                                        "which an iterator's next() cannot raise"), str(ei.value)


def test_a_maps_input_is_read_only_up_to_one_item_past_the_limit(m, monkeypatch, tmp_path):
    """``.map(itertools.count())`` read the endless input into a list (~330 MB/s, until the
    machine gave out): reading stops one item past MAX_TASKS_PER_JOB, with a ValueError."""
    import itertools

    from gpumesh import limits
    monkeypatch.setattr(limits, "MAX_TASKS_PER_JOB", 5)
    drawn: list[int] = []

    def endless():
        for i in itertools.count():
            drawn.append(i)
            assert i < 100, "read on past the limit"  # (the old code read forever)
            yield i

    @accelerate(m)
    def double(x):
        return 2 * x

    script = tmp_path / "s.py"
    script.write_text("print(1)\n")
    for who, start in ((".map()", lambda: double.map(endless())),
                       (".imap()", lambda: double.imap(endless())),
                       # (what the user called, not the .imap() it goes through)
                       (".map(ordered=False)", lambda: double.map(endless(), ordered=False)),
                       ("distribute()", lambda: m.distribute(double, endless())),
                       ("submit()", lambda: m.submit(script=str(script), payloads=endless()))):
        drawn.clear()
        with pytest.raises(ValueError) as ei:
            start()
        assert drawn == [0, 1, 2, 3, 4, 5], who  # the limit and one more, no further
        text = str(ei.value)
        assert text.startswith(f"{who} got more than 5 ")
        assert "the most one job may carry (MAX_TASKS_PER_JOB)" in text
        assert "it reads its whole input before it submits anything" in text
    assert double.map(iter(range(5))) == [0, 2, 4, 6, 8]  # the limit itself is fine
    assert sorted(double.imap(range(5))) == [(i, 2 * i) for i in range(5)]


LOCK = threading.Lock()


class Holder:
    def __init__(self):
        self.lock = threading.Lock()

    def work(self, x):
        return x


def test_a_function_that_cannot_be_pickled_is_named_as_an_argument_is(m):
    """The pickler's bare ``cannot pickle '_thread.lock' object`` named neither the
    function nor where the lock was; an argument's error names the argument."""
    def reads_global(x):
        return LOCK, x

    lock = threading.Lock()

    def closes_over(x):
        return lock, x

    def defaults(x, lk=lock):
        return x

    cases = [(reads_global, "global 'LOCK' of the function "
                            "test_a_function_that_cannot_be_pickled_is_named_as_an_argument_is."
                            "<locals>.reads_global"),
             (closes_over, "closure variable 'lock' of the function "),
             (defaults, "a default argument of the function "),
             (Holder().work, "the Holder object that the method Holder.work is bound to")]
    for fn, words in cases:
        f = accelerate(m)(fn)
        for call in (lambda f=f: f(1), lambda f=f: f.map([1, 2]),
                     lambda f=f: list(f.imap([1]))):
            with pytest.raises(TypeError) as ei:
                call()
            text = str(ei.value)
            assert text.startswith(words), text
            assert text.endswith(" cannot be sent to a worker: cannot pickle '_thread.lock' object")
            assert type(ei.value.__cause__) is TypeError  # the pickler's own error
            assert str(ei.value.__cause__) == "cannot pickle '_thread.lock' object"


CFG: Any = None  # (a module, for the next test)


def test_a_module_that_cannot_be_pickled_is_named_down_to_the_value(m, tmp_path, monkeypatch):
    """A module that travels whole (here one loaded from a file by hand, never put in
    sys.modules, which cloudpickle sends with its namespace) named only the global that
    holds it ("global 'cfg' of the function b"), not the value in it that fails."""
    import importlib.util
    import textwrap
    (tmp_path / "lockcfg.py").write_text(textwrap.dedent("""
        import threading
        LIMIT = 2
        def locked():
            with _lock:
                return 1
        _lock = threading.Lock()
    """))
    spec = importlib.util.spec_from_file_location("gm_lockcfg", tmp_path / "lockcfg.py")
    cfg = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cfg)
    monkeypatch.setattr(sys.modules[__name__], "CFG", cfg)

    def b(xs):
        return CFG.LIMIT, xs

    def closes_over(xs):
        return cfg.LIMIT, xs

    with pytest.raises(TypeError) as ei:
        accelerate(m)(b)([1])
    assert str(ei.value) == (
        "gm_lockcfg._lock (in global 'CFG' of the function test_a_module_that_cannot_be_"
        "pickled_is_named_down_to_the_value.<locals>.b) cannot be sent to a worker: "
        "cannot pickle '_thread.lock' object")
    with pytest.raises(TypeError, match=r"^gm_lockcfg._lock \(in closure variable 'cfg' of "):
        accelerate(m)(closes_over)([1])
    # Only a function of it fails (one it imported from elsewhere): that function, and
    # the global it reads.
    del cfg._lock
    elsewhere = {"_lock": threading.Lock()}
    exec("def locked():\n    with _lock:\n        return 1\n", elsewhere)
    cfg.locked = elsewhere["locked"]
    with pytest.raises(TypeError) as ei:
        accelerate(m)(b)([1])
    assert str(ei.value).startswith(
        "gm_lockcfg.locked (its global '_lock') (in global 'CFG' of the function ")


def test_a_cache_function_runs_with_a_cache_of_the_jobs_own(m):
    """``@mesh`` over ``@functools.cache`` failed with "Can't pickle <functools.
    _lru_cache_wrapper ...>: it's not the same object"; now the task's process has a cache
    of its own (a task's, or a job's process's with isolation="job"), the caller's untouched."""
    import functools
    import random

    @accelerate(m)
    @functools.cache
    def draw(x):
        return x, random.random()

    one, again, other = draw.map([1, 1, 2])
    # each task of the default isolation: a fresh process's cache, as on a worker
    assert one[0] == again[0] == 1 and one != again and other[0] == 2
    one, again = draw.map([1, 1], isolation="job")
    assert one == again  # a job's process: one cache for the job's tasks
    assert draw(1)[0] == 1 and draw(1) != draw(1)  # each call: a fresh process's cache
    assert draw.__gpumesh_wrapped__.cache_info().currsize == 0  # not the caller's
    assert draw.local(3) == draw.local(3)  # .local(): the caller's own cache
    assert draw.__gpumesh_wrapped__.cache_info().hits == 1
    # The decorated function's own cache methods reach that cache (they were an
    # AttributeError on the RemoteFunction); remote calls leave it as it is.
    assert draw.cache_info() == functools._CacheInfo(hits=1, misses=1, maxsize=None, currsize=1)
    draw(4)
    assert draw.cache_info().currsize == 1
    assert draw.cache_parameters() == {"maxsize": None, "typed": False}
    draw.cache_clear()
    assert draw.cache_info() == functools._CacheInfo(hits=0, misses=0, maxsize=None, currsize=0)
    assert draw.to("cpu").cache_info().currsize == 0  # (the same function, the same cache)

    @accelerate(m)
    def plain(x):
        return x

    assert not hasattr(plain, "cache_info") and not hasattr(plain, "cache_clear")
    with pytest.raises(AttributeError, match=r"'RemoteFunction' object has no attribute "
                                             r"'cache_clear': .*plain is not a functools.cache/"
                                             r"lru_cache function"):
        plain.cache_clear()

    @accelerate(m)
    @functools.lru_cache(maxsize=1)
    def tiny(x):
        return x, random.random()

    a, b, c, d = tiny.map([1, 2, 1, 1], isolation="job")
    assert a != c and c == d  # its maxsize=1 still holds where it runs
