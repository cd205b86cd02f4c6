"""Big payloads between the agent and a task process: shared memory, not the socket.

A big result comes back as a memory file the task wrote (the agent posts it from a
read-only map); big arguments the agent holds in shared memory are mapped by the task
(see gpumesh.worker.membody). Small ones still cross the task's socket."""

from __future__ import annotations

import mmap
import os
import sys

import pytest

from gpumesh import wire
from gpumesh.protocol import TaskGrant
from gpumesh.limits import HANDOFF_MIN_BYTES
from gpumesh.payloadref import PayloadRef
from gpumesh.worker import membody
from gpumesh.worker.executor import Executor

from ..conftest import function_blob

pytestmark = pytest.mark.skipif(sys.platform != "linux" or not membody.available(),
                                reason="memfd_create and /proc are Linux's")


def _filled(n: int, byte: int) -> bytes:
    return bytes([byte]) * n


def _sum_and_where(data):
    """The task: what it was given (length, a checksum) and what its memory comes from."""
    import hashlib
    view = memoryview(data)
    with open("/proc/self/maps") as fh:
        memfds = sorted({line.split()[-2] if line.rstrip().endswith("(deleted)") else line.split()[-1]
                         for line in fh if "memfd:gpumesh" in line})
    return len(view), hashlib.sha256(view).hexdigest(), memfds


@pytest.fixture
def executor(tmp_path):
    ex = Executor(spool=tmp_path / "spool")
    yield ex, tmp_path
    ex.close()




def _call(ex, tmp_path, fn, *args, **kw):
    h, path = function_blob(tmp_path, fn)
    body = b"".join(bytes(c) for c in wire.dumps((args, {})).chunks)
    grant = {k: kw.pop(k) for k in ("result_format", "isolation", "job_id") if k in kw}
    return ex.run(TaskGrant(os.urandom(8).hex(), "-", h, timeout=60, **grant), path, body, **kw)


def test_a_big_result_comes_back_as_a_memory_file(executor):
    ex, tmp = executor
    out = _call(ex, tmp, _filled, HANDOFF_MIN_BYTES + 5, 7)
    assert out.status == "ok", out.error
    assert isinstance(out.payload, memoryview) and isinstance(out.payload.obj, mmap.mmap)
    assert out.payload.readonly
    assert wire.loads(out.payload) == b"\x07" * (HANDOFF_MIN_BYTES + 5)
    small = _call(ex, tmp, _filled, 100, 1)
    assert isinstance(small.payload, bytearray) and wire.loads(small.payload) == b"\x01" * 100


def test_a_big_argument_in_shared_memory_is_mapped_by_the_task(executor):
    import hashlib
    ex, tmp = executor
    np = pytest.importorskip("numpy")
    arg = np.frombuffer(os.urandom(HANDOFF_MIN_BYTES + 3), np.uint8)  # travels out of band
    chunks, _ = wire.pack_frames([b"{}", wire.dumps(((arg,), {}))])
    raw = b"".join(bytes(c) for c in chunks)
    body = membody.buffer_for(len(raw))
    memoryview(body)[:] = raw
    rng = membody.slices(body)[1]
    assert isinstance(rng, PayloadRef) and rng.kind == "shm"
    h, path = function_blob(tmp, _sum_and_where)
    out = ex.run(TaskGrant("t1", "-", h, timeout=60), path, None, args_ref=rng)
    assert out.status == "ok", out.error
    n, digest, memfds = wire.loads(out.payload)
    assert (n, digest) == (arg.nbytes, hashlib.sha256(arg).hexdigest())
    assert memfds == ["/memfd:gpumesh-args"]
