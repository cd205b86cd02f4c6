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
dist-packages directory, outside the interpreter's prefixes and outside every project
installed in editable mode (``pip install -e .`` stays by reference: workers can install it
and ``gpumesh doctor`` compares it), and no distribution installed into its own directory
provides its top-level name. ``gpumesh``,
``__main__`` and names starting with ``_`` never are. Registering the top-level name covers
its submodules (cloudpickle checks a module's parents).

The look sits on every call's path: modules are classified once per name, and only when
``len(sys.modules)`` changed since the last look. ``GPUMESH_SHIP_LOCAL=0`` turns it off (and
unregisters what it registered); inside a task (``GPUMESH_IN_TASK``) it does nothing.

Code shipped by value carries bytecode, so :attr:`gpumesh.wire.Payload.by_value` is set and
the job goes only to workers of the caller's Python minor version. An ``import helper``
*inside* a function's body runs on the worker, by name, and still needs ``helper`` there
(the caller's ModuleNotFoundError then says to import it at module level, also when the
caller never imported it but would load it from its own code: :func:`would_be_local`,
:func:`gpumesh.client.calls.failure`).
"""

from __future__ import annotations

import json
import os
import site
import sys
import sysconfig
from pathlib import Path
from types import ModuleType
from urllib.parse import urlsplit
from urllib.request import url2pathname

from . import limits

#: Top-level name -> whether it is the caller's own code (each name classified once).
_seen: dict[str, bool] = {}
#: The names this process registered with cloudpickle (so that turning it off unregisters them).
_registered: set[str] = set()
#: ``len(sys.modules)`` at the last look (-1: never looked).
_last_len = -1
_prefixes: tuple[str, ...] | None = None
_roots: tuple[str, ...] | None = None
#: Directory -> the top-level names distributions installed into it provide.
_beside: dict[str, frozenset[str]] = {}

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


def _editable_roots() -> tuple[str, ...]:
    """Directories (normalised, with a trailing separator) of the projects installed in
    editable mode (``pip install -e``): their modules are installed, so they stay by
    reference. Read from each distribution's ``direct_url.json`` (PEP 610) and from
    setuptools' older ``*.egg-link`` files; a few ms, once per process."""
    global _roots
    if _roots is None:
        found: set[str] = set()
        for d in _not_local_prefixes():  # (where installers put their records)
            try:
                entries = list(os.scandir(d))
            except OSError:
                continue
            for e in entries:
                if e.name.endswith(".egg-link"):  # setuptools' old develop: the path first
                    found.add(_first_line(e.path))
                elif e.name.endswith(".dist-info"):  # only direct installs have the file
                    found.add(_editable_dir(os.path.join(e.path, "direct_url.json")))
        _roots = tuple(sorted(os.path.join(_norm(r), "") for r in found if r))
    return _roots


def _first_line(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.readline().strip()
    except OSError:
        return ""


def _editable_dir(direct_url: str) -> str:
    """The project directory a PEP 610 ``direct_url.json`` names for an editable install,
    ``""`` for anything else (no such file, another kind of install)."""
    try:
        with open(direct_url, encoding="utf-8") as fh:
            direct = json.load(fh)
    except (OSError, ValueError):
        return ""
    url = direct.get("url") if isinstance(direct, dict) else None
    if not (isinstance(url, str) and url.startswith("file:")
            and isinstance(direct.get("dir_info"), dict) and direct["dir_info"].get("editable")):
        return ""
    return url2pathname(urlsplit(url).path)


def _installed_beside(directory: str) -> frozenset[str]:
    """The top-level names that distributions installed into ``directory`` itself provide
    (``pip install --target DIR``, or a ``*.dist-info`` put on a path by hand): their
    ``top_level.txt``, else the first part of each file they list. Cached per directory."""
    names = _beside.get(directory)
    if names is None:
        from importlib import metadata
        found: set[str] = set()
        try:
            infos = [e.path for e in os.scandir(directory)
                     if e.name.endswith((".dist-info", ".egg-info")) and e.is_dir()]
        except OSError:
            infos = []
        for info in infos:
            dist = metadata.PathDistribution(Path(info))
            try:
                tops = (dist.read_text("top_level.txt") or "").split()
                if not tops:
                    tops = [f.parts[0].removesuffix(".py") for f in dist.files or () if f.parts]
                name = dist.metadata["Name"]
            except Exception:  # noqa: BLE001 - broken metadata: it provides nothing
                continue
            found.update(tops)
            if name:
                found.add(name)
        names = _beside[directory] = frozenset(found)
    return names


def is_local(name: str, module: ModuleType | None) -> bool:
    """Whether the top-level module ``name`` (loaded as ``module``) is the caller's own
    code (see the module docstring)."""
    return module is not None and _is_local_file(name, _source_file(module))


def would_be_local(name: str) -> bool:
    """Whether the module ``name`` (its top-level one), imported here, would be the
    caller's own code: the file this process would load it from, as
    ``importlib.util.find_spec`` finds it (nothing is imported), passes :func:`is_local`'s
    rules. For the error of a task whose body imports such a module that the worker
    lacks (:func:`gpumesh.client.calls.failure`), when the caller never imported it."""
    import importlib.util
    top = name.partition(".")[0]
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):  # (ValueError: a module in sys.modules without a spec)
        return False
    origin = spec.origin if spec is not None and spec.has_location else None
    return _is_local_file(top, origin if isinstance(origin, str) and origin.endswith(".py") else None)


def _is_local_file(name: str, file: str | None) -> bool:
    """:func:`is_local` for a module ``name`` loaded from ``file`` (its ``.py`` source,
    None when it has none)."""
    if not name or "." in name or name.startswith("_") or name in _NEVER or file is None:
        return False
    path = _norm(file)
    if any(part in _SITE_DIRS for part in path.split(os.sep)):
        return False
    if path.startswith(_not_local_prefixes()) or path.startswith(_editable_roots()):
        return False
    # The directory on sys.path that holds it (a package's parent, a module's own).
    holder = os.path.dirname(os.path.dirname(path) if path.endswith("__init__.py") else path)
    return name not in _installed_beside(holder)


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
    global _prefixes, _roots
    _unregister_all()
    _seen.clear()
    _beside.clear()
    _prefixes = None
    _roots = None
