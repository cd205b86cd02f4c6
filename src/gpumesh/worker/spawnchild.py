"""A task process of the spawn runtime: ``python -m gpumesh.worker.spawnchild``.

Started by :class:`gpumesh.worker.spawn.SpawnExecutor` ahead of need, with a fresh
interpreter (no fork). Its life:

1. read one JSON line on stdin: the agent's loopback port, a one-time token, and maybe
   the function to load; connect to the agent over TCP and send the token;
2. ``load`` (from the line, or a message later): unpickle the job's function and import
   the modules earlier tasks of that function imported; answer ``ready`` or
   ``load_error``. ``preload`` messages may add modules while it waits;
3. ``run``: point stdout/stderr at the task's files, set its environment and run it
   as a forked task child does (:func:`gpumesh.worker.runner.run_task`, over the same
   socket: ``u64 pid | meta | payload``; its pid first, once per task). Arguments come on the socket, or (big) as
   a :class:`~gpumesh.payloadref.PayloadRef` to a file it maps by path; a big result goes back as a file (the agent's spool or the
   coordinator's handoff directory), never as a descriptor;
4. exit, unless the job asked for ``isolation="job"``: then wait for the job's next task.

On Linux it is a child subreaper (gpumesh.worker.procs.adopt_orphans): what its task
started in a session of its own stays below it even when its own parent ended, and is
killed, with all below it, as this process ends (the agent kills the same tree when it
kills the process: gpumesh.worker.procs.kill_tree). Its orphans' zombies are not reaped
while it lives (a reaper would steal the exit status of what the task waits for), only
with it.

Control messages are ``u64 length | JSON`` on the same socket. Nothing here needs
``fork``, AF_UNIX, memfd or descriptor passing.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import sys
from typing import Any


def _send(sock: socket.socket, msg: dict) -> None:
    from gpumesh.worker.framing import send_blob
    send_blob(sock, json.dumps(msg).encode())


def _recv(sock: socket.socket) -> dict | None:
    from gpumesh.worker.framing import recv_blob
    try:
        return json.loads(recv_blob(sock))
    except EOFError:
        return None


def _load(msg: dict):
    from gpumesh import wire
    from gpumesh.worker import runner
    front = [p for p in msg.get("front_path") or () if isinstance(p, str)]
    if front:  # the function's task environment (gpumesh.worker.envs) comes first
        sys.path[0:0] = front
    with open(msg["path"], "rb") as fh:
        fn = wire.loads(bytearray(fh.read()))
    fn = getattr(fn, "__gpumesh_wrapped__", fn)  # a decorated function: run the original
    if not callable(fn):
        raise TypeError(f"the job's function is a {type(fn).__name__}, not callable")
    runner._preload(msg.get("modules") or [], msg.get("sys_path") or [])
    runner._snapshot_loaded()
    return fn


def _run(fn, sock: socket.socket, msg: dict) -> None:
    from gpumesh.worker import runner, tempdirs
    if runner._TRACE:
        runner.tracing.mark("task.start")  # the same hop a forked task child marks
    sock.sendall(struct.pack("<Q", os.getpid()))  # first: the agent may need to kill us
    env = msg.get("env")
    if env:
        os.environ.update({str(k): str(v) for k, v in env.items()})
    runner._redirect(1, msg.get("stdout"))
    runner._redirect(2, msg.get("stderr"))
    tempdirs.use_temp_dir(msg.get("tmp"))
    # Big arguments are a reference (a file it maps by path): no descriptor travels here.
    runner.run_task(fn, sock, msg.get("result_format"), msg.get("args"), msg.get("handoff_dir"),
                    msg.get("handoff_name"))


def _watch_agent(agent_pid: int) -> None:
    """End this process (and what its task started) once the agent is gone: an agent
    killed outright cannot close its executor, and its tasks must not run on unwatched."""
    import threading
    import time

    def gone() -> bool:
        if os.getppid() != agent_pid:  # POSIX: reparented
            return True
        if sys.platform == "win32":  # the parent pid stays; ask whether it still runs
            try:
                import psutil
            except ImportError:
                return False
            return not psutil.pid_exists(agent_pid)
        return False

    def watch() -> None:
        while not gone():
            time.sleep(1.0)
        from gpumesh.worker import procs
        procs.kill_tree(os.getpid())
        os._exit(70)
    threading.Thread(target=watch, name="agent-watch", daemon=True).start()


def _empty_stdin() -> None:
    """After the handshake, give the task what the fork runtime gives it: an open, empty
    stdin (``os.devnull``) at descriptor 0. A closed ``sys.stdin`` made ``isatty()`` and
    ``fileno()`` raise ValueError (libraries call them), and subprocesses inherited the
    handshake pipe as their stdin."""
    sys.stdin.close()  # (and descriptor 0, the handshake pipe, with it)
    null = os.open(os.devnull, os.O_RDONLY)  # the lowest free descriptor: 0
    if null != 0:
        os.dup2(null, 0)
        os.close(null)
    sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115


def main() -> int:
    # The agent decides when we stop; its Ctrl+C must not reach the task either.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from gpumesh.worker import runner
    for name in runner.SCRUBBED_ENV:
        os.environ.pop(name, None)
    os.environ[runner.IN_TASK_ENV] = "1"
    hello = json.loads(sys.stdin.readline())
    _empty_stdin()
    from gpumesh.worker import procs
    procs.adopt_orphans()
    _watch_agent(int(hello.get("agent", os.getppid())))
    # Warm: what every function needs (a function blob is a cloudpickle stream).
    import cloudpickle  # noqa: F401

    import gpumesh.handoff  # noqa: F401
    import gpumesh.payloadref  # noqa: F401
    import gpumesh.wire  # noqa: F401
    sock = socket.create_connection(("127.0.0.1", int(hello["port"])))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.sendall(bytes.fromhex(hello["token"]))
    stream: Any  # (a TextIOWrapper, or whatever stands in for one: hence the except)
    for stream in (sys.stdout, sys.stderr):  # what a task prints leaves at each line
        try:
            stream.reconfigure(line_buffering=True, encoding="utf-8", errors="backslashreplace")
        except (AttributeError, ValueError):
            pass
    fn = None
    msg = hello.get("load")
    while True:
        if msg is None:
            msg = _recv(sock)
            if msg is None:
                return 0  # the agent hung up
        op = msg.get("op", "load")
        if op == "load":
            try:
                fn = _load(msg)
            except BaseException as e:  # noqa: BLE001 - any failure is the job's error
                _send(sock, {"op": "load_error", "error": runner.describe_load_failure(e, "the function")})
                return 0
            _send(sock, {"op": "ready"})
        elif op == "preload":
            runner._preload(msg.get("modules") or [], msg.get("sys_path") or [])
            runner._snapshot_loaded()
        elif op == "run" and fn is not None:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            _run(fn, sock, msg)
            if not msg.get("keep"):
                return 0
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        msg = None


def _kill_strays() -> None:
    """Kill what this process's tasks left running (Linux: its descendants; see the
    module's docstring). Never raises."""
    try:
        from gpumesh.worker import procs
        if procs.LINUX:
            procs.kill_descendants(os.getpid(), wait=1.0)
    except BaseException:  # noqa: BLE001 - the exit must come whatever happens here
        pass


if __name__ == "__main__":
    from gpumesh.worker.runner import flush_and_exit
    code = 70
    try:
        code = main()
    finally:
        _kill_strays()
        flush_and_exit(code)
