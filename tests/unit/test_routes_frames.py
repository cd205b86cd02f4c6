"""The sans-I/O frames reader and writer of gpumesh.wire, which the coordinator's bodies
(coordinator/bodies.py) drive: every split of the input, oversize, truncated, foreign."""

from __future__ import annotations

import json
import random
import struct

import pytest

from gpumesh import wire
from gpumesh.errors import WireError

FRAMES = [b'{"job_id": "abcd"}', b"", b"x" * 100, b"", b"0123456789", bytes(range(256)) * 3]


def body_of(frames, trailer: bytes = b"") -> bytes:
    chunks, total = wire.pack_frames(frames)
    data = b"".join(bytes(c) for c in chunks)
    assert len(data) == total
    return data + trailer


def read(data: bytes, cuts: list[int], **kw) -> tuple[list[bytes], list[tuple[str, int]]]:
    """Feed ``data`` cut at ``cuts``; the frames as read and the events' order."""
    reader = wire.FramesReader(**kw)
    frames: dict[int, bytearray] = {}
    order: list[tuple[str, int]] = []
    pos = 0
    for cut in [*cuts, len(data)]:
        for ev in reader.feed(data[pos:cut]):
            if isinstance(ev, wire.FramesHead):
                order.append(("head", len(ev.lengths)))
            elif isinstance(ev, wire.FrameStart):
                frames[ev.index] = bytearray()
                order.append(("start", ev.index))
            elif isinstance(ev, wire.FrameData):
                assert isinstance(ev.data, memoryview)
                frames[ev.index] += ev.data
            else:
                order.append(("end", ev.index))
        pos = cut
    reader.close()
    assert reader.done
    return [bytes(frames[i]) for i in sorted(frames)], order


EXPECTED_ORDER = [("head", 6)] + [(k, i) for i in range(6) for k in ("start", "end")]


def test_reader_gives_the_same_frames_and_events_for_a_split_at_every_byte_boundary():
    data = body_of(FRAMES, trailer=b"ignored after the last frame")
    assert read(data, []) == (FRAMES, EXPECTED_ORDER)
    for cut in range(len(data) + 1):
        assert read(data, [cut]) == (FRAMES, EXPECTED_ORDER), cut


def test_reader_fed_one_byte_at_a_time_and_in_random_pieces():
    data = body_of(FRAMES)
    assert read(data, list(range(1, len(data)))) == (FRAMES, EXPECTED_ORDER)
    rng = random.Random(15)
    for _ in range(200):
        cuts = sorted(rng.sample(range(len(data)), 7))
        assert read(data, cuts) == (FRAMES, EXPECTED_ORDER)


def test_reader_announces_the_header_with_lengths_and_body_size():
    data = body_of(FRAMES)
    events = wire.FramesReader(size=len(data)).feed(data[:8 + 8 * len(FRAMES)])
    assert isinstance(events[0], wire.FramesHead)
    assert events[0].lengths == tuple(len(f) for f in FRAMES)
    assert events[0].size == len(data)


def test_reader_frame_data_are_views_of_the_bytes_fed_not_copies():
    big = bytearray(b"y" * 5000)
    data = bytearray(body_of([b"{}", big]))
    events = wire.FramesReader().feed(data)
    pieces = [e.data for e in events if isinstance(e, wire.FrameData) and e.index == 1]
    assert len(pieces) == 1 and pieces[0].obj is data


def test_reader_of_a_body_with_no_frames():
    data = body_of([])
    events = wire.FramesReader().feed(data)
    assert [type(e) for e in events] == [wire.FramesHead] and events[0].lengths == ()


def test_reader_refuses_a_header_announcing_more_than_the_limit_before_any_frame():
    data = body_of([b"{}", b"z" * 1000])
    with pytest.raises(wire.FramesTooLarge, match="over the limit of 500"):
        wire.FramesReader(limit=500).feed(data[:8 + 16])


def test_reader_refuses_a_header_announcing_more_than_the_declared_size():
    data = body_of([b"{}", b"z" * 1000])
    with pytest.raises(WireError, match="frames body truncated") as e:
        wire.FramesReader(size=len(data) - 1).feed(data)
    assert not isinstance(e.value, wire.FramesTooLarge)


def test_reader_refuses_a_frame_count_the_body_cannot_hold():
    head = wire.FRAMES_MAGIC + struct.pack("<I", 1000)
    with pytest.raises(WireError, match="frames header truncated"):
        wire.FramesReader(size=100).feed(head)
    with pytest.raises(WireError, match="frames header truncated"):
        wire.FramesReader(limit=4000).feed(head)
    assert wire.FramesReader(limit=9000).feed(head) == []  # fits: waits for the lengths


@pytest.mark.parametrize("cut", [0, 3, 7])
def test_close_of_a_body_shorter_than_its_magic_and_count(cut):
    reader = wire.FramesReader()
    reader.feed(body_of(FRAMES)[:cut])
    with pytest.raises(WireError, match=rf"frames body too short \({cut} bytes\)"):
        reader.close()


def test_close_of_a_body_cut_anywhere_after_its_first_eight_bytes():
    data = body_of(FRAMES)
    for cut in range(8, len(data)):
        reader = wire.FramesReader()
        reader.feed(data[:cut])
        assert not reader.done
        with pytest.raises(WireError, match="frames body truncated"):
            reader.close()


def test_reader_names_another_wire_version_and_a_foreign_body():
    with pytest.raises(WireError, match="wire version 2"):
        wire.FramesReader().feed(b"GMF2" + bytes(60))
    with pytest.raises(WireError, match="not a gpumesh message"):
        wire.FramesReader().feed(b"POST / HTTP/1.1\r\n")


def test_writer_pieces_are_the_layout_unpack_frames_reads():
    writer = wire.FramesWriter([len(f) for f in FRAMES])
    pieces = list(writer.pieces(FRAMES))
    assert pieces[0] == writer.header and len(writer.header) % wire.ALIGN == 0
    data = b"".join(pieces)
    assert len(data) == writer.size == len(body_of(FRAMES))
    assert data == body_of(FRAMES)
    assert [bytes(v) for v in wire.unpack_frames(data)] == FRAMES
    assert writer.offsets == [off for off, _ in wire.frame_spans(data)]
    assert all(off % wire.ALIGN == 0 for off in writer.offsets)


def test_writer_passes_the_frames_through_for_the_sender_to_resolve():
    tokens = [object(), object()]
    pieces = list(wire.FramesWriter([3, 70]).pieces(tokens))
    assert [p for p in pieces if not isinstance(p, bytes)] == tokens
    assert pieces[1] is tokens[0]
    assert pieces[2] == b"\0" * 61  # 64 + 3 -> padding to 128 before the second frame
    with pytest.raises(ValueError, match="2 frames for a layout of 3"):
        list(wire.FramesWriter([1, 2, 3]).pieces(tokens))


def test_writer_output_read_back_by_the_reader():
    writer = wire.FramesWriter([len(f) for f in FRAMES])
    data = b"".join(writer.pieces(FRAMES))
    assert read(data, [65, 130])[0] == FRAMES


# ---------------------------------------------------------------- the coordinator's driver
from .routes_app import api_fixture  # noqa: E402

api = api_fixture


def _pieces(data: bytes, sizes: list[int]):
    """``data`` as a chunked request body, cut into pieces of ``sizes`` (cycled)."""
    pos, k = 0, 0
    while pos < len(data):
        n = sizes[k % len(sizes)]
        yield data[pos:pos + n]
        pos, k = pos + n, k + 1


def test_a_chunked_submit_in_odd_pieces_streams_its_big_argument_into_a_file(api):
    from gpumesh.limits import INLINE_BLOB_BYTES
    api.worker()
    blob, fn = api.fn_blob()
    big = wire.dumps(((b"q" * (INLINE_BLOB_BYTES * 3),), {}))
    small = wire.dumps(((1,), {}))
    meta = json.dumps({"job_id": "abcdef02", "fn": fn, "fn_inline": True, "n_tasks": 2}).encode()
    body = body_of([meta, blob, big, small])
    r = api.call("POST", "/v1/jobs", content=_pieces(body, [1, 7, 63, 4096, 65537]))
    assert r.status_code == 200, r.text
    inline0, file0 = api.store.task_args(api.store.task_rows("abcdef02")[0]["id"])
    inline1, file1 = api.store.task_args(api.store.task_rows("abcdef02")[1]["id"])
    assert inline0 is None and file0 is not None  # the big one went to a file...
    assert api.store.file_path(file0).read_bytes() == big.to_bytes()
    assert file1 is None and bytes(inline1) == small.to_bytes()  # ...the small one stayed inline
    assert list(api.store.incoming_dir.iterdir()) == []


def test_a_chunked_submit_cut_short_is_refused_and_leaves_no_file(api):
    from gpumesh.limits import INLINE_BLOB_BYTES
    api.worker()
    blob, fn = api.fn_blob()
    big = wire.dumps(((b"q" * (INLINE_BLOB_BYTES * 2),), {}))
    meta = json.dumps({"job_id": "abcdef03", "fn": fn, "fn_inline": True, "n_tasks": 1}).encode()
    body = body_of([meta, blob, big])
    cut = body[:len(body) - 1000]
    message = api.refusal("POST", "/v1/jobs", 400, "bad_request", content=_pieces(cut, [50000]))
    assert message == "body is not a gpumesh frames message: frames body truncated"
    assert list(api.store.incoming_dir.iterdir()) == []
    assert api.store.recent_job_ids(5) == []


def test_a_streamed_body_with_bad_meta_is_refused_before_its_payloads(api, monkeypatch):
    from gpumesh.limits import INLINE_BLOB_BYTES
    body = body_of([b"[1, 2]", b"p" * (INLINE_BLOB_BYTES * 2)])
    opened = []
    monkeypatch.setattr(api.store, "incoming", lambda: opened.append(1))
    message = api.refusal("POST", "/v1/jobs", 400, "bad_request", content=_pieces(body, [4096]))
    assert message == "frame 0 must be a JSON object"
    assert opened == []  # refused at frame 0: no file was opened for the payload


def test_a_streamed_header_announcing_more_than_the_body_limit_is_a_413(api):
    from gpumesh.limits import MAX_BODY_BYTES
    head = wire.frames_header([10, MAX_BODY_BYTES + 1])
    r = api.call("POST", "/v1/jobs", content=_pieces(head + b"{}", [16]))
    assert r.status_code == 413 and r.json()["error"] == "too_large"
    assert "GPUMESH_MAX_BODY_MB" in r.json()["message"]
