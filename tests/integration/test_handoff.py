"""Same-machine handoff through real processes: big arguments and results change hands as
files in the coordinator's data directory (gpumesh.handoff), and every way that cannot
happen falls back to HTTP with the same values.

Whether a payload came as a file shows in what its arrays are views of: a mapped file
(``mmap``) or a receive buffer (``bytearray``). A task reports that for its argument, the
test checks it for the result.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
import sys

import cloudpickle
import httpx
import numpy as np
import pytest

from gpumesh import accelerate, handoff, wire
from gpumesh.handoff import Handoff
from gpumesh.limits import HANDOFF_MIN_BYTES
from gpumesh.protocol import ResultItem, TaskGrant

from ..conftest import Mesh, files_under, wait_for

cloudpickle.register_pickle_by_value(sys.modules[__name__])

N = HANDOFF_MIN_BYTES // 4 + 1000  # float32: just over the handoff threshold


def origin(a) -> str:
    """What the memory of array ``a`` belongs to ("mmap", "bytearray", "ndarray"...)."""
    b = a
    while True:
        nxt = b.base if isinstance(b, np.ndarray) else getattr(b, "obj", None)
        if nxt is None:
            return type(b).__name__
        b = nxt


def inc_and_say(a):
    return a + 1, origin(a)


def mapping(a) -> list[str] | None:
    """The /proc/self/maps line (split in its fields) of the memory of array ``a``."""
    addr = a.__array_interface__["data"][0]
    with open("/proc/self/maps") as fh:
        for line in fh:
            fields = line.split(None, 5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= addr < hi:
                return fields
    return None


def backing(a) -> str:
    """What the memory of array ``a`` is mapped from, as /proc/self/maps names it
    ("" for anonymous memory)."""
    fields = mapping(a)
    if fields is None:
        return "?"
    return fields[5].strip() if len(fields) > 5 else ""


def held_memory_files(pid: int) -> list[str]:
    """The gpumesh memory files process ``pid`` has open or mapped."""
    held = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if "memfd:gpumesh" in target:
            held.append(f"fd {fd}: {target}")
    with open(f"/proc/{pid}/maps") as fh:
        held += [line.strip() for line in fh if "memfd:gpumesh" in line]
    return held


def inc_and_tell(a):
    a += 1  # the task's arguments are writable, whatever they were mapped from
    return a, origin(a), backing(a)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    m = Mesh(tmp_path_factory.mktemp("handoff"))
    m.start()
    m.add_worker()
    yield m
    m.stop()


def drop_dir(m: Mesh):
    return m.root / "data" / "blobs" / "handoff"


def leftovers(m: Mesh) -> list[str]:
    """Files in the drop directory but the probe and the pool's (released result files
    kept for senders to write over, or set aside for that: no payload of a live job)."""
    return sorted(p.name for p in drop_dir(m).iterdir() if p.name != handoff.PROBE
                  and not handoff.FREE.fullmatch(p.name) and not handoff.HELD.fullmatch(p.name))


def test_big_arguments_and_results_travel_as_files(mesh):
    client = mesh.client(output=False)
    f = accelerate(client)(inc_and_say)
    a = np.arange(N, dtype=np.float32)
    try:
        out, arg_origin = f(a)
        many = f.map([np.full(N, i, np.float32) for i in range(3)])
        small, small_origin = f(np.zeros(10, np.float32))
        assert client.handoff is not None
    finally:
        client.close()
    assert np.array_equal(out, a + 1) and out.dtype == np.float32
    assert arg_origin == "mmap" and origin(out) == "mmap"
    out[:5] = -1  # the caller's array is writable: copy-on-write over the store's file
    assert out[0] == -1
    assert [float(v[0]) for v, _ in many] == [1.0, 2.0, 3.0]
    assert {o for _, o in many} == {"mmap"}
    assert small_origin == "bytearray" and origin(small) != "mmap"  # small ones ride in the body
    wait_for(lambda: leftovers(mesh) == [], 5, lambda: leftovers(mesh))


def test_a_caller_with_handoff_off_sends_and_receives_bytes(mesh, monkeypatch):
    monkeypatch.setenv("GPUMESH_HANDOFF", "0")
    client = mesh.client(output=False)
    try:
        out, arg_origin = accelerate(client)(inc_and_say)(np.ones(N, np.float32))
        assert client.handoff is None
    finally:
        client.close()
    assert float(out.sum()) == 2.0 * N
    # the worker still maps the stored file; the caller's result came over HTTP
    assert arg_origin == "mmap" and origin(out) == "bytearray"


@pytest.mark.skipif(not os.path.exists("/proc/self/maps") or not hasattr(os, "memfd_create"),
                    reason="shows the shared memory through Linux's /proc")
def test_a_worker_with_handoff_off_gets_bytes_over_http(tmp_path):
    m = Mesh(tmp_path / "m")
    m.env["GPUMESH_HANDOFF"] = "0"  # the worker's environment (the caller hands off)
    m.start()
    try:
        worker = m.add_worker(slots=2)  # (a lease answer may then carry two tasks' arguments)
        client = m.client(output=False)
        try:
            f = accelerate(client)(inc_and_tell)
            out, arg_origin, arg_backing = f(np.ones(N, np.float32))
            # big arguments of several tasks, some in one answer: each task sees its own
            many = f.map([np.full(N, i, np.float32) for i in range(4)])
            small = f(np.zeros(8, np.float32))
            # a script job's big payload reaches its stdin from that shared memory
            script = tmp_path / "count.py"
            script.write_text("import json, sys\n"
                              "data = json.load(sys.stdin)\n"
                              "print(json.dumps({'n': len(data['s']), 'last': data['s'][-3:]}))\n")
            text = "ab" * 600_000 + "xyz"
            job = client.submit(script=str(script), payloads=[{"s": text}])
            scripted = client.wait(job, timeout=60)
        finally:
            client.close()
        # An idle worker keeps none of that shared memory (its lease loop once held the
        # last big answer until the next task came).
        wait_for(lambda: held_memory_files(worker.p.pid) == [], 10,
                 lambda: held_memory_files(worker.p.pid))
    finally:
        m.stop()
    assert [r["result"] for r in scripted] == [{"n": len(text), "last": "xyz"}]
    assert float(out[-1]) == 2.0 and float(out.sum()) == 2.0 * N
    # downloaded over HTTP, though the caller handed it off; the agent read it into shared
    # memory, which the task process mapped instead of reading it from a socket
    # (the spawn runtime passes no descriptors: the agent writes the arguments into a
    # file of its spool, which the task maps)
    spawn = os.environ.get("GPUMESH_RUNTIME") == "spawn"
    assert arg_origin == "mmap", arg_backing
    if spawn:
        assert "/spool/" in arg_backing and arg_backing.split(" ")[0].endswith(".part"), arg_backing
    else:
        assert arg_backing.startswith("/memfd:gpumesh-args"), arg_backing
    assert [(float(v.min()), float(v.max())) for v, _, _ in many] == [(i + 1.0, i + 1.0) for i in range(4)]
    if not spawn:
        assert {b.split(" ")[0] for _, _, b in many} == {"/memfd:gpumesh-args"}
    assert small[1] == "bytearray" and small[2] in ("", "[heap]")  # small: still the socket
    # uploaded over HTTP, yet a file in the store like any big payload: the caller maps it
    assert origin(out) == "mmap"


def test_a_wrong_handoff_directory_falls_back_to_http(mesh, tmp_path):
    """A caller whose idea of the coordinator's directories is wrong (it moved, or another
    machine mounts a look-alike path) still gets its values, and stops handing off."""
    client = mesh.client(output=False)
    real = Handoff.probe(client.http)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    try:
        client._handoff = Handoff(real.blob_dir, elsewhere)  # uploads: a directory it never reads
        out, arg_origin = accelerate(client)(inc_and_say)(np.ones(N, np.float32))
        assert client.handoff is None and list(elsewhere.iterdir()) == []
        assert float(out[0]) == 2.0 and arg_origin == "mmap"
        client._handoff = Handoff(elsewhere, real.drop_dir)  # downloads: files not found there
        out, arg_origin = accelerate(client)(inc_and_say)(np.full(N, 2, np.float32))
        assert float(out[0]) == 3.0 and origin(out) == "bytearray"
    finally:
        client.close()


def test_a_handoff_file_that_cannot_be_written_sends_that_calls_bytes_over_http(mesh, monkeypatch):
    """A full disk under the handoff directory (ENOSPC halfway through a map's arguments)
    does not fail the call: its arguments go in the body, the files written before are
    gone, and the next call hands off again."""
    client = mesh.client(output=False)
    real, n = Handoff.write, [0]

    def write(self, chunks):
        n[0] += 1
        if n[0] == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, chunks)
    monkeypatch.setattr(Handoff, "write", write)
    f = accelerate(client)(inc_and_say)
    try:
        many = f.map([np.full(N, i, np.float32) for i in range(3)])
        assert client.handoff is not None, "handing off stays on"
        out, arg_origin = f(np.ones(N, np.float32))
    finally:
        client.close()
    assert [float(v[0]) for v, _ in many] == [1.0, 2.0, 3.0]
    assert float(out[0]) == 2.0 and arg_origin == "mmap" and n[0] == 3
    wait_for(lambda: leftovers(mesh) == [], 5, lambda: leftovers(mesh))


# ---------------------------------------------------------------- the HTTP side -------

def post(m: Mesh, path: str, **kw) -> httpx.Response:
    return httpx.post(m.url + path, headers={"authorization": f"Bearer {m.token}"}, timeout=10, **kw)


def body_of(frames) -> bytes:
    chunks, _ = wire.pack_frames(frames)
    return b"".join(bytes(c) for c in chunks)


def submit(m: Mesh, meta: dict, frames: list) -> httpx.Response:
    fn = wire.dumps(len, code=True).to_bytes()
    meta = {"job_id": meta.pop("job_id"), "fn": hashlib.sha256(fn).hexdigest(), "fn_inline": True,
            "require_worker": False, **meta}
    return post(m, "/v1/jobs", content=body_of([json.dumps(meta).encode(), fn, *frames]))


@pytest.fixture
def bare(tmp_path):
    """A coordinator without workers: the test plays caller and worker over HTTP."""
    m = Mesh(tmp_path / "bare")
    m.start()
    yield m
    m.stop()


def test_handed_off_files_through_the_api(bare):
    h = Handoff.from_answer(httpx.get(bare.url + "/v1/handoff", timeout=5,
                                      headers={"authorization": f"Bearer {bare.token}"}).json())
    assert h is not None
    big = wire.dumps(((b"a" * (2 * 2**20),), {}))
    name = h.write(big.chunks)
    # frame numbers count from the first frame after the meta: 0 is the inline function
    r = submit(bare, {"job_id": "00aa", "n_tasks": 2, "handoff_files": {"1": name}},
               [b"", wire.dumps(((1,), {})).to_bytes()])
    assert r.status_code == 200, r.text
    assert leftovers(bare) == []  # claimed: renamed into the store
    wid = post(bare, "/v1/workers", json={"hostname": "fake", "slots": 2}).json()["id"]
    r = post(bare, f"/v1/workers/{wid}/lease", json={"slots": 2, "wait": 2, "handoff": True})
    frames = wire.unpack_frames(r.content)
    tasks = json.loads(bytes(frames[0]))["tasks"]
    assert [t["index"] for t in tasks] == [0, 1]
    assert frames[1].nbytes == 0 and tasks[0]["args_file"].startswith("args/00aa/")
    assert bytes(h.open(tasks[0]["args_file"])) == big.to_bytes()
    assert "args_file" not in tasks[1] and frames[2].nbytes > 0  # small: in the body
    # the worker hands its result off too; the caller asks for paths
    result = wire.dumps(np.arange(N, dtype=np.float32))
    rname = h.write(result.chunks)
    meta = {"status": "ok", "handoff_files": {"0": rname}}
    r = post(bare, f"/v1/tasks/{tasks[0]['task_id']}/result", params={"lease": tasks[0]["lease_id"]},
             content=body_of([json.dumps(meta).encode(), b""]))
    assert r.status_code == 200, r.text
    page = httpx.get(bare.url + "/v1/jobs/00aa/results", params={"handoff": 1, "wait": 2},
                     headers={"authorization": f"Bearer {bare.token}"}, timeout=10)
    items = json.loads(bytes(wire.unpack_frames(page.content)[0]))["results"]
    assert items[0]["file"].startswith("results/00aa/") and items[0]["has_payload"] is False
    assert np.array_equal(wire.loads(h.open(items[0]["file"])), np.arange(N, dtype=np.float32))
    plain = httpx.get(bare.url + "/v1/jobs/00aa/results", params={"wait": 2},
                      headers={"authorization": f"Bearer {bare.token}"}, timeout=10)
    frames = wire.unpack_frames(plain.content)
    assert "file" not in json.loads(bytes(frames[0]))["results"][0]
    assert bytes(frames[1]) == result.to_bytes()  # without ?handoff=1: the bytes
    assert leftovers(bare) == []


def test_payload_references_through_the_api_under_refs(bare):
    """The same exchange with the one key: the caller and the worker name their files
    only under ``refs`` (so the coordinator must read it), and the coordinator's answers
    name the store's files under ``refs`` (and under the old keys, for older peers)."""
    h = Handoff.from_answer(httpx.get(bare.url + "/v1/handoff", timeout=5,
                                      headers={"authorization": f"Bearer {bare.token}"}).json())
    big = wire.dumps(((b"b" * (2 * 2**20),), {}))
    name = h.write(big.chunks)
    refs = {"1": {"kind": "handoff", "name": name, "size": big.size}}
    r = submit(bare, {"job_id": "00cc", "n_tasks": 2, "refs": refs},
               [b"", wire.dumps(((1,), {})).to_bytes()])
    assert r.status_code == 200, r.text
    assert leftovers(bare) == []
    wid = post(bare, "/v1/workers", json={"hostname": "fake", "slots": 2}).json()["id"]
    r = post(bare, f"/v1/workers/{wid}/lease", json={"slots": 2, "wait": 2, "handoff": True})
    frames = wire.unpack_frames(r.content)
    tasks = json.loads(bytes(frames[0]))["tasks"]
    path = tasks[0]["args_file"]
    assert path.startswith("args/00cc/") and frames[1].nbytes == 0
    assert tasks[0]["refs"] == {"args": {"kind": "store", "path": path}}
    assert "refs" not in tasks[1] and frames[2].nbytes > 0
    ref = TaskGrant.from_dict(tasks[0]).args_ref(h.blob_dir)
    assert bytes(ref.open()) == big.to_bytes()
    ref.release()
    result = wire.dumps(np.arange(N, dtype=np.float32))
    rname = h.write(result.chunks)
    meta = {"status": "ok", "refs": {"0": {"kind": "handoff", "name": rname, "size": result.size}}}
    r = post(bare, f"/v1/tasks/{tasks[0]['task_id']}/result", params={"lease": tasks[0]["lease_id"]},
             content=body_of([json.dumps(meta).encode(), b""]))
    assert r.status_code == 200, r.text
    page = httpx.get(bare.url + "/v1/jobs/00cc/results", params={"handoff": 1, "wait": 2},
                     headers={"authorization": f"Bearer {bare.token}"}, timeout=10)
    item = json.loads(bytes(wire.unpack_frames(page.content)[0]))["results"][0]
    assert item["refs"] == {"result": {"kind": "store", "path": item["file"], "size": result.size}}
    assert item["file"].startswith("results/00cc/") and item["has_payload"] is False
    got = ResultItem.from_dict(item)
    assert np.array_equal(wire.loads(h.open_result(got)), np.arange(N, dtype=np.float32))
    old = ResultItem.from_dict({k: v for k, v in item.items() if k != "refs"})
    assert np.array_equal(wire.loads(h.open_result(old)),
                          np.arange(N, dtype=np.float32))  # as from a coordinator before refs
    with pytest.raises(FileNotFoundError, match="refs.result: 'path'"):
        h.open_result(ResultItem(0, "t1", "done", 0,
                                 refs={"result": {"kind": "store", "path": "../gpumesh.db"}}))
    assert leftovers(bare) == []


MISSING = "a" * 24 + ".part"


@pytest.mark.parametrize("refs, status, words, kept", [
    ({"1": {"kind": "handoff", "name": "../../gpumesh.db"}}, 400, "refs.1: 'name' must be a handoff", True),
    ({"1": {"kind": "store", "path": "../gpumesh.db"}}, 400, "refs.1: 'path' must be a payload path", True),
    # a sender may not point the coordinator at its own store's files
    ({"1": {"kind": "store", "path": "args/00aa/x"}}, 400, "refs.1: a sender may name only handoff", True),
    ({"1": {"kind": "shm", "path": "/dev/shm/x"}}, 400, "refs.1: 'kind' must be handoff or store", True),
    ({"5": {"kind": "handoff", "name": MISSING}}, 400, "refs: '5' is not a frame number", True),
    ({"1": "WRITTEN"}, 400, "refs.1: a payload reference must be an object", True),
    ({"1": {"kind": "handoff", "name": MISSING}}, 409, "handoff_missing", True),
    # the file is not the one the reference names: refused, and the claimed file goes
    ({"1": {"kind": "handoff", "name": "WRITTEN", "size": 99}}, 400,
     "refs.1: 'size' is 99 but the handoff file holds 7 bytes", False),
])
def test_bad_refs_are_refused_naming_the_field_and_store_nothing(bare, refs, status, words, kept):
    h = Handoff.from_answer(httpx.get(bare.url + "/v1/handoff", timeout=5,
                                      headers={"authorization": f"Bearer {bare.token}"}).json())
    written = h.write([b"payload"])
    refs = json.loads(json.dumps(refs))  # (the parameters are shared)
    for wire_form in refs.values():
        if isinstance(wire_form, dict) and wire_form.get("name") == "WRITTEN":
            wire_form["name"] = written
    r = submit(bare, {"job_id": "00dd", "n_tasks": 2, "refs": refs}, [b"", b""])
    assert r.status_code == status, r.text
    assert words in r.text
    assert httpx.get(bare.url + "/v1/jobs/00dd", timeout=5,
                     headers={"authorization": f"Bearer {bare.token}"}).status_code == 404
    assert leftovers(bare) == ([written] if kept else [])
    h.discard(written)


@pytest.mark.parametrize("files, frame, status, words, kept", [
    ({"1": "../../gpumesh.db"}, b"", 400, "not a handoff file name", True),
    ({"1": MISSING}, b"", 409, "handoff_missing", True),
    ({"5": MISSING}, b"", 400, "not a frame number", True),
    ({"x": MISSING}, b"", 400, "not a frame number", True),
    ({"1": "WRITTEN"}, b"not empty", 400, "must be empty", True),
    ("not a map", b"", 400, "handoff_files", True),
    # the first file is claimed, the second is missing: the claimed one goes with the request
    ({"1": "WRITTEN", "2": MISSING}, b"", 409, "handoff_missing", False),
])
def test_bad_handoff_references_are_refused_and_store_nothing(bare, files, frame, status, words, kept):
    h = Handoff.from_answer(httpx.get(bare.url + "/v1/handoff", timeout=5,
                                      headers={"authorization": f"Bearer {bare.token}"}).json())
    written = h.write([b"payload"])
    if isinstance(files, dict):
        files = {k: written if v == "WRITTEN" else v for k, v in files.items()}
    r = submit(bare, {"job_id": "00bb", "n_tasks": 2, "handoff_files": files}, [frame, b""])
    assert r.status_code == status, r.text
    assert words in r.text
    assert httpx.get(bare.url + "/v1/jobs/00bb", timeout=5,
                     headers={"authorization": f"Bearer {bare.token}"}).status_code == 404
    # what a refused request claimed is deleted with it; what it did not claim stays the
    # sender's (who still has the bytes and sends them in the body)
    assert leftovers(bare) == ([written] if kept else [])
    h.discard(written)


def test_the_handoff_directories_need_a_token(bare):
    assert httpx.get(bare.url + "/v1/handoff", timeout=5).status_code == 401


def test_a_script_task_reads_a_big_payload_from_the_stores_file(mesh, tmp_path):
    """Script jobs: a payload the store keeps as a file reaches the script's stdin whole
    when the worker takes it by path."""
    script = tmp_path / "count.py"
    script.write_text("import json, sys\n"
                      "data = json.load(sys.stdin)\n"
                      "print(json.dumps({'n': len(data['s']), 'last': data['s'][-3:]}))\n")
    text = "ab" * 300_000 + "xyz"  # a 600 KB JSON payload: over the inline limit
    client = mesh.client(output=False)
    try:
        job = client.submit(script=str(script), payloads=[{"s": text}, {"s": "tiny"}])
        results = client.wait(job, timeout=60)
        post(mesh, f"/v1/jobs/{job}/release")  # a submitted job stays for `gpumesh retry` else
    finally:
        client.close()
    assert [r["result"] for r in sorted(results, key=lambda r: r["index"])] == [
        {"n": len(text), "last": "xyz"}, {"n": 4, "last": "iny"}]


def test_a_worker_that_cannot_open_the_arguments_file_hands_the_task_back(bare):
    """The stored file is gone (deleted behind the coordinator's back): the worker neither
    hangs nor crashes; the task is re-queued and, attempts spent, fails saying why."""
    big = wire.dumps(((b"a" * (2 * 2**20),), {})).to_bytes()  # stored as a file
    r = submit(bare, {"job_id": "00cc", "n_tasks": 1}, [big])
    assert r.status_code == 200, r.text
    (stored,) = (bare.root / "data" / "blobs" / "args" / "00cc").iterdir()
    stored.unlink()
    bare.add_worker()
    page = None
    for _ in range(30):
        page = httpx.get(bare.url + "/v1/jobs/00cc/results", params={"wait": 2},
                         headers={"authorization": f"Bearer {bare.token}"}, timeout=10)
        if page.status_code == 200 and json.loads(bytes(wire.unpack_frames(page.content)[0]))["results"]:
            break
    (item,) = json.loads(bytes(wire.unpack_frames(page.content)[0]))["results"]
    assert item["state"] == "failed" and item["error"]["kind"] == "lost"
    assert "could not open the task's arguments" in item["error"]["message"]
    assert bare.alive() == 1  # the worker is fine


# ---------------------------------------------------------------- nothing left behind --

def stored(m: Mesh) -> list[str]:
    """Every file and folder under the store's payload directories (args/, results/).
    The coordinator's reaper may remove a folder while this walks it: then it looks
    again, so a walk that met a vanishing folder never counts as a result."""
    blobs = m.root / "data" / "blobs"
    while True:
        try:
            return sorted(str(p.relative_to(blobs)) for sub in ("args", "results")
                          if (blobs / sub).exists() for p in (blobs / sub).rglob("*"))
        except FileNotFoundError:
            continue


def big_or_raise(i):
    import numpy as np
    if i == 3:
        raise KeyError(i)
    return np.full(600_000, i, np.float32)  # 2.4 MB: stored as a file, handed off


def test_a_failed_call_or_map_leaves_no_payloads_behind(mesh):
    client = mesh.client(output=False)
    f = accelerate(client)(big_or_raise)
    try:
        for _ in range(3):  # a cancelled task may be killed while writing its result
            with pytest.raises(KeyError):
                f.map(range(8))
        with pytest.raises(TypeError):
            accelerate(client)(inc_and_say)("not an array" * 200_000)  # big argument, raises
    finally:
        client.close()
    wait_for(lambda: stored(mesh) == [] and leftovers(mesh) == [], 10,
             lambda: (stored(mesh), leftovers(mesh)))


def test_a_script_that_exits_right_after_its_call_leaves_no_payloads_behind(mesh, tmp_path):
    script = tmp_path / "one_call.py"
    script.write_text(
        "import numpy as np\n"
        "from gpumesh import GPUMesh, accelerate\n"
        f"m = GPUMesh({mesh.url!r}, token={mesh.token!r}, output=False)\n"
        "@accelerate(m)\n"
        "def twice(a):\n"
        "    return a * 2\n"
        "print(float(twice(np.ones(600_000, np.float32))[-1]))\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, GPUMESH_HANDOFF="0"))  # over HTTP: same promise
    assert out.returncode == 0 and out.stdout.strip() == "2.0", out.stderr
    # released before the interpreter exited: nothing waits for the 24 h retention
    wait_for(lambda: stored(mesh) == [], 5, lambda: stored(mesh))


# ---------------------------------------------------------------- the pool --------------
def full(i):
    import numpy as np
    return np.full(600_000, i, np.float32)  # 2.4 MB: a store file the caller maps


def inode_of(a) -> int:
    """The inode of the file array ``a`` is mapped from (0: anonymous memory)."""
    fields = mapping(a)
    assert fields is not None, "not mapped"
    return int(fields[4])


def pool_inodes(m: Mesh) -> set[int]:
    out = set()
    for p in drop_dir(m).iterdir():
        if handoff.FREE.fullmatch(p.name):
            try:
                out.add(p.stat().st_ino)
            except FileNotFoundError:
                pass
    return out


def stored_inodes(m: Mesh, sub: str = "results") -> set[int]:
    """The inodes of the store's payload files under ``sub`` (``results``, ``args``)."""
    out = set()
    for p in files_under(m.root / "data" / "blobs" / sub):
        try:
            out.add(p.stat().st_ino)
        except FileNotFoundError:  # (released meanwhile)
            pass
    return out


def test_a_held_result_never_changes_while_released_files_are_written_over(mesh):
    """A released result file nobody maps goes to the pool and the next result is written
    over it (the same inode comes back); one the caller still maps is never pooled, and its
    values never change, however many results are written after it."""
    client = mesh.client(output=False)
    f = accelerate(client)(full)
    try:
        held = f(0)
        held_ino = inode_of(held)
        reused = 0
        for i in range(1, 7):
            r = f(i)
            assert origin(r) == "mmap" and float(r.min()) == float(r.max()) == i
            ino = inode_of(r)
            assert ino != held_ino
            del r  # the map goes, and its lock with it: released, the file may be pooled
            wait_for(lambda ino=ino: ino in pool_inodes(mesh), 10, lambda: pool_inodes(mesh))
            pool = pool_inodes(mesh)
            nxt = f(100 + i)
            reused += inode_of(nxt) in pool  # written over a pooled file (this one, or one that fits better)
            assert float(nxt.min()) == float(nxt.max()) == 100 + i
            del nxt
            assert held_ino not in pool_inodes(mesh)
        assert reused == 6
        assert float(held.min()) == float(held.max()) == 0.0  # never changed under the caller
    finally:
        client.close()


def half_mib(i):
    import numpy as np
    return np.full(131_072, i, np.float32)  # 512 KiB: over the store's inline limit, under 1 MiB


def test_a_result_just_over_the_inline_limit_is_handed_off_and_pooled(mesh):
    """A result the store keeps as a file, however small (512 KiB here, under the 1 MiB
    threshold of before), is written by its task into a file of the drop directory, over
    a pooled one once there is one: its released file is pooled, and the next result of
    its size comes back in that very file. (Posted as an HTTP body, the coordinator
    would write it into a new file of its own; a file under the old threshold was never
    pooled.)"""
    client = mesh.client(output=False)
    f = accelerate(client)(half_mib)
    try:
        first = f(1)
        assert origin(first) == "mmap" and first.nbytes == 512 * 1024
        assert float(first.min()) == float(first.max()) == 1.0
        ino = inode_of(first)
        del first  # released and unmapped: its file may go to the pool
        wait_for(lambda: ino in pool_inodes(mesh), 10, lambda: pool_inodes(mesh))
        second = f(2)
        assert inode_of(second) == ino  # the task wrote over the pooled file
        assert float(second.min()) == float(second.max()) == 2.0 and second.nbytes == 512 * 1024
    finally:
        client.close()


def test_a_caller_that_does_not_lock_its_maps_never_has_its_files_pooled(mesh):
    """A caller from before the pool maps without locks (no map-locks header): its
    results' files are deleted when released, never written over."""
    client = mesh.client(output=False)
    f = accelerate(client)(full)
    try:
        f(0)  # connects
        client.http._headers.pop(handoff.MAP_LOCKS_HEADER)
        held = f(5)
        ino = inode_of(held)
        wait_for(lambda: ino not in stored_inodes(mesh), 10, lambda: stored_inodes(mesh))
        assert ino not in pool_inodes(mesh)
        for i in range(3):  # results written after it cannot be written over it
            assert float(f(10 + i).max()) == 10 + i
        assert float(held.min()) == float(held.max()) == 5.0
    finally:
        client.close()


# ---------------------------------------------------------------- the pool: arguments --
ARG_N = 3 * (1 << 20) // 4 + 777  # float32: ~3 MiB, bigger than any other test's payload
STASH_N = 5 * (1 << 20) // 4 + 333  # ~5 MiB: no other payload fits where these files do
_stash: list = []  # (in the task process: what a kept process holds on to)


def arg_inode(a) -> int:
    """The inode of the store file the task's argument is mapped from."""
    return inode_of(a)


def stash_and_watch(a, report: str):
    """Keep argument ``a`` (a map of its store file) in this process beyond the call, and
    check its values every 20 ms from a thread, appending each verdict to ``report``."""
    import threading
    import time
    _stash.append(a)
    want = float(a[0])

    def watch():
        while True:
            ok = float(a.min()) == float(a.max()) == want
            with open(report, "a") as fh:
                fh.write("ok\n" if ok else f"changed: {float(a.min())}..{float(a.max())}\n")
            time.sleep(0.02)
    threading.Thread(target=watch, daemon=True).start()
    return inode_of(a), os.getpid()


def test_a_released_arguments_file_nobody_maps_is_written_over_by_the_next_call(mesh):
    """Once its job is released (the task process that mapped it is gone), an arguments'
    file goes to the pool, and the next call's arguments are written over it: each call
    maps the same inode, with its own values."""
    client = mesh.client(output=False)
    f = accelerate(client)(arg_inode)
    try:
        first = f(np.full(ARG_N, 1, np.float32))
        wait_for(lambda: first in pool_inodes(mesh), 10, lambda: pool_inodes(mesh))
        for i in range(2, 6):
            assert f(np.full(ARG_N, i, np.float32)) == first
            wait_for(lambda: first in pool_inodes(mesh), 10, lambda: pool_inodes(mesh))
        assert f.map([np.full(ARG_N, 9, np.float32)]) == [first]  # a map's tasks too
    finally:
        client.close()


def test_an_argument_array_a_kept_process_holds_is_never_written_over(mesh, tmp_path):
    """An isolation="job" task keeps its argument array (a map of the store's file) after
    its call, and its process outlives the job: released, the file is set aside, never
    pooled, however many payloads senders write after it; the array keeps its values."""
    client = mesh.client(output=False)
    f = accelerate(client, isolation="job")(stash_and_watch)
    report = tmp_path / "report"
    a = np.full(STASH_N, 7, np.float32)
    written: list[str] = []
    try:
        ino, pid = f(a, str(report))
        wait_for(lambda: ino not in stored_inodes(mesh, "args"), 10,
                 lambda: stored_inodes(mesh, "args"))  # released
        payload = np.full(STASH_N + 1000, 3, np.float32)  # fits the file it would take
        for _ in range(4):  # senders: each takes a pooled file that fits, if there is one
            written.append(handoff.write_file(drop_dir(mesh), [payload]))
        seen = len(report.read_text().splitlines())
        wait_for(lambda: len(report.read_text().splitlines()) >= seen + 3, 10,
                 lambda: report.read_text())
        verdicts = set(report.read_text().splitlines())
        assert verdicts == {"ok"}, verdicts
        assert ino not in {os.stat(drop_dir(mesh) / n).st_ino for n in written} | pool_inodes(mesh)
        os.kill(pid, 0)  # (the process that holds it is still there)
    finally:
        for name in written:
            handoff.discard(drop_dir(mesh), name)
        client.close()


def test_arguments_a_worker_got_over_http_are_never_pooled(tmp_path):
    """A worker that does not hand off (another machine, or GPUMESH_HANDOFF=0) gets the
    arguments' bytes streamed from the store's file: released, the file is deleted, not
    pooled (the coordinator might still be reading it)."""
    m = Mesh(tmp_path / "m")
    m.env["GPUMESH_HANDOFF"] = "0"  # the worker's environment (the caller hands off)
    m.start()
    try:
        m.add_worker()
        client = m.client(output=False)
        try:
            f = accelerate(client)(float_sum)
            for i in range(1, 4):
                assert f(np.full(ARG_N, i, np.float32)) == float(i * ARG_N)
                wait_for(lambda: stored(m) == [], 10, lambda: stored(m))  # released
                aside = [p.name for p in drop_dir(m).iterdir() if handoff.HELD.fullmatch(p.name)]
                assert pool_inodes(m) == set() and aside == []
        finally:
            client.close()
    finally:
        m.stop()


def float_sum(a) -> float:
    return float(a.sum(dtype=np.float64))


def test_a_call_that_moved_files_releases_them_at_once(mesh, monkeypatch):
    """Its files go back to the pool before the next call's big payloads are written,
    not after the caller's release batch (here made far longer than the wait)."""
    import gpumesh.client.native as native
    monkeypatch.setattr(native, "RELEASE_BATCH_S", 600.0)
    client = mesh.client(output=False)
    try:
        out, _ = accelerate(client)(inc_and_say)(np.zeros(N, np.float32))  # in and out as files
        assert float(out[-1]) == 1.0
        del out
        wait_for(lambda: stored(mesh) == [], 10, lambda: stored(mesh))
    finally:
        client.close()
