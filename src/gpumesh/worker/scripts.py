"""Script tasks: ``gpumesh submit SCRIPT --payloads FILE.json`` on the worker side.

The protocol a script follows (also in docs/cli.md):

* it is run as ``python <script>`` (the worker's interpreter) in a fresh process, in its
  own process group, with the current directory set to an empty temporary directory;
  the script is a copy of the cached blob under its own file name (``task.py``, as
  submitted), alone in a directory of its own, so its tracebacks, ``__file__`` and
  ``sys.argv[0]`` name it;
* its task's payload arrives as JSON on **stdin** (read it all, e.g. ``json.load(sys.stdin)``);
* its **result is the last line of its stdout that parses as JSON**; it may print anything
  before that line (progress, logs); everything it prints is kept for ``gpumesh logs``;
* exit status 0 means success. A non-zero exit status, or no JSON line on stdout, makes
  the task fail with the tail of its stderr in the error.

The environment has ``GPUMESH_SCRIPT=1`` and ``GPUMESH_IN_TASK=1`` set, never the
worker's credentials. Nothing is unpickled anywhere on this path, so a coordinator in
safe mode (``serve --safe-mode``) accepts script jobs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading

from ..limits import ERROR_TAIL_BYTES
from ..protocol import script_name, timeout_message
from . import procs, runner

#: Variable set for script tasks (a script can tell it runs on the mesh).
SCRIPT_ENV = "GPUMESH_SCRIPT"
#: How much of the end of a script's stdout is searched for the result line.
RESULT_SEARCH_BYTES = 16 * 2**20
#: The file name of a script submitted as source, without a name of its own.
DEFAULT_NAME = "script.py"


def _tail(path: str, n: int) -> bytes:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - n))
            return fh.read()
    except OSError:
        return b""


def result_line(stdout: bytes) -> bytes | None:
    """The last line of ``stdout`` that parses as JSON (stripped), or None."""
    for line in reversed(stdout.splitlines()):
        line = line.strip()
        if not line:
            continue
        try:
            json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            continue
        return line
    return None


def _error(kind: str, message: str, err_path: str, out_path: str | None = None, **extra) -> dict:
    error = {"kind": kind, "type": "ScriptFailed" if kind == "script" else "TaskCrashed",
             "message": message, **extra}
    tail = _tail(err_path, ERROR_TAIL_BYTES).decode("utf-8", "replace")
    if tail:
        error["stderr_tail"] = tail
        last = [ln for ln in tail.splitlines() if ln.strip()]
        if last:
            error["message"] += f"; stderr ends with: {last[-1][:300]}"
    if out_path is not None:
        out = _tail(out_path, 1024).decode("utf-8", "replace")
        if out:
            error["stdout_tail"] = out
    return error


def place(script_path: str, name: str | None, under: str | None) -> str:
    """A copy of the cached script ``script_path`` named ``name`` (a file name as
    :func:`~gpumesh.protocol.script_name` gives; anything else, or None, is
    ``script.py``), alone in a new temporary directory under ``under``: run from there,
    a traceback names the user's file (``.../task.py``, line 7) rather than the blob's
    content hash, and ``sys.path[0]`` holds nothing else. A copy, not a link: a script
    that writes to its own file cannot change the cache, which stays content-addressed."""
    if not name or script_name(name) != name:
        name = DEFAULT_NAME
    where = tempfile.mkdtemp(prefix="gpumesh-src-", dir=under)
    try:
        target = os.path.join(where, name)
        try:
            shutil.copyfile(script_path, target)
        except OSError:  # a name this file system refuses (reserved on Windows: CON, NUL...)
            target = os.path.join(where, DEFAULT_NAME)
            shutil.copyfile(script_path, target)
    except BaseException:
        shutil.rmtree(where, ignore_errors=True)
        raise
    return target


def run(script_path: str, payload: bytes, timeout: float | None, out: str, err: str,
        pending, kill, env: dict | None = None, watch=None, name: str | None = None):
    """Run one script task; returns an ``executor.Outcome``. ``script_path``: the cached
    script, run as a copy named ``name`` (see :func:`place`). ``pending`` (the executor's
    ``host.Pending``) gets the pid so ``kill(pending, why)`` (timeout, cancel) can kill the
    process group. ``watch(pid, running)``, if given, is told when the script starts and
    once it has ended (Executor._watch_script: it must not outlive the agent)."""
    from .executor import Outcome

    child_env = {k: v for k, v in os.environ.items() if k not in runner.SCRUBBED_ENV}
    # UTF-8 stdio whatever the worker's code page (cp1252 on Windows): the payload is
    # written and the output read as UTF-8
    child_env.update({runner.IN_TASK_ENV: "1", SCRIPT_ENV: "1", "PYTHONUNBUFFERED": "1",
                      "PYTHONIOENCODING": "utf-8"})
    if env:
        child_env.update({str(k): str(v) for k, v in env.items()})
    # Beside the output files, in the worker's own directory: a worker killed mid-task
    # leaves nothing behind that the next worker's start does not remove (tempdirs).
    under = os.path.dirname(out) or None
    try:
        script = place(script_path, name, under)
    except OSError as e:
        pending.started.set()
        return Outcome("retry", {"kind": "host_died",
                                 "message": f"could not copy the script to run it: {e}"})
    workdir = tempfile.mkdtemp(prefix="gpumesh-script-", dir=under)
    try:
        with open(out, "ab") as fo, open(err, "ab") as fe:  # emptied by Executor.new_output
            try:
                proc = subprocess.Popen([sys.executable, script], stdin=subprocess.PIPE,
                                        stdout=fo, stderr=fe, cwd=workdir, env=child_env,
                                        **procs.group_kwargs())
            except OSError as e:
                pending.started.set()
                return Outcome("retry", {"kind": "host_died",
                                         "message": f"could not start the script: {e}"})
        pending.pid = proc.pid
        pending.started.set()
        if watch is not None:
            watch(proc.pid, True)
        stdin = proc.stdin
        assert stdin is not None  # stdin=PIPE

        def feed() -> None:
            try:
                stdin.write(payload)
            except OSError:
                pass  # the script exited without reading its payload; its exit status speaks
            finally:
                try:
                    stdin.close()
                except OSError:
                    pass

        threading.Thread(target=feed, daemon=True).start()
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            kill(pending, "timeout")
            proc.wait()
            return Outcome("error", {"kind": "timeout", "type": "TaskTimeout",
                                     "message": timeout_message(timeout)})
        finally:
            pending.code = proc.returncode
            pending.exited.set()
            procs.kill_tree(proc.pid)  # nothing the script started outlives its task
            if watch is not None:
                watch(proc.pid, False)
        if pending.killed_for and code != 0:  # (a script that had ended on its own stands)
            return Outcome("error", {"kind": pending.killed_for, "type": "Cancelled",
                                     "message": f"the task was {pending.killed_for}"})
        if code < 0:
            return Outcome("error", _error("crashed", f"the script was {procs.describe_exit(code)}",
                                           err, code=code))
        if code != 0:
            return Outcome("error", _error("script", f"the script exited with status {code}", err,
                                           code=code))
        line = result_line(_tail(out, RESULT_SEARCH_BYTES))
        if line is None:
            return Outcome("error", _error(
                "script", "the script printed no JSON line on stdout (its result is the last "
                "stdout line that parses as JSON)", err, out))
        return Outcome("ok", None, bytearray(line))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(os.path.dirname(script), ignore_errors=True)
