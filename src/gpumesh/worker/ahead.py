"""Sending a slot's next task to its kept process behind the running one
(``isolation="job"`` pipelining, fork runtime; see docs/architecture.md, "Isolation").

The agent (:meth:`gpumesh.worker.executor.Executor._send_ahead`) writes the next run
message, marked ``"ahead": true``, and its arguments to the job's kept process while that
process runs the task before it; the process begins it as soon as it has replied. To
withdraw it (a cancel, a hand-back) the agent writes a skip message naming it, which the
process looks for (:func:`skip_waiting`, never blocking) just before it begins the task:
there, it answers :data:`SKIPPED` and the task never ran; not there, the task began (the
skip is read later as the next message, and dropped). Both ends are here.
"""

from __future__ import annotations

import json
import socket
import struct
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (not at run time: task processes import this module)
    from .host import Spare

#: A task sent ahead that was withdrawn before it began answers this (no payload).
SKIPPED = "skipped"
SKIPPED_BYTES = b'{"status": "skipped"}'
#: The most bytes a skip message takes (its length prefix included).
MAX_SKIP_BYTES = 256


class Ahead:
    """A task sent to its slot's kept process while that process ran the job's previous
    task (``isolation="job"`` pipelining, see :meth:`Executor._send_ahead`): it begins
    there as soon as that one ends, without waiting for the agent."""

    __slots__ = ("task_id", "spare", "pair", "withdrawn")

    def __init__(self, task_id: str, spare: Spare, pair: int) -> None:
        self.task_id, self.spare, self.pair = task_id, spare, pair
        self.withdrawn = False  # a skip message was sent behind it (Executor.withdraw)


def fits(task, grant, args, max_args: int) -> bool:
    """Whether ``grant`` (with argument frame ``args``) may be sent ahead behind ``task``:
    the same job and function, a function task with its small arguments inline (no
    store file, no task environment, which each take their own steps before a run)."""
    return (grant.job_id == task.job_id and grant.fn == task.fn and grant.isolation == "job"
            and grant.kind == "function" and not (grant.refs or grant.args_file or grant.requires)
            and isinstance(args, (bytes, bytearray, memoryview)) and len(args) <= max_args)


def skip_message(task_id: str) -> bytes:
    return json.dumps({"op": "skip", "task_id": task_id}).encode()


def skip_waiting(sock: socket.socket, task_id) -> bool:
    """In the kept process, about to begin ``task_id`` (sent ahead): whether a skip for it
    waits on ``sock``. Skip messages waiting there are read (one for an earlier task came
    too late for it, and is dropped); anything else (the job's next task, sent ahead once
    this one's turn came) is left for later. Never blocks."""
    while True:
        try:
            head = sock.recv(MAX_SKIP_BYTES, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        if len(head) < 8:
            return False  # (EOF, or a message still coming: not a skip sent before this look)
        (n,) = struct.unpack("<Q", head[:8])
        if n > MAX_SKIP_BYTES - 8 or len(head) < 8 + n:
            return False  # longer than a skip: a run message
        try:
            msg = json.loads(head[8:8 + n])
        except ValueError:
            return False
        if not isinstance(msg, dict) or msg.get("op") != "skip":
            return False
        sock.recv(8 + n)  # (all of it is there: the peek saw it)
        if msg.get("task_id") == task_id:
            return True
