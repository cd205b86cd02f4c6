"""Big request bodies stream through a real coordinator process.

A frames body (job submission, task result) over the store's inline limit is parsed as it
arrives: small frames stay in memory, every bigger payload frame is written straight into
a temporary file under ``<data>/blobs/incoming`` that the store then renames into place.
These tests pin what that must keep: bytes arrive exactly, every refusal (400, 409, 413)
is the same as before, and a body that breaks off or is refused leaves no file behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys

import cloudpickle
import httpx
import numpy as np
import pytest

from gpumesh import accelerate, wire
from gpumesh.limits import INLINE_BLOB_BYTES, MiB

from ..conftest import wait_for

cloudpickle.register_pickle_by_value(sys.modules[__name__])

LIMIT_MB = 16


def body_of(frames) -> bytes:
    chunks, _ = wire.pack_frames(frames)
    return b"".join(bytes(c) for c in chunks)


@pytest.fixture(scope="module")
def raw(tmp_path_factory):
    """A coordinator without workers (tests play the worker over HTTP); 16 MiB body limit."""
    from tests.security.conftest import SecureMesh
    m = SecureMesh(tmp_path_factory.mktemp("streaming"), env={"GPUMESH_MAX_BODY_MB": str(LIMIT_MB)})
    m.start()
    m.incoming = m.root / "data" / "blobs" / "incoming"
    yield m
    m.stop()


def leftovers(m) -> list:
    return sorted(p.name for p in m.incoming.iterdir())


def assert_400(r, words: str):
    assert r.status_code == 400, (r.status_code, r.text)
    assert r.json()["error"] == "bad_request"
    assert words in r.json()["message"], r.json()


def job_meta(job_id: str, fn_blob: bytes, n: int, **kw) -> dict:
    return {"job_id": job_id, "fn": hashlib.sha256(fn_blob).hexdigest(), "fn_inline": True,
            "n_tasks": n, **kw}


def register(m) -> str:
    return m.request("POST", "/v1/workers", json={"hostname": "fake", "slots": 8}).json()["id"]


def lease(m, wid: str, slots: int) -> tuple[list[dict], list[bytes]]:
    r = m.request("POST", f"/v1/workers/{wid}/lease", json={"slots": slots, "wait": 2})
    assert r.status_code == 200, r.text
    frames = wire.unpack_frames(r.content)
    return json.loads(bytes(frames[0]))["tasks"], [bytes(f) for f in frames[1:]]


# ---------------------------------------------------------------- byte-exact ---------

def test_big_arguments_and_results_round_trip_byte_exact(raw):
    """Small, boundary-sized and big frames in one body keep their bytes and order, both
    ways, with a big inline function blob among them; nothing stays in incoming/."""
    rng = np.random.default_rng(1)
    fn_blob = rng.bytes(INLINE_BLOB_BYTES + 4096)  # big: hashed from its file, then adopted
    args = [rng.bytes(1000), rng.bytes(3 * MiB + 7), rng.bytes(INLINE_BLOB_BYTES),
            rng.bytes(INLINE_BLOB_BYTES + 1), b"", rng.bytes(5 * MiB)]
    meta = job_meta("5eed0000b1", fn_blob, len(args))
    r = raw.request("POST", "/v1/jobs", content=body_of([json.dumps(meta).encode(), fn_blob, *args]))
    assert r.status_code == 200, r.text
    assert leftovers(raw) == []
    got = raw.request("GET", f"/v1/blobs/{meta['fn']}")
    assert got.status_code == 200 and got.content == fn_blob

    wid = register(raw)
    tasks, payloads = lease(raw, wid, len(args))
    assert len(tasks) == len(args)
    for t, p in zip(tasks, payloads):
        assert p == args[t["index"]], t["index"]

    results = {t["index"]: rng.bytes([10, 4 * MiB + 3, 100, INLINE_BLOB_BYTES + 1, 0, 300_000][t["index"]])
               for t in tasks}
    for t in tasks:
        res = results[t["index"]]
        stale = raw.request("POST", f"/v1/tasks/{t['task_id']}/result", params={"lease": "abcdef"},
                            content=body_of([b'{"status": "ok"}', res]))
        assert stale.status_code == 409  # fenced, and its streamed file is gone
        assert leftovers(raw) == []
        r = raw.request("POST", f"/v1/tasks/{t['task_id']}/result", params={"lease": t["lease_id"]},
                        content=body_of([b'{"status": "ok"}', res]))
        assert r.status_code == 200, r.text
    assert leftovers(raw) == []

    seen, after = {}, -1
    while len(seen) < len(args):
        page = raw.request("GET", f"/v1/jobs/{meta['job_id']}/results", params={"after": after, "wait": 5})
        frames = wire.unpack_frames(page.content)
        items = json.loads(bytes(frames[0]))["results"]
        for item, payload in zip(items, frames[1:]):
            seen[item["index"]] = bytes(payload)
            after = max(after, item["seq"])
    assert seen == results


def test_a_chunked_body_streams_too(raw):
    """No Content-Length: the frames are still split as they come, and the limit holds."""
    rng = np.random.default_rng(2)
    fn_blob = b"fn" * 10
    args = [rng.bytes(2 * MiB + 1), rng.bytes(10)]
    meta = job_meta("5eed0000c2", fn_blob, len(args))
    body = body_of([json.dumps(meta).encode(), fn_blob, *args])

    def pieces():
        for i in range(0, len(body), 100_000):
            yield body[i:i + 100_000]
    r = raw.request("POST", "/v1/jobs", content=pieces())
    assert r.status_code == 200, r.text
    wid = register(raw)
    tasks, payloads = lease(raw, wid, 2)
    assert sorted(payloads, key=len) == sorted(args, key=len)
    assert leftovers(raw) == []


def test_real_workers_move_big_arrays_byte_exact(make_mesh):
    """Through the whole path: caller -> coordinator -> worker -> coordinator -> caller."""
    m = make_mesh(workers=1)
    client = m.client(output=False)

    @accelerate(client)
    def flip(x):
        return x[::-1] ^ 0x5A

    rng = np.random.default_rng(3)
    big = rng.integers(0, 256, 6 * MiB + 11, dtype=np.uint8)
    assert np.array_equal(flip(big), big[::-1] ^ 0x5A)
    arrays = [rng.integers(0, 256, n, dtype=np.uint8) for n in (5, 3 * MiB, 100, MiB + 1)]
    for a, out in zip(arrays, flip.map(arrays)):
        assert np.array_equal(out, a[::-1] ^ 0x5A)
    assert list((m.root / "data" / "blobs" / "incoming").iterdir()) == []
    client.close()


# ---------------------------------------------------------------- failures -----------

def send_part(m, path: str, declared: int, data: bytes) -> socket.socket:
    """Start a POST announcing ``declared`` bytes and send only ``data``; the socket stays
    open (close it to make the body end short)."""
    s = socket.create_connection(("127.0.0.1", m.port))
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {m.token}\r\n"
            f"Content-Type: application/x-gpumesh-frames\r\nContent-Length: {declared}\r\n\r\n")
    s.sendall(head.encode() + data)
    return s


def test_a_body_cut_short_mid_frame_leaves_nothing_and_the_coordinator_serves_on(raw):
    fn_blob = b"f" * 100
    big = os.urandom(8 * MiB)
    meta = job_meta("5eed0000d3", fn_blob, 1)
    body = body_of([json.dumps(meta).encode(), fn_blob, big])
    s = send_part(raw, "/v1/jobs", len(body), body[:len(body) // 2])
    try:
        # the big frame is being written to its file as it arrives
        wait_for(lambda: leftovers(raw) != [], 10, "a streamed file to appear")
    finally:
        s.close()
    wait_for(lambda: leftovers(raw) == [], 10, lambda: leftovers(raw))
    assert raw.request("GET", "/v1/health").status_code == 200
    assert raw.request("GET", f"/v1/jobs/{meta['job_id']}").status_code == 404
    # the same job, sent whole, is taken
    assert raw.request("POST", "/v1/jobs", content=body).status_code == 200
    assert leftovers(raw) == []
    raw.request("POST", f"/v1/jobs/{meta['job_id']}/cancel")  # no other test leases it


def test_a_result_cut_short_is_dropped_and_the_lease_still_holds(raw):
    fn_blob = b"g" * 100
    meta = job_meta("5eed0000e4", fn_blob, 1)
    assert raw.request("POST", "/v1/jobs",
                       content=body_of([json.dumps(meta).encode(), fn_blob, b"arg"])).status_code == 200
    wid = register(raw)
    tasks, _ = lease(raw, wid, 8)
    (task,) = [t for t in tasks if t["job_id"] == meta["job_id"]]
    result = os.urandom(4 * MiB)
    body = body_of([b'{"status": "ok"}', result])
    path = f"/v1/tasks/{task['task_id']}/result?lease={task['lease_id']}"
    s = send_part(raw, path, len(body), body[:3 * MiB])
    try:
        wait_for(lambda: leftovers(raw) != [], 10, "a streamed file to appear")
    finally:
        s.close()
    wait_for(lambda: leftovers(raw) == [], 10, lambda: leftovers(raw))
    r = raw.request("POST", path, content=body)  # the worker's retry is accepted
    assert r.status_code == 200, r.text
    page = raw.request("GET", f"/v1/jobs/{meta['job_id']}/results", params={"wait": 5})
    frames = wire.unpack_frames(page.content)
    assert bytes(frames[1]) == result


def test_over_the_limit_is_413_before_reading_and_while_streaming(raw):
    message = (f"request body is over the coordinator's limit of {LIMIT_MB} MiB "
               "(set GPUMESH_MAX_BODY_MB on the coordinator to raise it)")
    # Content-Length says so: answered without sending a byte of the body
    s = send_part(raw, "/v1/jobs", (LIMIT_MB + 1) * MiB, b"")
    try:
        s.settimeout(10)
        answer = s.recv(65536).decode()
    finally:
        s.close()
    assert answer.startswith("HTTP/1.1 413"), answer
    assert message in answer
    # chunked, and only the stream shows it: refused, and its file is gone
    fn_blob = b"h" * 10
    meta = job_meta("5eed0000f5", fn_blob, 1)
    body = body_of([json.dumps(meta).encode(), fn_blob, b"\1" * (LIMIT_MB * MiB)])

    def pieces():
        for i in range(0, len(body), MiB):
            yield body[i:i + MiB]
    try:
        r = raw.request("POST", "/v1/jobs", content=pieces())
        assert r.status_code == 413 and r.json()["message"] == message
    except httpx.TransportError:  # the answer may come before the rest could be sent
        pass
    wait_for(lambda: leftovers(raw) == [], 10, lambda: leftovers(raw))
    assert raw.request("GET", f"/v1/jobs/{meta['job_id']}").status_code == 404
    # a frames header naming more than the limit is refused at once (chunked)
    head = wire.frames_header([10, LIMIT_MB * MiB + 1])
    r = raw.request("POST", "/v1/jobs", content=iter([head, b"x" * (INLINE_BLOB_BYTES + 10)]))
    assert r.status_code == 413


@pytest.mark.parametrize("make, words", [
    (lambda big: b"GMX1" + big, "not a gpumesh message"),
    (lambda big: b"GMF9" + big, "wire version 9"),
    (lambda big: wire.FRAMES_MAGIC + (2 ** 32 - 1).to_bytes(4, "little") + big, "header truncated"),
    (lambda big: body_of([b"[1]", big]), "frame 0 must be a JSON object"),
    (lambda big: body_of([b"{nope", big]), "not a gpumesh frames message"),
    (lambda big: body_of([b"{}", big])[:-100], "body is not a gpumesh frames message: frames body truncated"),
])
def test_a_malformed_streamed_body_is_400_and_leaves_nothing(raw, make, words):
    big = os.urandom(INLINE_BLOB_BYTES + 5000)
    body = make(big)
    assert len(body) > INLINE_BLOB_BYTES  # the streaming path, not the one-buffer one
    for path in ("/v1/jobs", "/v1/tasks/abcdef12/result?lease=abcdef12"):
        assert_400(raw.request("POST", path, content=body), words)
    assert leftovers(raw) == []
    assert raw.request("GET", "/v1/health").status_code == 200


def test_a_refused_job_leaves_no_files(raw):
    """Validation after the body was read (wrong fn hash, wrong frame count): 400, and the
    streamed argument files are deleted."""
    fn_blob = os.urandom(INLINE_BLOB_BYTES + 1)
    big = os.urandom(2 * MiB)
    meta = job_meta("5eed0000a6", fn_blob, 1)
    bad_hash = dict(meta, fn="0" * 64)
    assert_400(raw.request("POST", "/v1/jobs", content=body_of([json.dumps(bad_hash).encode(), fn_blob, big])),
               "does not match")
    assert_400(raw.request("POST", "/v1/jobs", content=body_of([json.dumps(meta).encode(), fn_blob, big, big])),
               "n_tasks")
    assert leftovers(raw) == []
    blobs = raw.root / "data" / "blobs"
    assert not (blobs / "args" / meta["job_id"]).exists()
    assert raw.request("HEAD", f"/v1/blobs/{meta['fn']}").status_code == 404
