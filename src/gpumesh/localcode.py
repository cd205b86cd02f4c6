"""The caller's own code travels with its functions, by value.

A function defined in ``__main__`` is shipped by value by cloudpickle, but whatever it uses
from another module (``from helper import preprocess`` in a script next to ``helper.py``)
would be pickled *by reference*: the worker would import ``helper`` and, lacking it, fail
with ``ModuleNotFoundError``. :func:`ship` registers the caller's own modules with
``cloudpickle.register_pickle_by_value`` right before a job is pickled, so their functions
and classes travel with the job.

A top-level module (or package) loaded in ``sys.modules`` is the caller's own code
(:func:`is_local`) when its file is Python source (a ``.py`` file, or a package whose
``__init__`` is one) that lies outside the standard library, outside every site-packages or
dist-packages directory and outside the interpreter's prefixes, and no installed
distribution provides its top-level name (an editable install, ``pip install -e .``, stays
by reference: workers can install it and ``gpumesh doctor`` compares it). ``gpumesh``,
``__main__`` and names starting with ``_`` never are. Registering the top-level name covers
its submodules (cloudpickle checks a module's parents).

The look sits on every call's path: modules are classified once per name, and only when
``len(sys.modules)`` changed since the last look. ``GPUMESH_SHIP_LOCAL=0`` turns it off (and
unregisters what it registered); inside a task (``GPUMESH_IN_TASK``) it does nothing.

Code shipped by value carries bytecode, so :attr:`gpumesh.wire.Payload.by_value` is set and
the job goes only to workers of the caller's Python minor version. An ``import helper``
*inside* a function's body runs on the worker, by name, and still needs ``helper`` there.
"""

from __future__ import annotations

import os
import site
import sys
import sysconfig
from types import ModuleType

from . import limits

#: Top-level name -> whether it is the caller's own code (each name classified once).
_seen: dict[str, bool] = {}
#: The names this process registered with cloudpickle (so that turning it off unregisters them).
_registered: set[str] = set()
#: ``len(sys.modules)`` at the last look (-1: never looked).
_last_len = -1
_prefixes: tuple[str, ...] | None = None
_providers: dict[str, list[str]] | None = None

_NEVER = frozenset({"gpumesh", "__main__", "__mp_main__"})
_SITE_DIRS = ("site-packages", "dist-packages")


def _norm(path: str) -> str:
    return os.path.normcase(os.path.realpath(path))


def _not_local_prefixes() -> tuple[str, ...]:
    """Directories (normalised, with a trailing separator) whose files are never local."""
    global _prefixes
    if _prefixes is None:
        dirs = {sys.prefix, sys.base_prefix, sys.exec_prefix, getattr(sys, "base_exec_prefix", "")}
        paths = sysconfig.get_paths()
        dirs.update(paths.get(k, "") for k in ("stdlib", "platstdlib", "purelib", "platlib"))
        try:
            dirs.update(site.getsitepackages())
        except AttributeError:  # (some virtualenvs' site module lacks it)
            pass
        try:
            dirs.add(site.getusersitepackages())
        except AttributeError:
            pass
        # (a prefix that is the file system's root would hold every file: left out)
        _prefixes = tuple(sorted({os.path.join(_norm(d), "") for d in dirs
                                  if d and os.path.dirname(_norm(d)) != _norm(d)}))
    return _prefixes


def _source_file(module: ModuleType) -> str | None:
    """The module's ``.py`` file (a package's ``__init__.py``), None when it has none
    (built in, an extension, a namespace package, only bytecode)."""
    file = getattr(module, "__file__", None)
    if not isinstance(file, str) or not file.endswith(".py"):
        return None
    return file


def _provided(name: str) -> bool:
    """Whether an installed distribution provides the top-level module ``name``."""
    global _providers
    if _providers is None:
        from .packages import _providers as providers
        try:
            _providers = providers()
        except Exception:  # noqa: BLE001 - unreadable metadata: treat nothing as provided
            _providers = {}
    return name in _providers


def is_local(name: str, module: ModuleType | None) -> bool:
    """Whether the top-level module ``name`` (loaded as ``module``) is the caller's own
    code (see the module docstring)."""
    if not name or "." in name or name.startswith("_") or name in _NEVER or module is None:
        return False
    file = _source_file(module)
    if file is None:
        return False
    path = _norm(file)
    if any(part in _SITE_DIRS for part in path.split(os.sep)):
        return False
    if path.startswith(_not_local_prefixes()):
        return False
    return not _provided(name)


def local_modules() -> list[str]:
    """The top-level names in ``sys.modules`` that are the caller's own code (classifying
    the names not seen before)."""
    modules = sys.modules
    for name in list(modules):
        if "." in name or name in _seen:
            continue
        _seen[name] = is_local(name, modules.get(name))
    return sorted(n for n, local in _seen.items() if local and n in modules)


def ship() -> None:
    """Register the caller's own modules with ``cloudpickle.register_pickle_by_value``
    (see the module docstring). Called by the pipeline before a job is pickled; cheap when
    no module was imported since the last call."""
    global _last_len
    if not limits.setting("GPUMESH_SHIP_LOCAL"):
        if _registered:
            _unregister_all()
        return
    n = len(sys.modules)
    if n == _last_len:
        return
    if os.environ.get("GPUMESH_IN_TASK"):  # a worker's task: its modules are not a caller's
        return
    _last_len = n
    names = [name for name in local_modules() if name not in _registered]
    if not names:
        return
    import cloudpickle
    already = cloudpickle.cloudpickle._PICKLE_BY_VALUE_MODULES  # (registered by the user: theirs)
    for name in names:
        module = sys.modules.get(name)
        if module is None or name in already:
            continue
        cloudpickle.register_pickle_by_value(module)
        _registered.add(name)


def _unregister_all() -> None:
    global _last_len
    import cloudpickle
    for name in sorted(_registered):
        try:
            cloudpickle.unregister_pickle_by_value(ModuleType(name))  # (only its name is read)
        except ValueError:  # unregistered by the user meanwhile
            pass
    _registered.clear()
    _last_len = -1


def reset() -> None:
    """Forget every classification and unregister what was registered (tests)."""
    global _prefixes, _providers
    _unregister_all()
    _seen.clear()
    _prefixes = None
    _providers = None
