"""A worker behind a slow link: moving a task's arguments or result takes seconds.

The worker is joined through a loopback TCP proxy that limits one direction to about
1 MB/s per connection, so an 8 MiB argument or result takes ~8 s on the wire. The task
must still run exactly once and its value arrive. ``GPUMESH_MAX_ATTEMPTS=1`` makes a
wrongly re-queued task fail at once (instead of after three slow rounds).
"""

from __future__ import annotations

import queue
import socket
import threading
import time

import pytest

from gpumesh import accelerate

from ..conftest import Mesh, Proc

RATE = 1_000_000  # bytes per second
SIZE = 8 * 2**20


class ThrottleProxy:
    """127.0.0.1 proxy to ``target_port``; ``up`` / ``down`` limit worker->coordinator /
    coordinator->worker bytes per second on every connection (None: no limit).
    ``buffered``: the coordinator->worker direction reads everything the coordinator sends
    at once and passes it on at ``down`` (a buffering middlebox: the coordinator's send of
    a big answer ends seconds before the worker has it)."""

    def __init__(self, target_port: int, up: float | None = None, down: float | None = None,
                 buffered: bool = False):
        self.target, self.up, self.down, self.buffered = target_port, up, down, buffered
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                client.close()
                continue
            self.conns += [client, server]
            threading.Thread(target=self._pipe, args=(client, server, self.up), daemon=True).start()
            pipe = self._pipe_buffered if self.buffered else self._pipe
            threading.Thread(target=pipe, args=(server, client, self.down), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket, rate: float | None) -> None:
        try:
            while True:
                data = src.recv(16384)
                if not data:
                    break
                dst.sendall(data)
                if rate:
                    time.sleep(len(data) / rate)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    @classmethod
    def _pipe_buffered(cls, src: socket.socket, dst: socket.socket, rate: float | None) -> None:
        """As :meth:`_pipe`, with the reading and the (throttled) sending decoupled."""
        backlog: queue.SimpleQueue[bytes] = queue.SimpleQueue()

        def drain() -> None:
            while True:
                data = src.recv(1 << 20)
                backlog.put(data)
                if not data:
                    return

        def reader() -> None:
            try:
                drain()
            except OSError:
                backlog.put(b"")

        threading.Thread(target=reader, daemon=True).start()
        cls._pipe(_Backlog(backlog), dst, rate)

    def close(self) -> None:
        self.sock.close()
        for s in self.conns:
            try:
                s.close()
            except OSError:
                pass


class _Backlog:
    """What :meth:`ThrottleProxy._pipe` reads from: a queue of chunks, b"" for the end."""

    def __init__(self, chunks: queue.SimpleQueue):
        self.chunks, self.left = chunks, b""

    def recv(self, n: int) -> bytes:
        if not self.left:
            self.left = self.chunks.get()
        data, self.left = self.left[:n], self.left[n:]
        return data

    def shutdown(self, how: int) -> None:
        pass


@pytest.fixture
def slow_mesh(tmp_path):
    """Factory: a coordinator and one worker joined through a ThrottleProxy."""
    made: list[tuple[Mesh, ThrottleProxy]] = []

    def make(up=None, down=None, buffered=False):
        m = Mesh(tmp_path / f"slow{len(made)}")
        m.env["GPUMESH_MAX_ATTEMPTS"] = "1"
        # The worker shares the coordinator's machine: without this it would hand big
        # payloads off as files and never use the slow link.
        m.env["GPUMESH_HANDOFF"] = "0"
        m.start()
        proxy = ThrottleProxy(m.port, up=up, down=down, buffered=buffered)
        made.append((m, proxy))
        worker = Proc(["join", f"http://127.0.0.1:{proxy.port}"], m.env, m.root / "worker.log")
        m.procs.append(worker)
        m.wait_alive(1, worker)
        return m

    yield make
    for m, proxy in made:
        m.stop()
        proxy.close()


BUG = ("BUG: the worker's heartbeat lists only tasks whose process is running "
       "(worker/executor.py Executor.running(); agent.py _heartbeat_loop). While it downloads "
       "a task's arguments/function or uploads its result, the task is missing from "
       "'running', and coordinator/core.py Coordinator.heartbeat() re-queues it as 'forgotten' "
       "once its lease is older than 2 heartbeats: on a link where that transfer takes > ~4 s "
       "the task is re-run and its result refused as stale, until it fails with WorkerLost")


def test_result_upload_slower_than_heartbeats(slow_mesh, tmp_path):
    mesh = slow_mesh(up=RATE)
    client = mesh.client(output=False)
    runs = tmp_path / "runs"

    @accelerate(client)
    def big_result(path):
        with open(path, "a") as fh:
            fh.write("run\n")
        return b"r" * SIZE

    try:
        value = big_result(str(runs))
    finally:
        client.close()
    assert value == b"r" * SIZE
    assert runs.read_text().count("run") == 1


@pytest.mark.parametrize("buffered", [False, True], ids=["link", "buffering-proxy"])
def test_argument_download_slower_than_heartbeats(slow_mesh, tmp_path, buffered):
    # buffered: the coordinator's send of the lease answer ends at once, ~8 s before the
    # worker has read it; the worker's heartbeats say it is receiving one meanwhile.
    mesh = slow_mesh(down=RATE, buffered=buffered)
    client = mesh.client(output=False)
    runs = tmp_path / "runs"

    @accelerate(client)
    def big_argument(data, path):
        with open(path, "a") as fh:
            fh.write("run\n")
        return len(data)

    try:
        value = big_argument(b"a" * SIZE, str(runs))
    finally:
        client.close()
    assert value == SIZE
    assert runs.read_text().count("run") == 1
