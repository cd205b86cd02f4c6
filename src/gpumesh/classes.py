"""A class that arrives by value never rewrites one this process already has.

cloudpickle sends a class it cannot name by reference (one of ``__main__``, a notebook, a
module shipped by value) whole, with an id of the class it came from. Where a class with
that id already exists (the caller's own ``Point``, when a task returns a ``Point``), it
hands that class back, so ``isinstance`` holds, and then *sets the sent attributes on
it*: the caller's methods were replaced by the worker's copies, whose globals are the
task's copy of the module. After one call that returned an instance of a class of
``helper``, ``helper.Point``'s methods read the task's ``helper.THRESHOLD``, and a
change the caller made later was not seen, silently.

:func:`load` unpickles like ``pickle.loads``, except that the state cloudpickle sends for
a class is applied only to a class this load made, never to one that existed before it
(the receiver's own is the truth about its classes). Inside a
:class:`~gpumesh.namespaces.Scope` (the caller's inline backend, which runs a job as a
worker's process would, in the caller's process) such a class is the scope's own copy
instead. Only a stream that rebuilds a class
takes this path (a byte search); anything else goes through ``pickle.loads`` as before.
"""

from __future__ import annotations

import io
import pickle
import re
from collections.abc import Callable
from typing import Any

from . import namespaces

#: What a stream that rebuilds a class by value names (cloudpickle's skeleton makers).
_SKELETON = re.compile(rb"_make_skeleton_(?:class|enum)")
_CLOUDPICKLE = ("cloudpickle.cloudpickle", "cloudpickle.cloudpickle_fast", "cloudpickle")


def load(stream: memoryview, buffers: list[memoryview]) -> Any:
    """``pickle.loads(stream, buffers=buffers)``, keeping this process's classes as they
    are (see the module docstring)."""
    if _SKELETON.search(stream) is None:
        return pickle.loads(stream, buffers=buffers)
    return ClassKeepingUnpickler(io.BytesIO(stream), buffers=buffers).load()


class ClassKeepingUnpickler(pickle.Unpickler):
    """Hands out wrappers of cloudpickle's class makers and class state setter that
    remember which classes this load made (a class of an id not seen before) and apply
    the sent state to those only."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._made: set[int] = set()   # ids of the classes this load made

    def find_class(self, module: str, name: str) -> Any:
        found = super().find_class(module, name)
        if module in _CLOUDPICKLE:
            if name in ("_make_skeleton_class", "_make_skeleton_enum"):
                return self._maker(found)
            if name == "_class_setstate":
                return self._setter(found)
        return found

    def _maker(self, make: Callable[..., type]) -> Callable[..., type]:
        from cloudpickle import cloudpickle as cp

        scope = namespaces.current()

        def make_or_find(*args: Any) -> type:
            tracker_id = args[-2]  # (both makers take class_tracker_id, extra last)
            if scope is not None and tracker_id is not None:
                return self._scoped(scope, make, args, cp)
            known = tracker_id is not None and tracker_id in cp._DYNAMIC_CLASS_TRACKER_BY_ID
            cls = make(*args)
            if not known:
                self._made.add(id(cls))
            return cls
        return make_or_find

    def _scoped(self, scope: namespaces.Scope, make: Callable[..., type], args: tuple,
                cp: Any) -> type:
        """In a :class:`~gpumesh.namespaces.Scope` (the inline backend's job), a class of
        the caller's is rebuilt as the scope's own copy, as a worker's process would
        have it: its methods then read the scope's copy of their module, as the
        functions of that module do. The copy pickles with the caller's class id, so a
        value the task returns loads, outside the scope, as the caller's class."""
        tracker_id = args[-2]
        cls = scope.classes.get(tracker_id)
        if cls is None:
            cls = make(*args[:-2], None, args[-1])  # (untracked: not the caller's class)
            cp._DYNAMIC_CLASS_TRACKER_BY_CLASS[cls] = tracker_id
            scope.classes[tracker_id] = cls
            self._made.add(id(cls))
        return cls

    def _setter(self, setstate: Callable[[type, Any], Any]) -> Callable[[type, Any], Any]:
        def set_if_made(cls: type, state: Any) -> Any:
            if id(cls) in self._made:
                return setstate(cls, state)
            return cls  # this process's own class: left as it is
        return set_if_made
