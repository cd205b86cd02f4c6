"""The coordinator's URL paths that the client builds from what a user typed."""

from __future__ import annotations

import re

from .. import protocol

#: What a job or task id looks like (the coordinator checks the same): hex digits. What a
#: user types may be in capitals (``9FB8419827B0``): :func:`check_id` lowercases it.
ID = re.compile(r"[0-9a-fA-F]{4,64}")

#: The job routes by the action a path ends in ("": the job itself).
_JOB_ROUTES = {"": protocol.JOB, "results": protocol.JOB_RESULTS, "logs": protocol.JOB_LOGS,
               "release": protocol.JOB_RELEASE, "cancel": protocol.JOB_CANCEL,
               "retry": protocol.JOB_RETRY}


def job_path(job_id: str, action: str = "") -> str:
    """``/v1/jobs/<job_id>[/<action>]`` (``action``: results, logs, release, cancel or
    retry). Raises ``ValueError`` for a string that is not a job id (empty, ``../x``...),
    so that it never becomes part of a URL, and for an action the coordinator has no
    route for."""
    job_id = check_job_id(job_id)
    if action not in _JOB_ROUTES:
        raise ValueError(f"no job route ends in {action!r}")
    return protocol.fill(_JOB_ROUTES[action], jid=job_id)


def check_id(value: str, what: str, where: str) -> str:
    """``value`` in lower case (as the coordinator spells ids) if it has the shape of an
    id (``what``: "job id", "task id"), in either case; otherwise a ``ValueError`` naming
    ``where`` such ids are listed, before it reaches any URL."""
    if not isinstance(value, str) or not ID.fullmatch(value):
        raise ValueError(f"{str(value)[:80]!r} is not a {what} (ids are hex digits, "
                         f"as {where} lists them)")
    return value.lower()


def check_job_id(value: str) -> str:
    """:func:`check_id` for a job id: ``value`` lowercased, or ``ValueError``."""
    return check_id(value, "job id", "`gpumesh jobs`")
