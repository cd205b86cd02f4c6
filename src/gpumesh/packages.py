"""Which Python distributions a worker has, as it reports them to the coordinator.

A worker sends ``{"python": "3.11.7", "packages": {"numpy": "1.26.4", ...}}`` when it
registers, and ``packages`` again in a heartbeat when they changed (something was
installed or removed while it ran; checked every :data:`RESCAN_S`). Names are normalised
as PEP 503 does (lower case, runs of ``-_.`` made one ``-``), so ``scikit_learn`` and
``Scikit-Learn`` are one name.

The coordinator keeps them with the worker (``GET /v1/workers``, ``gpumesh doctor``).
Routing does not guess from them which module a distribution provides (``sklearn`` is
``scikit-learn``, and many are not so easy): a task whose function fails with
``ModuleNotFoundError`` on a worker is retried on the others instead (see
:meth:`gpumesh.coordinator.core.Coordinator.post_result`).
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Mapping
from types import TracebackType

# What a worker reports and what the coordinator and the caller accept are the same
# limits, so they live in limits.py.
from .limits import (MAX_NAME_CHARS, MAX_PACKAGES, MAX_REQUIREMENT_CHARS, MAX_REQUIREMENTS,
                     MAX_VERSION_CHARS)

#: What a task's final ModuleNotFoundError advises when workers lack a module (the
#: coordinator writes it; the caller takes it out where the module is the caller's own
#: code, which an install is not the answer for: :func:`gpumesh.client.calls.failure`).
INSTALL_ADVICE = "install it there (or join a worker that has it) and call again"

#: Seconds between two looks at what is installed (each look reads the metadata of every
#: installed distribution; docs/performance.md has its cost).
RESCAN_S = 60.0

_NORMALISE = re.compile(r"[-_.]+")


def normalise(name: str) -> str:
    """PEP 503 form of a distribution name: ``Scikit_Learn`` -> ``scikit-learn``."""
    return _NORMALISE.sub("-", name).lower()


def installed() -> dict[str, str]:
    """``{normalised name: version}`` of every distribution this interpreter can import
    (the first one found on ``sys.path`` wins, as for imports)."""
    from importlib import metadata
    out: dict[str, str] = {}
    for dist in metadata.distributions():
        try:
            name = dist.metadata["Name"]
        except (KeyError, ValueError):
            continue
        if not name:
            continue
        out.setdefault(normalise(name)[:MAX_NAME_CHARS], str(dist.version or "")[:MAX_VERSION_CHARS])
    return dict(sorted(out.items())[:MAX_PACKAGES])


def module_distribution(top: str) -> tuple[str, str] | None:
    """``(distribution name, version)`` of the installed distribution that provides the
    top-level module ``top`` (``sklearn`` -> ``("scikit-learn", "1.4.2")``), or None
    when none does (a module of the user's own, a stdlib one). Never raises."""
    from importlib import metadata
    try:  # the common case, name == module (numpy, pandas): one metadata read
        return top, metadata.version(top)
    except Exception:  # noqa: BLE001 - PackageNotFoundError, or broken metadata
        pass
    try:  # (reads every distribution's file list: slow, but only on a failure)
        names = _providers().get(top) or []
    except Exception:  # noqa: BLE001
        names = []
    for name in names:
        try:
            return name, metadata.version(name)
        except Exception:  # noqa: BLE001
            continue
    return None


class Inventory:
    """What is installed, looked at again at most every ``rescan_s`` seconds."""

    def __init__(self, rescan_s: float = RESCAN_S, clock=time.monotonic):
        self.rescan_s, self.clock = rescan_s, clock
        self.current = installed()
        self._looked = clock()

    def changed(self) -> dict[str, str] | None:
        """The new set if it changed since the last look (and a look is due), else None."""
        if self.clock() - self._looked < self.rescan_s:
            return None
        self._looked = self.clock()
        now = installed()
        if now == self.current:
            return None
        self.current = now
        return now


#: Top-level modules whose frames say nothing about which package failed: the loading
#: machinery itself (pickle, cloudpickle, importlib, gpumesh) and the user's script.
MACHINERY = frozenset({"gpumesh", "cloudpickle", "pickle", "_pickle", "copyreg",
                       "importlib", "_frozen_importlib", "_frozen_importlib_external",
                       "__main__", "builtins"})


def traceback_packages(tb: TracebackType | None, limit: int = 5) -> dict[str, str]:
    """``{distribution: version}`` of the installed third-party packages whose code is in
    the frames of ``tb``, in order of first appearance, at most ``limit``: the standard
    library, the loading machinery (:data:`MACHINERY`) and modules that no distribution
    provides are left out. Says which versions to compare when a pickle made on one
    machine fails to load on another. Only for failures: it reads package metadata."""
    stdlib: frozenset[str] = getattr(sys, "stdlib_module_names", frozenset())
    seen: set[str] = set()
    out: dict[str, str] = {}
    while tb is not None and len(out) < limit:
        name = tb.tb_frame.f_globals.get("__name__")
        tb = tb.tb_next
        top = name.partition(".")[0] if isinstance(name, str) else ""
        if not top or top in seen or top in stdlib or top in MACHINERY:
            continue
        seen.add(top)
        found = module_distribution(top)
        if found is not None:
            out.setdefault(found[0], found[1])
    return out


def _providers() -> dict[str, list[str]]:
    """``{top-level module: [distribution names]}`` of what is installed: as
    ``importlib.metadata.packages_distributions`` on 3.11+, which also reads a wheel's file
    list where it has no ``top_level.txt`` (3.10's reads only that file, and most wheels
    made today have none)."""
    from importlib import metadata
    out: dict[str, list[str]] = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if not name:
            continue
        tops = (dist.read_text("top_level.txt") or "").split()
        if not tops:
            tops = list(dict.fromkeys(
                f.parts[0].removesuffix(".py") for f in dist.files or ()
                if f.parts and not f.parts[0].endswith((".dist-info", ".egg-info", ".pth"))
                and (len(f.parts) > 1 or f.parts[0].endswith(".py"))))
        for top in tops:
            out.setdefault(top, []).append(name)
    return out


def version_of(module: str) -> str | None:
    """The installed version of the distribution that provides the top-level package of
    ``module`` (``numpy._core.numeric`` -> numpy's), None when none is known."""
    found = module_distribution(module.partition(".")[0])
    return found[1] if found else None


def check(value, field: str = "packages") -> dict[str, str]:
    """A reported package set, validated at the coordinator's boundary (``ValueError``)."""
    if not isinstance(value, dict):
        raise ValueError(f"field {field!r} must be an object of name -> version")
    if len(value) > MAX_PACKAGES:
        raise ValueError(f"field {field!r} lists more than {MAX_PACKAGES} packages")
    out = {}
    for name, version in value.items():
        if not isinstance(version, str) or not name or len(name) > MAX_NAME_CHARS \
                or len(version) > MAX_VERSION_CHARS:
            raise ValueError(f"field {field!r}: each entry must be a name of at most "
                             f"{MAX_NAME_CHARS} characters and a version string of at most "
                             f"{MAX_VERSION_CHARS}")
        out[normalise(name)] = version
    return out


# ---------------------------------------------------------------- requires= ----------
# MAX_REQUIREMENTS and MAX_REQUIREMENT_CHARS (limits.py) bound one ``requires=``.


def parse_requirements(value, arg: str = "requires") -> tuple[str, ...]:
    """``requires=`` as canonical PEP 508 strings, sorted (so the same set is one key).

    Accepts a list or tuple of strings such as ``"scikit-learn>=1.4"`` or
    ``"xgboost[dask]==2.0.3"``. Environment markers and direct URLs are refused: what is
    installed must be decided by the name and version alone. Raises ``ValueError``
    naming ``arg``."""
    from packaging.requirements import InvalidRequirement, Requirement
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise ValueError(f"{arg} must be a list of requirement strings, e.g. "
                         f"[\"scikit-learn>=1.4\"], got {type(value).__name__}")
    if len(value) > MAX_REQUIREMENTS:
        raise ValueError(f"{arg} lists more than {MAX_REQUIREMENTS} requirements")
    out = set()
    for item in value:
        if not isinstance(item, str) or not item.strip() or len(item) > MAX_REQUIREMENT_CHARS:
            raise ValueError(f"{arg}: {item!r} is not a requirement string (at most "
                             f"{MAX_REQUIREMENT_CHARS} characters)")
        try:
            req = Requirement(item)
        except InvalidRequirement as e:
            raise ValueError(f"{arg}: {item!r} is not a valid requirement ({e})") from None
        if req.marker is not None or req.url:
            raise ValueError(f"{arg}: {item!r} has an environment marker or a URL; give a "
                             "name and version only")
        req.name = normalise(req.name)
        out.add(str(req))
    return tuple(sorted(out))


def unmet(requirements, have: Mapping[str, str]) -> list[str]:
    """The requirements that the distributions ``have`` (as :func:`installed` gives
    them) do not satisfy; extras are not checked, prereleases count."""
    return [r for r in requirements if not _met(r, have)]


def _met(requirement: str, have: Mapping[str, str]) -> bool:
    req = _requirement(requirement)
    version = have.get(normalise(req.name))
    if version is None:
        return False
    if not req.specifier:
        return True
    try:
        return req.specifier.contains(version, prereleases=True)
    except Exception:  # noqa: BLE001 - an unparsable installed version meets nothing
        return False


_PARSED: dict = {}


def _requirement(text: str):
    req = _PARSED.get(text)
    if req is None:
        from packaging.requirements import Requirement
        req = _PARSED[text] = Requirement(text)
        if len(_PARSED) > 4096:
            _PARSED.clear()
    return req
