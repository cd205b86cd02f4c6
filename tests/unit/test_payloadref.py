"""gpumesh.payloadref: every kind of payload reference opens to the same bytes and gives
back what it holds when released; references that name no payload say which field."""

from __future__ import annotations

import json
import os

import pytest

from gpumesh import handoff, payloadref, wire
from gpumesh.payloadref import BadRef, PayloadRef
from gpumesh.protocol import TaskGrant
from gpumesh.worker import membody

DATA = bytes(range(256)) * 4096  # 1 MiB, bigger than HANDOFF_MIN_BYTES


def _fd_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _write(path, data: bytes = DATA) -> str:
    with open(path, "wb") as fh:
        fh.write(data)
    return str(path)


def test_inline_opens_to_its_bytes_and_is_gone_after_release():
    ref = PayloadRef.inline(bytearray(DATA))
    assert len(ref) == len(DATA) and bytes(ref.open()) == DATA
    ref.release()
    assert ref.data is None
    with pytest.raises(BadRef, match="already released"):
        ref.open()
    with pytest.raises(BadRef, match="inline payload travels as bytes"):
        PayloadRef.inline(b"x").to_meta()


def test_store_file_maps_a_range_copy_on_write_and_leaves_the_file(tmp_path):
    (tmp_path / "res").mkdir()
    path = _write(tmp_path / "res" / "p1", b"head" + DATA)
    ref = payloadref.store_file(tmp_path, "res/p1")
    ref.offset, ref.size = 4, len(DATA)
    view = ref.open()
    assert bytes(view) == DATA
    view[0] = 255  # writable, and the store's file is untouched
    with open(path, "rb") as fh:
        assert fh.read(5) == b"head\x00"
    ref.pin()
    fd = ref.fd
    assert _fd_open(fd)
    ref.release()
    assert not _fd_open(fd)  # the descriptor pin() opened is closed
    assert os.path.exists(path)  # the file is the store's
    for rel in ("/etc/passwd", "../x", "a/../../x", "", None, 3):
        with pytest.raises(BadRef, match="not a payload path"):
            payloadref.store_file(tmp_path, rel)


def test_pinned_store_file_reads_after_the_file_is_removed(tmp_path):
    path = _write(tmp_path / "p")
    ref = PayloadRef("store", path=path).pin()
    os.unlink(path)
    meta, fds = ref.to_meta()
    assert meta == {"kind": "store", "offset": 0, "fd": 0} and fds == [ref.fd]
    assert bytes(ref.open()) == DATA
    passed = os.dup(fds[0])  # the task process's copy of the descriptor
    theirs = payloadref.from_meta(meta, [passed])
    assert bytes(theirs.open()) == DATA
    theirs.release()
    assert not _fd_open(passed)
    ref.release()


def test_handoff_file_is_removed_on_release(tmp_path):
    name = handoff.write_file(tmp_path, [DATA[:10], DATA[10:]])
    ref = PayloadRef("handoff", path=tmp_path / name, owned=True)
    view = ref.open()
    ref.release()
    assert not (tmp_path / name).exists()
    assert bytes(view) == DATA  # a map outlives its file
    ref.release()  # twice: nothing happens


def test_handoff_not_owned_stays(tmp_path):
    path = _write(tmp_path / "p")
    ref = payloadref.from_meta({"kind": "handoff", "path": path})
    assert bytes(ref.open()) == DATA
    ref.release()
    assert os.path.exists(path)  # the sender's to remove


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="memfd is Linux's")
def test_shm_memory_file_crosses_as_a_descriptor_and_is_closed_by_the_receiver():
    body = membody.MemBody(len(DATA) + 64)
    body[64:] = DATA
    sender = PayloadRef.shared(body, 64, len(DATA))
    assert bytes(sender.open()) == DATA  # in this process: a view of the buffer itself
    meta, fds = sender.to_meta()
    assert meta == {"kind": "shm", "offset": 64, "size": len(DATA), "fd": 0}
    assert fds == [body.fd]
    passed = os.dup(fds[0])  # what SCM_RIGHTS gives the receiver
    receiver = payloadref.from_meta(meta, [passed])
    view = receiver.open()
    receiver.release()
    assert not _fd_open(passed)
    assert bytes(view) == DATA
    sender.release()
    assert _fd_open(body.fd)  # the agent's buffer closes its file itself, once unused
    with pytest.raises(BadRef, match="memory file has no 'path'"):
        PayloadRef.shared(body, 0, 1).to_meta(by_path=True)


def test_shm_file_is_the_portable_kind_mapped_by_path_and_unlinked(tmp_path):
    body = membody.FileBody(len(DATA), str(tmp_path))
    body[:] = DATA
    sender = PayloadRef.shared(body, 0, len(DATA))
    meta, fds = sender.to_meta()
    assert fds == [] and meta == {"kind": "shm", "offset": 0, "size": len(DATA), "path": body.path}
    receiver = payloadref.from_meta(meta)  # another process: it maps the file by name
    view = receiver.open()
    receiver.release()
    assert os.path.exists(body.path)  # the receiver does not own it
    sender.release()
    assert not os.path.exists(body.path)  # the sender's release unlinked it
    assert body.closed  # unmapped first, as Windows needs to remove a file
    assert bytes(view) == DATA and os.listdir(tmp_path) == []
    kept = membody.FileBody(10, str(tmp_path))
    held = memoryview(kept)  # still viewed in this process: the map stays, the file goes
    PayloadRef.shared(kept, 0, 10).release()
    assert not kept.closed and os.listdir(tmp_path) == []
    held.release()


def test_named_bodies_make_answers_files_and_slices_refs(tmp_path, monkeypatch):
    bodies = membody.Bodies(tmp_path)
    payload = wire.dumps({"x": DATA})
    chunks, size = wire.pack_frames([b'{"tasks": []}', payload])
    body = bodies.buffer_for(size)
    assert isinstance(body, membody.FileBody) and os.path.dirname(body.path) == str(tmp_path)
    body[:] = b"".join(bytes(memoryview(c).cast("B")) for c in chunks)
    meta, ref = bodies.slices(body)
    assert bytes(meta) == b'{"tasks": []}'
    assert isinstance(ref, PayloadRef) and ref.kind == "shm" and ref.path == body.path
    assert wire.loads(payloadref.from_meta(ref.to_meta(by_path=True)[0]).open()) == {"x": DATA}
    del meta, body
    ref.release()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("meta, field", [
    ("shm", "expected a JSON object"),
    ({"kind": "ftp", "path": "x"}, "'kind'"),
    ({"kind": "inline"}, "'kind'"),
    ({"kind": "store"}, "'path'"),
    ({"kind": "store", "path": ""}, "'path'"),
    ({"kind": "shm", "fd": 1}, "'fd' must index the 1 descriptor"),
    ({"kind": "shm", "fd": "0"}, "'fd'"),
    ({"kind": "store", "fd": -1}, "'fd'"),
    ({"kind": "store", "path": "p", "offset": -1}, "'offset'"),
    ({"kind": "store", "path": "p", "offset": True}, "'offset'"),
    ({"kind": "store", "path": "p", "size": 1.5}, "'size'"),
])
def test_bad_refs_name_the_field(meta, field):
    with pytest.raises(BadRef, match=field.replace("(", r"\(")):
        payloadref.from_meta(meta, [0])
    assert issubclass(BadRef, ValueError)


def test_a_range_outside_the_file_is_refused(tmp_path):
    path = _write(tmp_path / "p", b"12345")
    with pytest.raises(BadRef, match="'offset'/'size'.*not in a file of 5"):
        PayloadRef("store", path=path, offset=3, size=10).open()
    with pytest.raises(FileNotFoundError):
        PayloadRef("store", path=tmp_path / "gone").open()


def test_handoff_names_reads_the_http_key():
    assert payloadref.handoff_names({}, 2) == {}
    name = handoff.new_name()
    assert payloadref.handoff_names({"handoff_files": {"1": name}}, 2) == {1: name}
    # Written under refs, and under the old key for a coordinator from before refs.
    assert payloadref.handoff_meta({"a": 1}, {1: name}, {1: 5}) == {
        "a": 1, "refs": {"1": {"kind": "handoff", "name": name, "size": 5}},
        "handoff_files": {"1": name}}
    assert payloadref.handoff_meta({"a": 1}, {}) == {"a": 1}
    for names, msg in (([name], "must be an object"), ({"2": name}, "'2' is not a frame number"),
                       ({"-1": name}, "is not a frame number"),
                       ({"0": "../x.part"}, "is not a handoff file name")):
        with pytest.raises(BadRef, match=f"^handoff_files: .*{msg}"):
            payloadref.handoff_names({"handoff_files": names}, 2)


def test_handoff_refs_read_the_one_key_before_the_old_one():
    name, other = handoff.new_name(), handoff.new_name()
    meta = payloadref.handoff_meta({}, {"0": name}, {"0": 9})
    assert payloadref.handoff_refs(meta, 1) == {0: {"kind": "handoff", "name": name, "size": 9}}
    assert payloadref.handoff_names(meta, 1) == {0: name}
    # refs wins over the old key when a sender writes both
    assert payloadref.handoff_names({"refs": {"1": {"kind": "handoff", "name": name}},
                                     "handoff_files": {"0": other}}, 2) == {1: name}
    assert payloadref.handoff_refs({"handoff_files": {"0": other}}, 1) == \
        {0: {"kind": "handoff", "name": other}}


@pytest.mark.parametrize("refs, msg", [
    ([1], r"^refs: must be an object"),
    ({"x": {}}, r"^refs: 'x' is not a frame number"),
    ({"2": {"kind": "handoff", "name": "a" * 24 + ".part"}}, r"^refs: '2' is not a frame number"),
    ({"0": "name.part"}, r"^refs\.0: a payload reference must be an object"),
    ({"0": {"kind": "shm", "path": "/dev/shm/x"}}, r"^refs\.0: 'kind' must be handoff or store"),
    ({"0": {"kind": "handoff", "name": "../../etc/passwd"}}, r"^refs\.0: 'name' must be a handoff"),
    ({"0": {"kind": "handoff", "name": "a" * 24 + ".part", "path": "/x"}}, r"^refs\.0: .* no 'path'"),
    ({"0": {"kind": "handoff", "name": "a" * 24 + ".part", "size": -1}}, r"^refs\.0: 'size'"),
    ({"1": {"kind": "handoff", "name": "a" * 24 + ".part", "size": "3"}}, r"^refs\.1: 'size'"),
    # a sender never names the store's own files
    ({"0": {"kind": "store", "path": "args/j/t"}}, r"^refs\.0: a sender may name only handoff"),
])
def test_bad_handoff_refs_are_refused_naming_the_field(refs, msg):
    with pytest.raises(BadRef, match=msg):
        payloadref.handoff_refs({"refs": refs}, 2)


def test_wire_form_round_trips_and_opens_the_same_bytes(tmp_path):
    drop, blobs = tmp_path / "handoff", tmp_path / "blobs"
    (blobs / "args" / "j").mkdir(parents=True)
    drop.mkdir()
    name = handoff.write_file(drop, [DATA])
    (blobs / "args" / "j" / "t").write_bytes(b"xx" + DATA)
    sent = PayloadRef("handoff", path=drop / name, size=len(DATA))
    assert sent.to_wire(drop) == {"kind": "handoff", "name": name, "size": len(DATA)}
    got = payloadref.from_wire(json.loads(json.dumps(sent.to_wire(drop))), drop)
    assert (got.kind, got.path, got.size) == ("handoff", str(drop / name), len(DATA))
    assert bytes(got.open()) == DATA
    store = PayloadRef("store", path=blobs / "args" / "j" / "t", offset=2, size=len(DATA))
    assert store.to_wire(blobs) == {"kind": "store", "path": "args/j/t", "offset": 2,
                                    "size": len(DATA)}
    back = payloadref.from_wire(store.to_wire(blobs), blobs, "refs.args")
    assert bytes(back.open()) == DATA
    back.release()
    assert (blobs / "args" / "j" / "t").exists()  # the store's file stays


def test_to_wire_refuses_what_does_not_travel_over_http(tmp_path):
    with pytest.raises(BadRef, match="only a handoff or store file"):
        PayloadRef.inline(b"abc").to_wire(tmp_path)
    with pytest.raises(BadRef, match="not a payload file of"):
        PayloadRef("store", path=tmp_path.parent / "elsewhere").to_wire(tmp_path)
    with pytest.raises(BadRef, match="not a handoff file of"):
        PayloadRef("handoff", path=tmp_path / "sub" / "x.part").to_wire(tmp_path)


@pytest.mark.parametrize("path", ["../secret", "args/../../secret", "/etc/passwd", "\\x\\y",
                                  "args\\..\\..\\x", "C:/x", "", "a/..", 7, None])
def test_from_wire_refuses_a_store_path_that_leaves_the_blob_directory(tmp_path, path):
    with pytest.raises(BadRef, match=r"^refs\.result: 'path' must be a payload path inside"):
        payloadref.from_wire({"kind": "store", "path": path}, tmp_path, "refs.result")


def test_a_grant_names_its_arguments_under_refs_or_the_old_key(tmp_path):
    (tmp_path / "args").mkdir()
    (tmp_path / "args" / "t").write_bytes(DATA)
    new = TaskGrant(task_id="t", lease_id="l", fn="f",
                    refs={"args": {"kind": "store", "path": "args/t"}})
    old = TaskGrant(task_id="t", lease_id="l", fn="f", args_file="args/t")
    for g in (new, old):
        ref = g.args_ref(tmp_path)
        assert (ref.kind, ref.path) == ("store", str(tmp_path / "args" / "t"))
        assert bytes(ref.open()) == DATA
    assert TaskGrant(task_id="t", lease_id="l", fn="f").args_ref(tmp_path) is None
    with pytest.raises(BadRef, match="^refs.args: 'path'"):
        TaskGrant(task_id="t", lease_id="l", fn="f",
                  refs={"args": {"kind": "store", "path": "../../x"}}).args_ref(tmp_path)


def _mapped_from(data):
    """A task: its argument's length and the files of the spool its process maps."""
    view = memoryview(data)
    with open("/proc/self/maps") as fh:
        files = sorted({line.split()[5] for line in fh
                        if len(line.split()) > 5 and "/spool/" in line.split()[5]})
    return view.nbytes, bytes(view[:4]), files


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc (Linux)")
@pytest.mark.parametrize("runtime", ["spawn", "fork"])
def test_task_maps_the_answer_file_itself_and_nothing_is_left(tmp_path, monkeypatch, runtime):
    """The spawn runtime (and the fork runtime where there is no memfd): a big argument is
    read into a spool file (the portable shared memory) and the task process maps its
    range of that file; no copy is written."""
    np = pytest.importorskip("numpy")
    from gpumesh.worker.executor import Executor
    from gpumesh.worker.spawn import SpawnExecutor
    ex = (SpawnExecutor if runtime == "spawn" else Executor)(spool=tmp_path / "spool")
    try:
        bodies = membody.Bodies(ex.spool)
        arg = np.frombuffer(DATA, np.uint8)  # out of band: the pickle holds a view of the file
        chunks, size = wire.pack_frames([b'{"tasks": [1]}', wire.dumps(((arg,), {}))])
        body = bodies.buffer_for(size)
        memoryview(body)[:] = b"".join(bytes(memoryview(c).cast("B")) for c in chunks)
        ref = bodies.slices(body)[1]
        path = ref.path
        assert ref.kind == "shm" and os.path.dirname(path) == str(ex.spool)
        fn = wire.dumps(_mapped_from, code=True)
        blob = tmp_path / fn.sha256()
        blob.write_bytes(fn.to_bytes())
        out = ex.run(TaskGrant("t1", "-", fn.sha256(), timeout=120), str(blob), None, args_ref=ref)
        assert out.status == "ok", out.error
        assert wire.loads(out.payload) == (len(DATA), DATA[:4], [path])
        del body
        ref.release()
        assert [n for n in os.listdir(ex.spool) if n.endswith(".part")] == []
    finally:
        ex.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the fork runtime needs os.fork")
def test_without_memfd_the_fork_runtime_also_shares_answers_by_name(tmp_path, monkeypatch):
    from gpumesh.worker import executor as executor_mod
    if hasattr(os, "memfd_create"):
        ex = executor_mod.make_executor("fork", tmp_path / "a")
        ex.close()
        assert ex.bodies.named_dir is None  # Linux: memory files, passed as descriptors
        monkeypatch.delattr(os, "memfd_create")
    ex = executor_mod.make_executor("fork", tmp_path / "b")
    try:
        assert ex.bodies.named_dir == str(tmp_path / "b")
        assert isinstance(ex.bodies.buffer_for(len(DATA)), membody.FileBody)
        assert membody.MEMORY.named_dir is None  # no process-wide switch: other executors keep memfd
    finally:
        ex.close()
