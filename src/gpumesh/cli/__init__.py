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
    from . import join, pool, serve
    main.add_command(serve.serve)
    main.add_command(join.join)
    main.add_command(pool.workers)


_register()
