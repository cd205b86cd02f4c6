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

A module's namespace may hold values no pickler can carry (``_lock = threading.Lock()``)
that the task never touches. Pickling the module object then fails; only then (the
normal path pickles each value once) :func:`gpumesh.wire.dumps` pickles again inside a
:class:`LeaveBehind`, which tries each value of such a module on its own and leaves
behind those that fail: in the rebuilt module, reading one raises an ``AttributeError``
that says it stayed on the caller and why (a PEP 562 ``__getattr__``, :class:`_LeftBehind`,
in front of the module's own ``__getattr__`` if it has one).
"""

from __future__ import annotations

import builtins
import os
import sys
import types
from collections import OrderedDict
from collections.abc import Callable
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


#: The key, in a module's pickled state, of the names left behind ({name: why}).
_LEFT = "__gpumesh_left__"
#: Longest reason a left-behind name's error quotes (characters).
_WHY_CHARS = 300


class _LeftBehind:
    """A rebuilt module's ``__getattr__`` (PEP 562: asked only for names the module
    lacks): a name whose value stayed on the caller (``left``: name -> why) raises an
    ``AttributeError`` that says so, instead of a bare "has no attribute" that sends the
    reader looking for a typo; other names go to the module's ``own`` ``__getattr__``,
    when it has one."""

    def __init__(self, module: str, left: dict[str, str], own: Callable[[str], Any] | None):
        self.module, self.left, self.own = module, left, own

    def __call__(self, name: str) -> Any:
        why = self.left.get(name)
        if why is not None:
            raise AttributeError(
                f"module {self.module!r} has no attribute {name!r} here: it stayed on the "
                f"caller, because its value cannot be pickled ({why}), so it did not travel "
                f"with the function. A task that needs it must make its own (inside the "
                f"function, or lazily in the module), or it must be made picklable", name=name)
        if self.own is not None:
            return self.own(name)
        raise AttributeError(f"module {self.module!r} has no attribute {name!r}", name=name)


def _update(mod: types.ModuleType, state: dict[str, Any]) -> None:
    left = state.pop(_LEFT, None)  # (only a pickling that left names behind sends it)
    d = mod.__dict__
    before = d.get("__getattr__")
    if left:
        # The caller's values of these names cannot travel now: a value an earlier
        # payload brought would be a stale one.
        for name in left:
            d.pop(name, None)
    d.update(state)
    if left or isinstance(before, _LeftBehind):
        # Put (back) in front of the module's own __getattr__, should the state bring
        # one; names left behind by earlier payloads stay known.
        now = d.get("__getattr__")
        own = now.own if isinstance(now, _LeftBehind) else now
        known = before.left if isinstance(before, _LeftBehind) else {}
        d["__getattr__"] = _LeftBehind(mod.__name__, {**known, **(left or {})}, own)


class _Namespace(dict):
    """Stands, in the caller's pickler, for the globals of a module shipped by value:
    it pickles as a reference to :func:`namespace`, with what cloudpickle puts in it
    (the module's ``__name__``, ``__package__``, ``__file__`` and ``__path__``)."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def __reduce__(self):
        return namespace, (TOKEN, self.name, dict(self))


class LeaveBehind:
    """``with LeaveBehind(why_not):`` the modules shipped by value that the caller's
    pickler meets in this context leave behind the names whose values do not pickle
    (``why_not(value)``: None when it pickles, else why not, in words); see the module
    docstring. Only :func:`gpumesh.wire.dumps`'s second try, after a failure, enters it:
    each value is pickled once more, on its own."""

    def __init__(self, why_not: Callable[[Any], str | None]):
        self.why_not = why_not
        #: ids of the modules whose values are being tried: met again inside such a
        #: try, a module is just a reference (its state is decided one level up), else
        #: modules that refer to each other would try each other without end.
        self.trying: set[int] = set()
        #: id -> (the value, kept alive, and its verdict): a value is tried once.
        self._verdicts: dict[int, tuple[Any, str | None]] = {}
        self._reset: list[Token] = []

    def __enter__(self) -> LeaveBehind:
        self._reset.append(_LENIENT.set(self))
        return self

    def __exit__(self, *exc: object) -> None:
        _LENIENT.reset(self._reset.pop())

    def state(self, mod: types.ModuleType) -> dict[str, Any]:
        """``mod``'s namespace as its pickled state, without the values that do not
        pickle; their names and why under :data:`_LEFT`."""
        self.trying.add(id(mod))
        try:
            state: dict[str, Any] = {}
            left: dict[str, str] = {}
            for name, value in list(mod.__dict__.items()):
                if name == "__builtins__":
                    continue
                why = self._why_not(value)
                if why is None:
                    state[name] = value
                else:
                    left[name] = why if len(why) <= _WHY_CHARS else why[:_WHY_CHARS - 3] + "..."
        finally:
            self.trying.discard(id(mod))
        if left:
            state[_LEFT] = left
        return state

    def _why_not(self, value: Any) -> str | None:
        got = self._verdicts.get(id(value))
        if got is not None and got[0] is value:
            return got[1]
        why = self.why_not(value)
        self._verdicts[id(value)] = (value, why)  # (first: functions may read each other)
        if why is not None and type(value) is types.FunctionType:
            # A function fails for a global it reads: name it, or the reader of the
            # function's error would look for the fault in the function itself.
            for name in global_names(value.__code__):
                if name in value.__globals__ and self._why_not(value.__globals__[name]):
                    why = f"it reads the global {name!r}, which cannot be pickled: {why}"
                    self._verdicts[id(value)] = (value, why)
                    break
        return why


def global_names(code: Any) -> list[str]:
    """The names ``code`` and the code nested in it (lambdas, comprehensions) may read as
    globals, in order of first use: what cloudpickle ships of a function's globals."""
    names: dict[str, None] = dict.fromkeys(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names.update(dict.fromkeys(global_names(const)))
    return list(names)


_LENIENT: ContextVar[LeaveBehind | None] = ContextVar("gpumesh_leave_behind", default=None)


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
    shipped by value, a reduction to :func:`module` with its namespace as state (inside
    a :class:`LeaveBehind`, without what does not pickle); for a function of one, its
    globals marked as that module's before cloudpickle reduces it (its ``globals_ref``).
    ``NotImplemented`` otherwise (cloudpickle decides). Sets ``pickler.saw_module`` when
    it reduced a module: a failure may then be one of its values."""
    if isinstance(obj, types.ModuleType):
        if obj.__name__ in sys.modules and sys.modules[obj.__name__] is obj and by_value(obj):
            pickler.saw_module = True
            leave = _LENIENT.get()
            if leave is None:
                state = {k: v for k, v in obj.__dict__.items() if k != "__builtins__"}
            elif id(obj) in leave.trying:
                return module, (TOKEN, obj.__name__)
            else:
                state = leave.state(obj)
            return module, (TOKEN, obj.__name__), state, None, None, _update
        return NotImplemented
    if type(obj) is types.FunctionType:
        mod = shipped_module_of(obj.__globals__, by_value)
        if mod is not None:
            pickler.globals_ref.setdefault(id(obj.__globals__), _Namespace(mod.__name__))
    return NotImplemented
