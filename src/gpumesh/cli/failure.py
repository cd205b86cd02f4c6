"""How a ``gpumesh`` command ends with an error: one ``Error:`` line on stderr, the form
click uses for its own usage errors, and an exit code (1: it failed, 2: a usage error).

It imports nothing of gpumesh: a command whose settings do not parse (the import of
:mod:`gpumesh.limits` failed) reports that through it too."""

from __future__ import annotations

import sys
from typing import NoReturn

import click

PREFIX = "Error: "


def fail(message: str, code: int = 1) -> NoReturn:
    """Print ``Error: message`` to stderr and exit with ``code`` (no traceback)."""
    click.echo(f"{PREFIX}{message}", err=True)
    sys.exit(code)
