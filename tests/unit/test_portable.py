"""gpumesh.portable: an exception pickle cannot rebuild still travels as itself."""

from __future__ import annotations

import pickle
import subprocess
import sys
import threading

import cloudpickle
import pytest

from gpumesh import portable, wire


class TwoArgs(Exception):
    def __init__(self, field, msg):
        super().__init__(msg)
        self.field = field


class Locked(Exception):
    def __init__(self, msg):
        super().__init__(msg)
        self.code = 3
        self.lock = threading.Lock()


class Guarded(Exception):
    guard = threading.Lock()


class RenamesItself(Exception):
    """pickle's rebuild passes .args to __init__ again: the message would double."""
    def __init__(self, what):
        super().__init__(f"needs {what}")


class TwoPartNew(Exception):
    def __new__(cls, a, b):  # refuses .args, a tuple of one
        return super().__new__(cls, a, b)

    def __init__(self, a, b):
        super().__init__(f"{a}{b}")


def travel(exc):
    payload = wire.dumps_exception(exc)
    return None if payload is None else wire.loads(payload.to_bytes())


def test_pickle_alone_cannot_rebuild_such_an_exception():
    """The premise: pickle calls the class again with .args."""
    with pytest.raises(TypeError, match="missing 1 required positional argument"):
        pickle.loads(pickle.dumps(TwoArgs("age", "must be positive")))


def test_an_exception_pickle_carries_is_sent_as_itself():
    e = KeyError("k")
    assert portable.portable_exception(e, pickle.dumps, pickle.loads) is e
    got = travel(UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad"))
    assert type(got) is UnicodeDecodeError and got.start == 0 and got.reason == "bad"
    got = travel(OSError(2, "gone"))
    assert type(got) is FileNotFoundError and got.errno == 2 and got.strerror == "gone"


def test_a_custom_init_is_rebuilt_without_calling_it():
    got = travel(TwoArgs("age", "must be positive"))
    assert type(got) is TwoArgs and got.args == ("must be positive",)
    assert got.field == "age" and str(got) == "must be positive"
    assert not getattr(got, "__notes__", None)  # nothing was left behind


def test_what_cannot_be_pickled_is_left_behind_and_named():
    got = travel(Locked("busy"))
    assert type(got) is Locked and got.args == ("busy",) and got.code == 3
    assert not hasattr(got, "lock")
    lock = threading.Lock()
    got = travel(ValueError("x", lock))
    assert type(got) is ValueError and got.args == ("x", repr(lock))
    if sys.version_info >= (3, 11):
        assert travel(Locked("busy")).__notes__ == [
            f"{portable.LEFT_NOTE} attribute 'lock'"]
        assert got.__notes__ == [f"{portable.LEFT_NOTE} args[1]"]


def test_a_class_that_cannot_be_pickled_does_not_travel():
    with pytest.raises(TypeError):
        cloudpickle.dumps(Guarded)  # (by reference it would; this test module ships by value)
    assert portable.portable_exception(Guarded("no"), cloudpickle.dumps, cloudpickle.loads) is None


def test_a_rebuild_that_changes_the_args_is_not_trusted():
    assert str(pickle.loads(pickle.dumps(RenamesItself("x")))) == "needs needs x"
    got = travel(RenamesItself("x"))
    assert type(got) is RenamesItself and got.args == ("needs x",)


class Thing:  # (no __eq__: a copy differs from the original)
    def __init__(self, n):
        self.n = n


def test_args_without_equality_travel():
    got = travel(ValueError(Thing(5), "x"))
    assert type(got) is ValueError and got.args[0].n == 5 and got.args[1] == "x"


def test_a_new_of_its_own_with_another_signature():
    got = travel(TwoPartNew("a", "b"))
    assert type(got) is TwoPartNew and got.args == ("ab",)


def test_the_copy_shipped_by_value_loads_where_gpumesh_cannot_be_imported():
    """The engines' copy (a Dask or Ray worker may lack gpumesh): what it makes pickles
    by value, so a loader needs only cloudpickle."""
    copy = portable.by_value()
    stand_in = copy["portable_exception"](TwoArgs("f", "m"), cloudpickle.dumps, cloudpickle.loads)
    data = cloudpickle.dumps(stand_in)
    loader = ("import sys; sys.modules['gpumesh'] = None; import cloudpickle; "
              "e = cloudpickle.loads(sys.stdin.buffer.read()); "
              "print(type(e).__name__, e.args, e.field, getattr(e, '__notes__', None))")
    out = subprocess.run([sys.executable, "-c", loader], input=data, capture_output=True,
                         timeout=60, cwd="/")
    assert out.returncode == 0, out.stderr.decode()
    assert out.stdout.decode().split("\n")[0] == "TwoArgs ('m',) f None"


cloudpickle.register_pickle_by_value(sys.modules[__name__])  # (Guarded ships by value)
