"""Logging for the ``gpumesh`` command: ``-v/--verbose`` and ``--log-json``.

Everything gpumesh logs goes through the ``logging`` module under the ``gpumesh`` logger.
:func:`configure` (called once by the CLI) sets the level (WARNING by default, INFO with
``-v``, DEBUG with ``-vv``) and the format: plain ``level name: message`` lines, or one
JSON object per line with ``--log-json`` (or ``$GPUMESH_LOG_JSON=1``), on stderr.
"""

from __future__ import annotations

import json
import logging
import sys
import time

_state = {"json": False, "level": logging.WARNING}


class JSONFormatter(logging.Formatter):
    """One JSON object per record: ``ts`` (epoch s), ``level``, ``logger``, ``message``
    (and ``exc`` with the traceback when there is one)."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": round(record.created, 3),
               "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + "Z",
               "level": record.levelname.lower(), "logger": record.name,
               "message": record.getMessage()}
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def level_for(verbose: int) -> int:
    return logging.WARNING if verbose <= 0 else logging.INFO if verbose == 1 else logging.DEBUG


def configure(verbose: int = 0, as_json: bool = False, stream=None) -> logging.Handler:
    """Set up the ``gpumesh`` logger; returns its handler. Idempotent (replaces the
    handler it added before)."""
    _state.update(json=as_json, level=level_for(verbose))
    logger = logging.getLogger("gpumesh")
    for h in list(logger.handlers):
        if getattr(h, "_gpumesh_cli", False):
            logger.removeHandler(h)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler._gpumesh_cli = True  # type: ignore[attr-defined]
    handler.setFormatter(formatter() or logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(_state["level"])
    return handler


def json_enabled() -> bool:
    return bool(_state["json"])


def formatter() -> logging.Formatter | None:
    """The JSON formatter when ``--log-json`` is on, else None (keep your own format)."""
    return JSONFormatter() if _state["json"] else None


def level() -> int:
    """The level chosen with ``-v`` (WARNING when not given)."""
    return int(_state["level"])
