"""Why a call's function or arguments did not load on this worker, in words that point
at the cause: usually the caller and the worker run different versions of a package.

Two cases are told apart here, in the task process, where the failure happened:

* a *version gap*: unpickling (or an import) asked for ``numpy._core.numeric`` and this
  worker's ``numpy`` is installed but has no such submodule (numpy 1.x has
  ``numpy.core``; the caller pickled with 2.x). Python says ``ModuleNotFoundError``, but
  the worker does not lack numpy: it has another version (:func:`version_gap`);
* any other failure while loading: the package's own code raised (pandas 2's
  ``StringDtype.__init__`` given a pandas 3 pickle's arguments). The packages whose
  frames are in the traceback are the ones whose versions to compare
  (:func:`gpumesh.packages.traceback_packages`).

Only called on a failure: the metadata reads (a few ms, more with many packages
installed) are never on a task's path.
"""

from __future__ import annotations

import sys

from .. import packages

def version_gap(exc: BaseException) -> tuple[str, str] | None:
    """``(package, this worker's version)`` when ``exc`` is a ModuleNotFoundError for a
    submodule of a package this worker does have (``numpy._core.numeric`` with numpy
    1.26 installed): not a package this worker lacks, but another version of it than the
    one that wrote the pickle (or the code) asked for. None otherwise, also when the
    package has no distribution to name. Never raises."""
    name = getattr(exc, "name", None)
    if not isinstance(exc, ModuleNotFoundError) or not isinstance(name, str) or "." not in name:
        return None
    top = name.partition(".")[0]
    if not _importable(top):
        return None  # the package itself is missing: a module this worker lacks
    found = packages.module_distribution(top)
    return (found[0], found[1]) if found else None


def _importable(top: str) -> bool:
    if top in sys.modules:
        return True
    import importlib.util
    try:
        return importlib.util.find_spec(top) is not None  # (a top-level name: imports nothing)
    except (ImportError, ValueError):
        return False


def describe(err: dict, exc: BaseException, what: str) -> dict:
    """``err`` (a :func:`gpumesh.worker.runner.describe_exception` of ``exc``, kind
    ``unpickle``) with its message saying that it was raised while loading ``what``
    ("the call's arguments", "the function") on this worker, before the function ran,
    and naming this worker's versions of the packages involved: the package of a
    :func:`version_gap` (``err["package"]`` and ``err["package_version"]``, which
    ``describe_exception`` sets), else those of :func:`gpumesh.packages.traceback_packages`.
    Never raises."""
    gap = (err["package"], err["package_version"]) if "package" in err else None
    try:
        named = [] if gap else list(packages.traceback_packages(exc.__traceback__).items())
    except Exception:  # noqa: BLE001 - the failure itself must still be reported
        named = []
    message = f"{err.get('message', '')} (raised while loading {what} on the worker, before the function ran"
    if gap:
        message += (f"; this worker has {gap[0]} {gap[1]}, which has no {err.get('module')}: the "
                    f"caller's {gap[0]} is likely another version")
    elif named:
        message += ("; this worker has " + ", ".join(f"{n} {v}" for n, v in named)
                    + ": compare with the caller's versions")
    err["message"] = message + ")"
    return err
