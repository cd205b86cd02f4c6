"""The ``gpumesh`` command. One module per command group; each calls the public API."""

from __future__ import annotations

import platform

import click

from .._version import __version__


def version_line() -> str:
    """``gpumesh X.Y.Z (3.11.7, Linux)``."""
    return f"gpumesh {__version__} ({platform.python_version()}, {platform.system()})"


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", "-V", message=version_line())
def main() -> None:
    """gpumesh: pool the CPUs and GPUs of a few machines into one compute mesh."""


def _register() -> None:
    from . import jobs, join, pool, serve
    for command in (serve.serve, join.join, pool.workers, pool.devices, jobs.jobs, jobs.status,
                    jobs.cancel, jobs.logs):
        main.add_command(command)


_register()
