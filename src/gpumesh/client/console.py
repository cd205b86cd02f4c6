"""Printing what remote tasks print, prefixed with where it ran (like Ray's ``(pid=…)``)."""

from __future__ import annotations

import sys


def shown(text: str) -> str:
    """What a terminal shows of a line that redraws itself with carriage returns (a
    progress bar: ``"\\r 10%\\r 20%"``): its last non-empty part."""
    if "\r" not in text:
        return text
    parts = [p for p in text.split("\r") if p]
    return parts[-1] if parts else ""


class OutputPrinter:
    """Writes task output chunks line by line as ``(worker #index) line``.

    Partial lines are held per task and stream until their newline arrives (or
    :meth:`flush` at the end), except one that redraws itself with ``\\r`` (tqdm and other
    progress bars): its current state is drawn at once, prefixed, on a line left open and
    redrawn as it changes; its newline (or any other output) closes it. stdout chunks go
    to ``sys.stdout``, stderr to ``sys.stderr``.
    """

    def __init__(self, single: bool) -> None:
        self.single = single  # a single call: no task index in the prefix
        self._partial: dict[tuple[str, str], str] = {}
        self._prefix: dict[tuple[str, str], str] = {}
        self._open: tuple[str, str] | None = None  # whose redrawn line the console ends with

    def write(self, chunk: dict, data: bytes | memoryview) -> None:
        key = (chunk["task_id"], chunk["stream"])
        where = chunk.get("worker") or "worker"
        self._prefix[key] = f"({where}) " if self.single else f"({where} #{chunk['index']}) "
        text = self._partial.pop(key, "") + bytes(data).decode("utf-8", "replace")
        *lines, rest = text.split("\n")
        if rest:
            self._partial[key] = rest
        if lines:
            self._emit(key, [shown(line) for line in lines])
        if "\r" in rest:
            self._redraw(key, shown(rest))

    def skipped(self, n: int) -> None:
        if n:
            print(f"[gpumesh] {n} chunk(s) of task output were dropped (printing fell behind)",
                  file=sys.stderr)

    def flush(self) -> None:
        for key, rest in list(self._partial.items()):
            self._emit(key, [shown(rest)])
        self._partial.clear()

    def _emit(self, key: tuple[str, str], lines: list[str]) -> None:
        prefix = self._prefix.get(key, "")
        # (over this key's own open line: from its start; after another's: below it)
        lead = "\r" if self._open == key else ""
        self._close(key)
        self._put(key, lead + "".join(f"{prefix}{line}\n" for line in lines))

    def _redraw(self, key: tuple[str, str], text: str) -> None:
        self._close(key)
        stream = sys.stdout if key[1] == "stdout" else sys.stderr
        clear = "\x1b[K" if _is_tty(stream) else ""  # (a shorter state leaves no old tail)
        self._put(key, f"\r{self._prefix.get(key, '')}{text}{clear}")
        self._open = key

    def _close(self, key: tuple[str, str]) -> None:
        """End another key's open line, so that this key's output starts on a line of its own."""
        if self._open is not None and self._open != key:
            self._put(self._open, "\n")
        self._open = None

    @staticmethod
    def _put(key: tuple[str, str], text: str) -> None:
        stream = sys.stdout if key[1] == "stdout" else sys.stderr
        try:
            stream.write(text)
            stream.flush()
        except (OSError, ValueError):  # a closed or broken console must not fail the call
            pass


def _is_tty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False
