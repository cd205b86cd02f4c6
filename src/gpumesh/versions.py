"""What each end runs (gpumesh and Python versions), and the one line when they differ.

Every request of a gpumesh caller or worker says who sent it::

    User-Agent: gpumesh/0.1.0 python/3.11.7

A coordinator that meets another gpumesh version refuses the request (HTTP 409
``version_mismatch``) with :func:`refusal`: both versions and the command that installs
the coordinator's own version from the coordinator (see :mod:`.coordinator.dist`). A
caller or worker also checks the coordinator's version itself (``GET /v1/health`` says
it), so a newer caller meeting an older coordinator gets the same line. Exact versions
must match: the wire format, the routes and the task protocol move together, and a mesh
of friends' machines upgrades by reinstalling from the coordinator in one command.

Python versions matter only for code shipped *by value* (functions, lambdas and classes
defined in ``__main__``, a notebook or a closure): cloudpickle then sends their bytecode,
which is specific to one Python minor version (another minor version may crash on it).
Such a call carries the caller's ``major.minor`` as a requirement (see
:class:`gpumesh.hardware.Requirements`), and only workers of that version take it.

A request from the *other* project that PyPI calls ``gpumesh`` (3.x: ``/api/...`` routes,
``X-Auth-Token``) is answered with the same kind of line, in the shape its workers relay
verbatim (HTTP 426, ``{"error": line}``).

Callers, workers and the coordinator all import it: at import time it needs only the
standard library (the refusal's install command is made by :mod:`.coordinator.dist`,
imported when a refusal is written).
"""

from __future__ import annotations

import platform

from ._version import __version__

PRODUCT = "gpumesh"
#: What this process sends as its User-Agent.
USER_AGENT = f"{PRODUCT}/{__version__} python/{platform.python_version()}"


def python_minor(version: str | None = None) -> str:
    """``"3.11"`` from ``"3.11.7"`` (default: this interpreter's); ``""`` if unreadable."""
    from .hardware import python_minor as minor
    return minor(version or platform.python_version())


def parse_agent(value: str | None) -> tuple[str, str] | None:
    """``(gpumesh version, python version)`` of a gpumesh User-Agent, None for any other."""
    if not value or not value.startswith(PRODUCT + "/"):
        return None
    fields = dict(part.split("/", 1) for part in value.split() if "/" in part)
    return fields.get(PRODUCT, ""), fields.get("python", "")


def refusal(role: str, theirs: str, coordinator: str, base_url: str) -> str:
    """The one line that refuses a ``role`` ("worker", "caller") running gpumesh
    ``theirs`` at a coordinator running ``coordinator``, reached at ``base_url``."""
    from .coordinator.dist import install_command
    return (f"this {role} runs gpumesh {theirs or '(unknown version)'} and the coordinator at "
            f"{base_url} runs gpumesh {coordinator}: install the coordinator's on this machine "
            f"with: {install_command(base_url, coordinator)}")


def check_coordinator(coordinator: str | None, base_url: str, role: str) -> None:
    """Raise :class:`~gpumesh.errors.VersionMismatch` unless the coordinator at
    ``base_url`` (which said it runs gpumesh ``coordinator``) runs this version."""
    if coordinator == __version__:
        return
    from .errors import VersionMismatch
    if not isinstance(coordinator, str) or not coordinator:
        raise VersionMismatch(f"the server at {base_url} does not say which gpumesh it runs: it is "
                              f"not a coordinator of gpumesh {__version__} (this {role}'s version)")
    raise VersionMismatch(refusal(role, __version__, coordinator[:40], base_url))
