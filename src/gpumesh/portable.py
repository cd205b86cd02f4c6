"""Exceptions that travel as themselves, even where pickle alone would not carry them.

Pickle rebuilds an exception by calling its class with ``exc.args``
(``BaseException.__reduce__``). A class whose ``__init__`` takes other arguments than
what it passes to ``super().__init__`` (``def __init__(self, field, msg):
super().__init__(msg)``, botocore's ``ClientError``, many libraries' own) pickles on the
worker and then fails to load at the caller: ``TypeError: __init__() missing 1 required
positional argument``, the same bug a ``multiprocessing`` pool has (CPython bpo-32696).
An attribute that cannot be pickled (a lock, a socket, an open file) fails it earlier.

:func:`portable_exception` keeps an exception that survives one pickle round trip as it
is, and otherwise sends a stand-in, :class:`PortableException`, that unpickles as an
instance of the same class built the way pickle builds a plain object: ``cls.__new__``
with its ``args`` (no ``__init__`` call), then its ``__dict__``. Its type, ``args``,
message and attributes are the original's, so ``except ClientError`` at the caller works
as it does around a local call. Attributes (or ``args`` items) that cannot be pickled are
left behind, and a note on the exception (Python 3.11+) names them.

This module imports nothing from gpumesh and takes the pickler as arguments: the engine
backends ship a copy of it by value (:func:`by_value`) to Dask and Ray workers, which need
not have gpumesh installed.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

#: The start of the note that names what was left behind.
LEFT_NOTE = "[gpumesh] not sent back, as it cannot be pickled:"


class PortableException:
    """Pickles as a call of :func:`rebuild_exception`: ``cls`` (a BaseException
    subclass), its ``args`` tuple, its ``state`` (the instance ``__dict__`` to restore)
    and ``left`` (names of what could not travel, for the note)."""

    def __init__(self, cls: type, args: tuple, state: dict, left: tuple[str, ...]):
        self.cls, self.args, self.state, self.left = cls, args, state, left

    def __reduce__(self) -> tuple:
        return (rebuild_exception, (self.cls, self.args, self.state, self.left))


def rebuild_exception(cls: type, args: tuple, state: dict, left: tuple[str, ...] = ()) -> BaseException:
    """An instance of ``cls`` with ``args`` and the attributes ``state``, made without
    calling ``cls.__init__``; a note names ``left``. Raises ``TypeError`` when ``cls``
    cannot be made that way (its ``__new__`` refuses the arguments)."""
    try:
        exc = cls.__new__(cls, *args)
    except TypeError:  # a __new__ of its own with another signature
        exc = BaseException.__new__(cls, *args)
    exc.args = args
    exc.__dict__.update(state)
    if left and sys.version_info >= (3, 11):
        exc.add_note(f"{LEFT_NOTE} {', '.join(left)}")
    return exc


def portable_exception(exc: BaseException, dumps: Callable[[Any], Any],
                       loads: Callable[[Any], Any]) -> BaseException | PortableException | None:
    """What to pickle (with ``dumps``; ``loads`` is its inverse) to send ``exc``: itself
    if it survives a round trip (its class and ``args`` again); else a
    :class:`PortableException` with every attribute and ``args`` item that pickles (the
    others named in its note; an ``args`` item left behind is replaced by its ``repr``);
    None when not even that survives (its class cannot be pickled). Never raises."""
    try:
        if _same(loads(dumps(exc)), type(exc), exc.args):
            return exc
    except Exception:  # noqa: BLE001,S110 - pickle's own errors mean: a stand-in, below
        pass
    try:
        left: list[str] = []
        args = []
        for i, a in enumerate(exc.args):
            if _pickles(a, dumps):
                args.append(a)
            else:
                args.append(repr(a))
                left.append(f"args[{i}]")
        state = {}
        for name, value in vars(exc).items():
            if _pickles(value, dumps):
                state[name] = value
            else:
                left.append(f"attribute {name!r}")
        stand_in = PortableException(type(exc), tuple(args), state, tuple(left))
        if _same(loads(dumps(stand_in)), type(exc)):
            return stand_in
    except Exception:  # noqa: BLE001,S110 - it cannot travel: the caller gets its type and text
        pass
    return None


def _pickles(value: Any, dumps: Callable[[Any], Any]) -> bool:
    try:
        dumps(value)
    except Exception:  # noqa: BLE001 - whatever the pickler raises
        return False
    return True


def _same(copy: Any, cls: type, args: tuple | None = None) -> bool:
    """Whether ``copy`` is an exception of class ``cls`` (by name: a class pickled by
    value may load as a new class object) with these ``args`` unless None (a class whose
    ``__init__`` rewrites its message would rewrite it again when pickle calls it with
    them; an item without ``__eq__`` also differs, and the stand-in then carries it)."""
    if not (isinstance(copy, BaseException) and type(copy).__qualname__ == cls.__qualname__):
        return False
    if args is None:
        return True
    try:
        return bool(copy.args == args)
    except Exception:  # noqa: BLE001 - args that cannot be compared (arrays): the class says it
        return True


def by_value() -> dict[str, Any]:
    """A copy of this module's functions and classes, made from its source in a namespace
    no import can find, so that cloudpickle ships what uses them by value (to engine
    workers without gpumesh): ``{"portable_exception": ..., "rebuild_exception": ...}``."""
    import inspect
    namespace: dict[str, Any] = {"__name__": "_gpumesh_portable"}
    exec(compile(inspect.getsource(sys.modules[__name__]), "<gpumesh portable>", "exec"),  # noqa: S102
         namespace)
    return {k: namespace[k] for k in ("portable_exception", "rebuild_exception")}
