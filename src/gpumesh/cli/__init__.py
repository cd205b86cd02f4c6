"""The ``gpumesh`` command. One module per command group; each calls the public API."""

from __future__ import annotations

import os
import platform
import sys
from typing import Any

import click

from .._version import __version__


def version_line() -> str:
    """``gpumesh X.Y.Z (3.11.7, Linux)``."""
    return f"gpumesh {__version__} ({platform.python_version()}, {platform.system()})"


class _Main(click.Group):
    """The ``gpumesh`` group: a usage error (a bad flag or argument) is one line on stderr,
    ``Error: ...``, exit code 2, as every other error of the command is one line; click's
    own adds the usage and a pointer to ``--help`` above it."""

    def main(self, *args: Any, **kwargs: Any) -> Any:
        if not kwargs.pop("standalone_mode", True):
            return super().main(*args, standalone_mode=False, **kwargs)  # type: ignore[call-overload]
        try:
            rv = super().main(*args, standalone_mode=False, **kwargs)  # type: ignore[call-overload]
        except click.UsageError as e:
            if type(e).__name__ == "NoArgsIsHelpError":  # (no command: the help, as click says it)
                e.show()
            else:
                click.echo(f"Error: {e.format_message()}", err=True)
            sys.exit(e.exit_code)
        except click.ClickException as e:
            e.show()
            sys.exit(e.exit_code)
        except click.Abort:
            click.echo("Aborted!", err=True)
            sys.exit(1)
        # (what click's own standalone mode does: an int is ctx.exit's code, else 0)
        sys.exit(rv if isinstance(rv, int) else 0)


@click.group(cls=_Main, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", "-V", message=version_line())
@click.option("-v", "--verbose", count=True,
              help="More log output: -v for info, -vv for debug [default: warnings only].")
@click.option("--log-json", is_flag=True, envvar="GPUMESH_LOG_JSON",
              help="Write log records as JSON lines on stderr [default: off; env GPUMESH_LOG_JSON=1].")
@click.option("--no-color", is_flag=True,
              help="No colours in the output [default: colours on a terminal; env NO_COLOR].")
def main(verbose: int, log_json: bool, no_color: bool) -> None:
    """gpumesh: pool the CPUs and GPUs of a few machines into one compute mesh.

    Exit codes: 0 success, 1 failure (an error, a failed task, an unknown job),
    2 usage error (a bad flag or argument). Each command's flags: gpumesh COMMAND
    --help. The full reference (every command, flag and environment variable) is
    docs/cli.md in the gpumesh source tree and its sdist (not in the installed wheel).
    """
    from .. import logs
    from ..winplat import safe_streams
    safe_streams()  # a cp1252 console must not crash on a hostname or a ✓
    if no_color:
        os.environ["NO_COLOR"] = "1"  # rich and our own output honour it
    logs.configure(verbose, log_json)


def _settings_or_exit() -> None:
    """The ``GPUMESH_*`` settings are read when :mod:`gpumesh.limits` is imported: a bad
    one is the command's usage error (one line naming the variable, exit 2), not a
    traceback from whichever module imported it first."""
    try:
        from .. import limits  # noqa: F401 - reading the settings table is the point
    except ValueError as e:
        # limits.SettingError, reached through its instance: the module did not finish
        # importing, so there is no module to take the class from
        if (type(e).__module__, type(e).__name__) != ("gpumesh.limits", "SettingError"):
            raise
        from .failure import fail
        fail(str(e), code=2)


def _register() -> None:
    from . import doctor, jobs, join, owner, pool, radar, serve, setup, submit, tokens
    for command in (serve.serve, join.join, pool.workers, pool.devices, submit.submit, jobs.jobs,
                    jobs.status, jobs.cancel, submit.retry, jobs.logs, doctor.doctor, radar.radar,
                    setup.setup, owner.pause, owner.resume, tokens.token):
        main.add_command(command)


_settings_or_exit()
_register()
