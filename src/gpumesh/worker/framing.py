"""The framing of a worker's local sockets, both ends (agent, zygote, function host,
task process; and the spawn runtime's task processes).

* **Control messages** (agent <-> zygote and function hosts): one JSON object per
  ``SOCK_SEQPACKET`` datagram, descriptors passed with it (``SCM_RIGHTS``).
* **Data frames** (agent <-> a task process, on the spare's socket): ``u64 length |
  bytes`` each, several per message in one gathering write, descriptors with the first.
"""

from __future__ import annotations

import array
import json
import os
import socket
import struct

#: Control messages are single SEQPACKET datagrams; keep them well under the socket buffer.
MAX_CONTROL_BYTES = 60 * 1024

CONTROL_TYPE = getattr(socket, "SOCK_SEQPACKET", socket.SOCK_DGRAM)


# ---------------------------------------------------------------- control messages ---
def send_msg(sock: socket.socket, msg: dict, fds: list[int] | tuple = ()) -> None:
    data = json.dumps(msg).encode()
    if len(data) > MAX_CONTROL_BYTES:
        raise ValueError("control message too large")
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.send(data)


def recv_raw(sock: socket.socket) -> tuple[bytes | None, list[int]]:
    """One message, undecoded, and the fds passed with it (close-on-exec: what the
    receiver starts with ``exec`` never inherits them); ``(None, [])`` at EOF.

    A peer that died with something we sent still unread in its socket makes Linux
    answer ECONNRESET, not EOF: that is the same hang-up (the agent killed while its
    reader thread lagged behind a host's message), and is read as one, so that a host
    still kills its tasks' groups and the zygote its scripts'."""
    try:
        data, fds, _flags, _addr = socket.recv_fds(sock, MAX_CONTROL_BYTES + 1024, 4,
                                                   getattr(socket, "MSG_CMSG_CLOEXEC", 0))
    except ConnectionResetError:
        return None, []
    if not data:
        for fd in fds:
            os.close(fd)
        return None, []
    return data, list(fds)


def recv_msg(sock: socket.socket) -> tuple[dict | None, list[int]]:
    """One message and the fds passed with it; ``(None, [])`` at EOF."""
    data, fds = recv_raw(sock)
    return (None, []) if data is None else (json.loads(data), fds)


def control_pair() -> tuple[socket.socket, socket.socket]:
    return socket.socketpair(socket.AF_UNIX, CONTROL_TYPE)



# ---------------------------------------------------------------- data socket --------
def send_blob(sock: socket.socket, data) -> None:
    view = memoryview(data).cast("B")
    sock.sendall(struct.pack("<Q", view.nbytes))
    sock.sendall(view)


def recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], min(n - got, 1 << 22))
        if k == 0:
            raise EOFError(f"connection closed after {got} of {n} bytes")
        got += k
    return buf


def recv_blob(sock: socket.socket) -> bytearray:
    (n,) = struct.unpack("<Q", recv_exact(sock, 8))
    return recv_exact(sock, n)


#: Frames up to this many bytes in all go as one write where the platform has no
#: gathering write (Windows); elsewhere every frame of a message goes in one ``sendmsg``.
COALESCE_BYTES = 64 * 1024
#: Most descriptors one message on a data socket carries.
MAX_FDS = 4


def send_frames(sock: socket.socket, frames: list, fds: list[int] | tuple = ()) -> None:
    """Send ``frames`` as ``u64 len | bytes`` each (a frame: a bytes-like object, or a
    list of them sent as one), passing ``fds`` (SCM_RIGHTS) with the first bytes. One
    write for the whole message where it fits the socket: the reader wakes once, not at
    each length prefix."""
    parts: list = []
    for frame in frames:
        views = [memoryview(c).cast("B") for c in (frame if isinstance(frame, list) else [frame])]
        parts.append(struct.pack("<Q", sum(v.nbytes for v in views)))
        parts.extend(v for v in views if v.nbytes)
    if not hasattr(sock, "sendmsg"):  # (Windows) no gathering write, no descriptors
        if fds:
            raise OSError("descriptors cannot be passed on this platform")
        if sum(len(p) for p in parts) <= COALESCE_BYTES:
            sock.sendall(b"".join(parts))
        else:
            for part in parts:
                sock.sendall(part)
        return
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    while parts:
        sent = sock.sendmsg(parts[:512], ancillary)  # (well under any IOV_MAX)
        ancillary = []
        while parts and sent >= len(parts[0]):
            sent -= len(parts.pop(0))
        if sent:  # a stream socket may take a message in parts
            parts[0] = memoryview(parts[0])[sent:]


def recv_blob_fds(sock: socket.socket) -> tuple[bytearray, list[int]]:
    """As :func:`recv_blob`, also returning the descriptors passed with it (the caller
    closes them; on error they are closed here)."""
    flags = getattr(socket, "MSG_CMSG_CLOEXEC", 0)
    head, fds, _flags, _addr = socket.recv_fds(sock, 8, MAX_FDS, flags)
    try:
        if not head:
            raise EOFError("connection closed before a message")
        if len(head) < 8:
            head += recv_exact(sock, 8 - len(head))
        (n,) = struct.unpack("<Q", head)
        return recv_exact(sock, n), list(fds)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
