"""The local, owner-only control channel of running workers (``gpumesh pause`` / ``resume``).

Never the network: each worker listens on an ``AF_UNIX`` stream socket
``<dir>/worker-<pid>.sock``. ``<dir>`` is ``~/.gpumesh/run`` (``HOME`` of the OS user),
or, when that path is too long for a socket address, ``$XDG_RUNTIME_DIR`` (else
``/tmp``) ``/gpumesh-<uid>-<hash of HOME>``. Two locks guard it:

* the directory is created mode 0700 and refused (``ControlError``) when it belongs to
  another user or is open to group or others, so no one else can reach the sockets;
* every connection's peer credentials (``SO_PEERCRED`` on Linux, ``LOCAL_PEERCRED`` on
  macOS) must name this process's uid; any other user is answered with a refusal and
  nothing changes.

Protocol: one JSON line each way. Requests: ``{"op": "pause", "now": bool, "for_s":
seconds or null, "worker": id or null}``, ``{"op": "resume", "worker": ...}``,
``{"op": "status"}``. Answers: ``{"ok": true, "worker": id, ...}``, ``{"ok": true,
"skipped": true, "worker": id}`` (a ``worker`` filter that names another worker), or
``{"ok": false, "error": text}``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import stat
import struct
import sys
import tempfile
import threading
from pathlib import Path

log = logging.getLogger("gpumesh.worker.control")

#: Seconds a control connection may take (each way) before it is dropped (a pause --now
#: waits for the kills, which wait up to 5 s for a task that is just starting).
CONTROL_TIMEOUT_S = 10.0
#: Longest request line read (bytes): a pause command is a few dozen.
MAX_REQUEST_BYTES = 4096
_MAX_SUN_PATH = 100  # sockaddr_un.sun_path is 104 (macOS) or 108 (Linux) bytes


class ControlError(Exception):
    """The control directory cannot be used safely (another user's, or open to others)."""


class NoWorkerRunning(Exception):
    """No worker of this OS user answers on this machine."""


def control_dir() -> Path:
    """Where this OS user's workers put their control sockets (see the module docstring).
    Raises ``ControlError`` where the OS has no AF_UNIX sockets or user ids."""
    if not hasattr(socket, "AF_UNIX") or not hasattr(os, "getuid"):
        raise ControlError("the control channel needs a POSIX system (AF_UNIX sockets, user ids)")
    home = Path.home()
    path = home / ".gpumesh" / "run"
    if len(str(path / "worker-4194304.sock").encode()) <= _MAX_SUN_PATH:
        return path
    tag = hashlib.sha256(str(home).encode()).hexdigest()[:12]
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return Path(base) / f"gpumesh-{os.getuid()}-{tag}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # it exists (another user's, say)
    return True


def sweep_stale(base: Path | None = None) -> list[Path]:
    """Remove this user's fallback control directories (``gpumesh-<uid>-*`` under
    ``$XDG_RUNTIME_DIR`` or the temp dir) that hold only sockets of workers that are gone
    (``worker-<pid>.sock`` whose pid no longer exists: a worker killed with -9 cannot
    remove its own). A live pid, even a reused one, keeps its socket: never a live
    worker's. Returns the directories removed."""
    if not hasattr(os, "getuid"):
        return []
    base = Path(base or os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir())
    prefix = f"gpumesh-{os.getuid()}-"
    removed: list[Path] = []
    try:
        entries = [e for e in os.scandir(base) if e.name.startswith(prefix)]
    except OSError:
        return removed
    for entry in entries:
        path = Path(entry.path)
        try:
            if not entry.is_dir(follow_symlinks=False) or entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
            for sock in path.iterdir():
                pid = sock.name[len("worker-"):-len(".sock")]
                if sock.name.startswith("worker-") and sock.name.endswith(".sock") \
                        and pid.isdigit() and not _pid_alive(int(pid)):
                    sock.unlink()
            path.rmdir()  # fails (and is kept) while anything else is in it
            removed.append(path)
        except OSError:
            continue
    return removed


def _safe_dir(path: Path, create: bool) -> Path:
    """``path`` as a private directory of this user (made so when ``create``)."""
    if create:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise ControlError(f"{path} is not a directory")
    if st.st_uid != os.getuid():
        raise ControlError(f"{path} belongs to another user (uid {st.st_uid}); not using it")
    if st.st_mode & 0o077:
        raise ControlError(f"{path} is open to other users (mode {stat.S_IMODE(st.st_mode):o}); "
                           f"run: chmod 700 {path}")
    return path


def peer_uid(conn: socket.socket) -> int | None:
    """The uid of the process at the other end of ``conn``; None where the OS cannot say."""
    if hasattr(socket, "SO_PEERCRED"):  # Linux: struct ucred {pid, uid, gid}
        raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        return struct.unpack("3i", raw)[1]
    if sys.platform == "darwin":  # struct xucred {u_int version; uid_t uid; ...}
        sol_local, local_peercred = 0, getattr(socket, "LOCAL_PEERCRED", 0x001)
        raw = conn.getsockopt(sol_local, local_peercred, struct.calcsize("2I"))
        return struct.unpack("2I", raw)[1]
    return None


class ControlServer:
    """A worker's end of the channel. ``handler(request) -> answer`` (dicts) runs on the
    server's thread for each request from this OS user; it must be quick."""

    def __init__(self, handler, directory: Path | None = None):
        self.handler = handler
        self.dir = _safe_dir(directory or control_dir(), create=True)
        self.path = self.dir / f"worker-{os.getpid()}.sock"
        self._sock: socket.socket | None = None
        self._stopping = threading.Event()

    def start(self) -> ControlServer:
        """Listen. Raises ``ControlError`` or ``OSError`` if the socket cannot be made."""
        if self.path.exists():
            self.path.unlink()  # our pid's, from a process that died: reuse the name
        sweep_stale()  # what killed workers left in the temp dir
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        for attempt in range(3):
            try:
                sock.bind(str(self.path))
                break
            except FileNotFoundError:
                # another worker of this user, stopping, removed the empty directory
                if attempt == 2:
                    sock.close()
                    raise
                _safe_dir(self.dir, create=True)
        os.chmod(self.path, 0o600)
        sock.listen(8)
        sock.settimeout(0.5)
        self._sock = sock
        threading.Thread(target=self._serve, name="owner-control", daemon=True).start()
        return self

    def close(self) -> None:
        self._stopping.set()
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        try:
            self.path.unlink()
            self.dir.rmdir()  # when it is empty: no litter (in /tmp, say) once all are gone
        except OSError:
            pass

    def _serve(self) -> None:
        sock = self._sock
        while not self._stopping.is_set() and sock is not None:
            try:
                conn, _ = sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return  # closed
            try:
                with conn:
                    conn.settimeout(CONTROL_TIMEOUT_S)
                    self._answer(conn)
            except Exception as e:  # noqa: BLE001 - one bad client never stops the channel
                log.warning("control connection failed: %s", e)

    def _answer(self, conn: socket.socket) -> None:
        uid = peer_uid(conn)
        too_long: ValueError | None
        try:
            line = _read_line(conn)  # (read even from a refused peer: its answer then arrives)
        except ValueError as e:
            line, too_long = "", e
        else:
            too_long = None
        if uid is not None and uid != os.getuid():
            log.warning("control channel: refused a connection from uid %d", uid)
            _send(conn, {"ok": False, "error": "refused: this worker takes commands only from "
                                               "the OS user running it"})
            return
        try:
            if too_long is not None:
                raise too_long
            request = json.loads(line)
            if not isinstance(request, dict):
                raise ValueError("not an object")
        except ValueError as e:
            _send(conn, {"ok": False, "error": f"bad request: {e}"})
            return
        try:
            answer = self.handler(request)
        except ValueError as e:
            answer = {"ok": False, "error": str(e)}
        _send(conn, answer)


def _read_line(conn: socket.socket) -> str:
    data = b""
    while b"\n" not in data:
        piece = conn.recv(MAX_REQUEST_BYTES)
        if not piece:
            break
        data += piece
        if len(data) > MAX_REQUEST_BYTES:
            raise ValueError("request too long")
    return data.split(b"\n", 1)[0].decode("utf-8", errors="replace")


def _send(conn: socket.socket, answer: dict) -> None:
    conn.sendall(json.dumps(answer).encode() + b"\n")


def send(request: dict, directory: Path | None = None) -> list[dict]:
    """Send ``request`` to every worker of this OS user on this machine; their answers
    (one per worker that answered). Raises ``NoWorkerRunning`` when none answers and
    ``ControlError`` when the directory is not private."""
    path = directory or control_dir()
    if not path.exists():
        raise NoWorkerRunning("no gpumesh worker of this user is running on this machine")
    _safe_dir(path, create=False)
    answers = []
    for sock_path in sorted(path.glob("worker-*.sock")):
        try:
            answers.append(_ask(sock_path, request))
        except (ConnectionRefusedError, FileNotFoundError):
            # the worker died without cleaning up (kill -9): its socket is stale
            try:
                sock_path.unlink()
            except OSError:
                pass
        except (OSError, ValueError) as e:
            log.warning("worker at %s did not answer: %s", sock_path, e)
    if not answers:
        try:
            path.rmdir()  # only stale sockets were there: leave nothing behind
        except OSError:
            pass
        raise NoWorkerRunning("no gpumesh worker of this user is running on this machine")
    return answers


def _ask(sock_path: Path, request: dict) -> dict:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(CONTROL_TIMEOUT_S)
        s.connect(str(sock_path))
        s.sendall(json.dumps(request).encode() + b"\n")
        answer = json.loads(_read_line(s) or "null")
    if not isinstance(answer, dict):
        raise ValueError("no answer")
    return answer
