"""Printing what remote tasks print, prefixed with where it ran (like Ray's ``(pid=…)``)."""

from __future__ import annotations

import sys


class OutputPrinter:
    """Writes task output chunks line by line as ``(worker #index) line``.

    Partial lines are held per task and stream until their newline arrives (or
    :meth:`flush` at the end). stdout chunks go to ``sys.stdout``, stderr to ``sys.stderr``.
    """

    def __init__(self, single: bool) -> None:
        self.single = single  # a single call: no task index in the prefix
        self._partial: dict[tuple[str, str], str] = {}
        self._prefix: dict[tuple[str, str], str] = {}

    def write(self, chunk: dict, data: bytes | memoryview) -> None:
        key = (chunk["task_id"], chunk["stream"])
        where = chunk.get("worker") or "worker"
        self._prefix[key] = f"({where}) " if self.single else f"({where} #{chunk['index']}) "
        text = self._partial.pop(key, "") + bytes(data).decode("utf-8", "replace")
        *lines, rest = text.split("\n")
        if rest:
            self._partial[key] = rest
        if lines:
            self._emit(key, lines)

    def skipped(self, n: int) -> None:
        if n:
            print(f"[gpumesh] {n} chunk(s) of task output were dropped (printing fell behind)",
                  file=sys.stderr)

    def flush(self) -> None:
        for key, rest in list(self._partial.items()):
            self._emit(key, [rest])
        self._partial.clear()

    def _emit(self, key: tuple[str, str], lines: list[str]) -> None:
        stream = sys.stdout if key[1] == "stdout" else sys.stderr
        prefix = self._prefix.get(key, "")
        try:
            stream.write("".join(f"{prefix}{line}\n" for line in lines))
            stream.flush()
        except (OSError, ValueError):  # a closed or broken console must not fail the call
            pass
