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
import time

#: Seconds between two looks at what is installed (a look costs ~10 ms per 100 packages).
RESCAN_S = 60.0
#: Most distributions a worker may report, and the longest name and version kept.
MAX_PACKAGES = 5000
MAX_NAME_CHARS = 200
MAX_VERSION_CHARS = 100

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
