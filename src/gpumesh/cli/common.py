"""What several commands share: --url/--token/--fingerprint resolution and one-line errors."""

from __future__ import annotations

import functools
import os
import sys

import click

from .. import config, limits
from ..errors import MeshError
from .failure import fail  # noqa: F401 - every command's one way to end with an error


def one_line_errors(fn):
    """Turn gpumesh and input errors into one line on stderr and exit code 1."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except BrokenPipeError:
            # The reader left (`gpumesh jobs | head -3`): not an error of ours. Point stdout
            # at /dev/null so the interpreter's final flush does not complain either.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            sys.exit(0)
        except (MeshError, ValueError, OSError) as e:
            fail(str(e))
    return wrapper


def _token(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A ``--token`` no coordinator can have issued (under ``MIN_TOKEN_CHARS``: ``serve``
    refuses such a token, and generated ones are longer) is a usage error, before any
    request (which would only come back 401)."""
    if value is not None and len(value.strip()) < limits.MIN_TOKEN_CHARS:
        raise click.BadParameter(f"the token is {len(value.strip())} characters; a coordinator's "
                                 f"tokens have at least {limits.MIN_TOKEN_CHARS}")
    return value


def _fingerprint(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A ``--fingerprint`` that is not ``SHA256:`` and 64 hex digits is a usage error (one
    line, exit 2), before anything else is checked; a good one is normalised."""
    if value is None:
        return None
    from ..tls import normalise_fingerprint
    try:
        return normalise_fingerprint(value)
    except ValueError as e:
        fail(f"--fingerprint: {e}", code=2)


def fingerprint_option(fn):
    """``--fingerprint SHA256:HEX``: the coordinator's TLS certificate pin, for every
    command that talks to a coordinator (``join`` and those of :func:`endpoint_options`)."""
    return click.option("--fingerprint", default=None, metavar="SHA256:HEX", callback=_fingerprint,
                        help="Pin the coordinator's TLS certificate (what `gpumesh serve --tls` "
                             "printed) [default: $GPUMESH_FINGERPRINT, else the saved config].")(fn)


def endpoint_options(fn):
    """``--url``, ``--token`` and ``--fingerprint``, defaulting to $GPUMESH_URL /
    $GPUMESH_TOKEN / $GPUMESH_FINGERPRINT, then the saved config."""
    fn = fingerprint_option(fn)
    fn = click.option("--token", metavar="TOKEN", default=None, callback=_token,
                      help="Coordinator token [default: $GPUMESH_TOKEN, else saved config].")(fn)
    fn = click.option("--url", metavar="URL", default=None,
                      help="Coordinator URL [default: $GPUMESH_URL, else saved config].")(fn)
    return fn


def _job_id(ctx: click.Context, param: click.Parameter, value: str) -> str:
    from ..client.paths import check_job_id
    try:  # lowercased: an id typed in capitals is the same job
        return check_job_id(value)
    except ValueError as e:  # not the shape of a job id: a bad argument, before any request
        raise click.BadParameter(str(e)) from None


def _task_id(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    from ..client.paths import check_id
    try:
        return None if value is None else check_id(value, "task id", "`gpumesh status JOB`")
    except ValueError as e:  # as a bad JOB_ID: a usage error, before any request
        raise click.BadParameter(str(e)) from None


def _before(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    from ..client.paths import check_job_id
    try:
        return None if value is None else check_job_id(value)
    except ValueError as e:  # as a bad JOB_ID: a usage error, before any request
        raise click.BadParameter(str(e)) from None


def before_option(fn):
    """``--before JOB_ID`` of ``gpumesh jobs``; not the shape of a job id: a usage error."""
    return click.option("--before", metavar="JOB_ID", callback=_before,
                        help="Only jobs older than this one: the next page after a listing "
                             "whose last job it is [default: from the newest].")(fn)


def job_id_argument(fn):
    """The ``JOB_ID`` argument; one that cannot be a job id is a usage error (exit 2)."""
    return click.argument("job_id", callback=_job_id)(fn)


def task_id_option(fn):
    """``--task TASK_ID``; one that cannot be a task id is a usage error (exit 2)."""
    return click.option("--task", "task_id", default=None, metavar="TASK_ID", callback=_task_id,
                        help="Only this task's output [default: every task].")(fn)


def given_url(url: str | None, what: str | None = "--url") -> str | None:
    """The coordinator URL the user gave, checked at the boundary: ``url`` (from the
    command line: the flag ``what``, None for an argument), else ``$GPUMESH_URL``; None
    when neither is set (the saved config decides). Normalised (see
    :func:`gpumesh.config.normalise_url`). One that is not ``http(s)://HOST[:PORT]`` is a
    usage error: one line, naming the flag or variable it came from, exit 2."""
    if url is None:
        url, what = limits.setting("GPUMESH_URL"), "GPUMESH_URL"
        if url is None:
            return None
    try:
        return config.normalise_url(url)
    except ValueError as e:
        fail(f"{what}: {e}" if what else str(e), code=2)


def resolve_endpoint(url: str | None, token: str | None,
                     fingerprint: str | None = None) -> config.Endpoint:
    """The coordinator to talk to; its token is then hidden from ``ps`` (see secrecy).
    ``fingerprint`` (``--fingerprint``, checked by its option) pins a certificate, so with
    a URL that is not ``https://`` it is a usage error, as for ``join``."""
    from .secrecy import hide
    ep = config.resolve(given_url(url), token, fingerprint)
    hide(ep.token)
    if fingerprint is not None and not ep.url.startswith("https://"):
        fail(f"--fingerprint pins a TLS certificate, but {ep.url} is not an https:// URL", code=2)
    return ep
