"""A module shipped by value arrives as one module, not as one namespace per function.

cloudpickle rebuilds each function of a module registered by value
(:mod:`gpumesh.localcode`) with a fresh dict of globals, holding only the names the
function reads, and rebuilds the module object itself (where a task refers to it, as in
``import helper; helper.THRESHOLD = 2``) as yet another namespace. On the worker,
``helper.THRESHOLD = 2`` then changes what the task sees as ``helper`` but not what
``helper.above()`` reads, and a cache a module keeps for itself (``_MODEL`` set by
``helper.load()``) is not the one ``helper._MODEL`` shows: the values differ from a
local run, silently.

Here the caller's pickler (:func:`gpumesh.wire.dumps`) gives every function of such a
module, and the module object itself, one namespace on the receiving side: that of a
module rebuilt once per caller process and module name (:func:`module`), which every
payload from that process refers to by a ``(token, name)`` key. A job's process that
loads the function once and arguments per task keeps the one module; payloads of another
caller (another token) never share it. The module object carries the whole namespace
only where the task refers to the module itself; a function brings the names it reads,
as before, so nothing more travels than cloudpickle sends.

The caller's inline backend (the mesh unreachable) loads each job in a :class:`Scope` of
its own, so a task never changes the caller's modules, as on a worker. The module is not
put into ``sys.modules``: an ``import helper`` inside a function body
still looks for an installed ``helper`` (see docs: "Your own modules travel with the
function").
"""

from __future__ import annotations

import builtins
import os
import sys
import types
from collections import OrderedDict
from contextvars import ContextVar, Token
from typing import Any

#: This process's token: the key of the modules it ships (random, per process).
TOKEN = os.urandom(8).hex()
#: Modules rebuilt in this process, by (token, name), the most recent last. Bounded: a
#: worker that serves many callers over weeks drops the oldest (a function rebuilt before
#: keeps its namespace; a later payload with an evicted key starts a new module).
_MODULES: OrderedDict[tuple[str, str], types.ModuleType] = OrderedDict()
MAX_MODULES = 512
#: The scope whose registries the loads of this context use (None: the process's).
_SCOPE: ContextVar[Scope | None] = ContextVar("gpumesh_namespaces", default=None)


class Scope:
    """What the loads made inside ``with scope:`` blocks rebuild is this scope's alone:
    the caller's inline backend runs each job as a worker's process would, with modules
    (``modules``) and classes sent by value (``classes``, by cloudpickle's class id: see
    :mod:`gpumesh.classes`) of its own, never the caller's (nor a former job's)."""

    def __init__(self) -> None:
        self.modules: OrderedDict[tuple[str, str], types.ModuleType] = OrderedDict()
        self.classes: dict[str, type] = {}
        self._reset: list[Token] = []

    def __enter__(self) -> Scope:
        self._reset.append(_SCOPE.set(self))
        return self

    def __exit__(self, *exc: object) -> None:
        _SCOPE.reset(self._reset.pop())


def current() -> Scope | None:
    """The :class:`Scope` the loads of this context are made in, if any."""
    return _SCOPE.get()


def module(token: str, name: str, attrs: dict[str, Any] | None = None) -> types.ModuleType:
    """The module ``name`` shipped by the caller process ``token``: made empty the first
    time, with ``attrs`` (its ``__file__``, ``__package__``...; its other names arrive with
    the payloads that refer to it)."""
    scope = _SCOPE.get()
    modules = _MODULES if scope is None else scope.modules
    key = (token, name)
    mod = modules.get(key)
    if mod is None:
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs or {})
        mod.__dict__["__builtins__"] = builtins.__dict__
        modules[key] = mod
        while len(modules) > MAX_MODULES:
            modules.popitem(last=False)
    else:
        modules.move_to_end(key)
    return mod


def namespace(token: str, name: str, attrs: dict[str, Any] | None = None) -> dict[str, Any]:
    """The globals of the functions of module ``name`` shipped by ``token`` (see
    :func:`module`)."""
    return module(token, name, attrs).__dict__


def _update(mod: types.ModuleType, state: dict[str, Any]) -> None:
    mod.__dict__.update(state)


class _Namespace(dict):
    """Stands, in the caller's pickler, for the globals of a module shipped by value:
    it pickles as a reference to :func:`namespace`, with what cloudpickle puts in it
    (the module's ``__name__``, ``__package__``, ``__file__`` and ``__path__``)."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def __reduce__(self):
        return namespace, (TOKEN, self.name, dict(self))


def shipped_module_of(globals_: dict[str, Any], by_value) -> types.ModuleType | None:
    """The module whose namespace is ``globals_`` if ``by_value(module)`` says it is
    shipped by value (cloudpickle's registry), else None."""
    name = globals_.get("__name__")
    mod = sys.modules.get(name) if isinstance(name, str) else None
    if mod is None or getattr(mod, "__dict__", None) is not globals_ or not by_value(mod):
        return None
    return mod


def reduce_override(pickler: Any, obj: object, by_value) -> Any:
    """What the caller's cloudpickle pickler does with ``obj`` here: for a module
    shipped by value, a reduction to :func:`module` with its namespace as state; for a
    function of one, its globals marked as that module's before cloudpickle reduces it
    (its ``globals_ref``). ``NotImplemented`` otherwise (cloudpickle decides)."""
    if isinstance(obj, types.ModuleType):
        if obj.__name__ in sys.modules and sys.modules[obj.__name__] is obj and by_value(obj):
            state = {k: v for k, v in obj.__dict__.items() if k != "__builtins__"}
            return module, (TOKEN, obj.__name__), state, None, None, _update
        return NotImplemented
    if type(obj) is types.FunctionType:
        mod = shipped_module_of(obj.__globals__, by_value)
        if mod is not None:
            pickler.globals_ref.setdefault(id(obj.__globals__), _Namespace(mod.__name__))
    return NotImplemented
