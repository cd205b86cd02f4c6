"""Strict results: values that travel as JSON, so a caller never unpickles worker bytes.

With ``GPUMesh(..., strict=True)`` or ``GPUMESH_STRICT_RESULTS=1`` the caller asks for
``result_format: "json"``: the task process encodes its return value with
:func:`encode` and the caller decodes it with :func:`decode` (``json.loads``, nothing
else). A worker cannot make a strict caller run code by sending a crafted pickle:
anything that is not JSON is refused at the caller.

Only values that come back *exactly* as they were returned are accepted: ``dict``
with ``str`` keys, ``list``, ``str``, ``int``, ``float`` (NaN and infinities included, as
Python's json writes them), ``bool`` and ``None`` — the types themselves, not
subclasses. A tuple, a NumPy scalar, a set or a dict with int keys would change on the
way, so they are refused with an error naming the type and where it sits. (A call that
runs locally because the mesh is down returns its value as it is: nothing crossed a
trust boundary.)
"""

from __future__ import annotations

import json
from typing import Any

#: Deepest nesting accepted (JSON decoders recurse).
MAX_DEPTH = 200

_SCALARS = (str, int, float, bool, type(None))


class NotJSON(ValueError):
    """A value that cannot travel as JSON unchanged; the message names its type and path."""


def _check(value: Any, path: str, depth: int) -> None:
    t = type(value)
    if t in _SCALARS:
        return
    if depth > MAX_DEPTH:
        raise NotJSON(f"the result is nested deeper than {MAX_DEPTH} levels (at {path})")
    if t is list:
        for i, v in enumerate(value):
            _check(v, f"{path}[{i}]", depth + 1)
        return
    if t is dict:
        for k, v in value.items():
            if type(k) is not str:
                raise NotJSON(f"strict results: {path} has a key of type {_name(type(k))} ({k!r:.40}); "
                              "JSON object keys are strings")
            _check(v, f"{path}[{k!r:.40}]", depth + 1)
        return
    hint = " (return a list)" if t is tuple else ""
    if t.__module__ == "numpy":
        hint = " (convert it with .item() or .tolist())"
    raise NotJSON(f"strict results: {path} is a {_name(t)}, which is not JSON-representable{hint}; "
                  "strict callers accept only dict (str keys), list, str, int, float, bool and None")


def _name(t: type) -> str:
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def encode(value: Any) -> bytes:
    """``value`` as UTF-8 JSON; raises :class:`NotJSON` naming what cannot travel."""
    _check(value, "the result", 0)
    try:
        return json.dumps(value, ensure_ascii=False, check_circular=True).encode("utf-8")
    except (ValueError, UnicodeEncodeError, RecursionError) as e:
        raise NotJSON(f"strict results: the result cannot be written as JSON: {e}") from None


def decode(data: bytes | bytearray | memoryview) -> Any:
    """The value of a strict result. Raises :class:`NotJSON` if ``data`` is not JSON (a
    pickle from a worker that ignored the request, or anything else)."""
    raw = bytes(data)
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        kind = "a pickle" if raw[:4] == b"GMP1" else "not JSON"
        raise NotJSON(f"strict results: the worker sent a result that is {kind} "
                      f"({len(raw)} bytes); it was not decoded. An older gpumesh worker "
                      "does not support strict results") from None
