"""The coordinator's URL paths that the client builds from what a user typed."""

from __future__ import annotations

import re

#: What a job id looks like (the coordinator checks the same): hex digits.
JOB_ID = re.compile(r"[0-9a-f]{4,64}")


def job_path(job_id: str, action: str = "") -> str:
    """``/v1/jobs/<job_id>[/<action>]``. Raises ``ValueError`` for a string that is not a
    job id (empty, ``../x``...), so that it never becomes part of a URL."""
    if not isinstance(job_id, str) or not JOB_ID.fullmatch(job_id):
        raise ValueError(f"{str(job_id)[:80]!r} is not a job id (ids are hex digits, "
                         "as `gpumesh jobs` lists them)")
    return f"/v1/jobs/{job_id}/{action}" if action else f"/v1/jobs/{job_id}"
