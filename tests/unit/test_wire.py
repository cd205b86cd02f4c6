"""Unit tests for gpumesh.wire: payloads, frames and re-chunking."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from gpumesh import wire
from gpumesh.errors import MeshError, WireError


def roundtrip(obj, code: bool = False):
    """dumps -> bytes -> bytearray -> loads, as the receiving side does."""
    return wire.loads(bytearray(wire.dumps(obj, code=code).to_bytes()))


# ---------------------------------------------------------------- payloads: numpy ----

@pytest.mark.parametrize("order", ["C", "F"])
def test_numpy_array_keeps_dtype_order_and_is_writable(order):
    a = np.asarray(np.arange(200_000, dtype=np.float32).reshape(400, 500), order=order)
    b = roundtrip(a)
    assert isinstance(b, np.ndarray)
    assert b.dtype == np.float32
    assert b.shape == (400, 500)
    assert np.array_equal(a, b)
    assert b.flags["C_CONTIGUOUS"] == a.flags["C_CONTIGUOUS"]
    assert b.flags["F_CONTIGUOUS"] == a.flags["F_CONTIGUOUS"]
    assert b.flags.writeable
    b[0, 0] = -1.0
    assert b[0, 0] == -1.0
    assert a[0, 0] == 0.0  # the original is untouched


def test_big_array_travels_out_of_band():
    a = np.arange(1 << 18, dtype=np.int64)
    p = wire.dumps(a)
    raw = p.to_bytes()
    (nbuf, stream_len) = struct.unpack_from("<IQ", raw, 4)
    assert nbuf == 1
    assert stream_len < 1024  # the data is not inside the pickle stream
    assert p.size == len(raw)
    assert np.array_equal(wire.loads(bytearray(raw)), a)


def test_strided_array_roundtrip_writable():
    base = np.arange(1000, dtype=np.int16).reshape(20, 50)
    a = base[::3, 1::2]
    assert not a.flags["C_CONTIGUOUS"] and not a.flags["F_CONTIGUOUS"]
    b = roundtrip(a)
    assert b.dtype == np.int16
    assert b.shape == a.shape
    assert np.array_equal(a, b)
    assert b.flags.writeable
    b[...] = 7
    assert int(b.sum()) == 7 * a.size


def test_zero_dim_array():
    a = np.array(3.5, dtype=np.float64)
    b = roundtrip(a)
    assert isinstance(b, np.ndarray)
    assert b.ndim == 0
    assert b.dtype == np.float64
    assert float(b) == 3.5
    assert b.flags.writeable
    b[()] = 4.0
    assert float(b) == 4.0


def test_structured_array():
    dt = np.dtype([("name", "U8"), ("x", "<f8"), ("n", "<i4")])
    a = np.array([("alpha", 1.5, 1), ("beta", -2.0, 2), ("γ", 0.0, 3)], dtype=dt)
    b = roundtrip(a)
    assert b.dtype == dt
    assert b.tolist() == a.tolist()
    assert b.flags.writeable
    b["n"][0] = 99
    assert b["n"].tolist() == [99, 2, 3]


def test_loads_from_bytes_gives_readonly_but_equal_array():
    a = np.arange(100_000, dtype=np.uint8)
    b = wire.loads(wire.dumps(a).to_bytes())
    assert np.array_equal(a, b)


@pytest.mark.parametrize("value", [np.float32(1.25), np.int64(-7), np.uint8(255),
                                   np.bool_(True), np.complex128(1 + 2j), np.float16(0.5)])
def test_numpy_scalars_keep_type(value):
    got = roundtrip(value)
    assert type(got) is type(value)
    assert got == value


# ---------------------------------------------------------------- payloads: misc -----

def test_big_bytes_roundtrip():
    data = bytes(range(256)) * (5 * 4096 + 3)  # ~5 MiB, not a multiple of 64
    got = roundtrip(data)
    assert type(got) is bytes
    assert got == data


def test_bytearray_and_memory_sizes():
    data = bytearray(b"\x00\xffabc" * 100_000)
    got = roundtrip(data)
    assert type(got) is bytearray
    assert got == data


@pytest.mark.parametrize("text", ["", "ascii", "Привет", "漢字かな", "😀👍🏽", "e\u0301", "a\x00b",
                                  "\ud800", "x\udfffy"])
def test_unicode_roundtrip_including_lone_surrogates(text):
    got = roundtrip({"k": text, text: 1})
    assert got == {"k": text, text: 1}


def test_plain_pickler_path_and_nested_containers():
    obj = {"a": [1, 2.5, None, True], (1, 2): {3, 4}, "z": frozenset({"q"}), "n": -0.0, "b": 2**200}
    assert roundtrip(obj, code=False) == obj
    assert roundtrip(obj, code=True) == obj


def test_functions_by_value():
    k = 10

    def add(x):
        return x + k

    f = roundtrip(add)
    assert f(5) == 15
    assert roundtrip(lambda x: x * 3)(4) == 12


def test_sections_are_aligned():
    a = np.arange(10_000, dtype=np.float64)
    raw = wire.dumps({"a": a, "b": b"x" * 1000}).to_bytes()
    nbuf, stream_len = struct.unpack_from("<IQ", raw, 4)
    off = 16 + 8 * nbuf
    off += (-off) % wire.ALIGN
    assert off % 64 == 0
    assert raw[:4] == b"GMP1"


def test_sha256_matches_joined_bytes():
    import hashlib
    p = wire.dumps({"x": np.arange(5000)})
    assert p.sha256() == hashlib.sha256(p.to_bytes()).hexdigest()
    # identical objects hash identically (content-addressed function blobs rely on it)
    assert wire.dumps((1, "a")).sha256() == wire.dumps((1, "a")).sha256()


# ---------------------------------------------------------------- payload errors -----

def test_wrong_magic_is_wire_error():
    with pytest.raises(WireError) as ei:
        wire.loads(b"XXXX" + b"\0" * 60)
    assert "not a gpumesh" in str(ei.value)
    assert isinstance(ei.value, MeshError)


def test_future_version_names_both_versions():
    raw = bytearray(wire.dumps([1, 2, 3]).to_bytes())
    raw[:4] = b"GMP2"
    with pytest.raises(WireError) as ei:
        wire.loads(raw)
    msg = str(ei.value)
    assert "version 2" in msg
    assert "version 1" in msg
    assert "same gpumesh version" in msg


def test_future_frames_version_names_both_versions():
    chunks, _ = wire.pack_frames([b"{}"])
    raw = bytearray(b"".join(chunks))
    raw[:4] = b"GMF7"
    with pytest.raises(WireError) as ei:
        wire.unpack_frames(raw)
    assert "version 7" in str(ei.value) and "version 1" in str(ei.value)


def test_too_short_payload():
    with pytest.raises(WireError, match="too short"):
        wire.loads(b"GMP1")


def test_truncated_payload_body():
    raw = wire.dumps(np.arange(100_000, dtype=np.int64)).to_bytes()
    for cut in (len(raw) - 1, len(raw) // 2, 200):
        with pytest.raises(WireError, match="truncated"):
            wire.loads(bytearray(raw[:cut]))


def test_truncated_pickle_stream_without_buffers():
    raw = wire.dumps("hello" * 100).to_bytes()
    for cut in (1, 10, len(raw) - 70):
        with pytest.raises(WireError, match="truncated"):
            wire.loads(bytearray(raw[:-cut]))


# ---------------------------------------------------------------- frames -------------

def test_frames_pack_unpack_roundtrip():
    p = wire.dumps({"k": np.arange(1000)})
    frames = [b'{"a": 1}', b"", bytearray(b"xyz" * 33), memoryview(b"0123456789"), p]
    chunks, total = wire.pack_frames(frames)
    body = b"".join(bytes(c) for c in chunks)
    assert len(body) == total
    out = wire.unpack_frames(bytearray(body))
    assert [bytes(f) for f in out[:4]] == [b'{"a": 1}', b"", b"xyz" * 33, b"0123456789"]
    got = wire.loads(out[4])
    assert np.array_equal(got["k"], np.arange(1000))
    # every frame starts on a 64-byte boundary
    offsets = list(wire.frame_offsets([len(b) for b in (b'{"a": 1}', b"", b"xyz" * 33, b"0123456789")] + [p.size]))
    assert all(o % 64 == 0 for o in offsets)


def test_frames_empty_list():
    chunks, total = wire.pack_frames([])
    assert wire.unpack_frames(b"".join(chunks)) == []
    assert total == len(b"".join(chunks))


def test_frames_views_are_zero_copy():
    chunks, _ = wire.pack_frames([b"abc", b"defg"])
    body = bytearray(b"".join(chunks))
    out = wire.unpack_frames(body)
    assert isinstance(out[0], memoryview)
    out[1][0] = ord("X")
    assert bytes(wire.unpack_frames(body)[1]) == b"Xefg"


def test_frames_wrong_magic_and_truncation():
    with pytest.raises(WireError, match="not a gpumesh"):
        wire.unpack_frames(b"GMP1" + b"\0" * 60)
    with pytest.raises(WireError, match="too short"):
        wire.unpack_frames(b"GMF1")
    chunks, _ = wire.pack_frames([b"a" * 100, b"b" * 100])
    body = b"".join(chunks)
    with pytest.raises(WireError, match="truncated"):
        wire.unpack_frames(body[:-1])
    # header claims more frames than the body can hold
    with pytest.raises(WireError, match="truncated"):
        wire.unpack_frames(b"GMF1" + struct.pack("<I", 1000) + b"\0" * 8)


# ---------------------------------------------------------------- iter_chunks --------

def test_iter_chunks_coalesces_small_pieces():
    pieces = [b"ab"] * 100
    out = list(wire.iter_chunks(pieces, size=64))
    assert b"".join(out) == b"ab" * 100
    assert all(type(c) is bytes for c in out)
    assert all(len(c) <= 64 for c in out)
    assert len(out) == 4  # 200 bytes in ~64-byte writes, not 100 writes


def test_iter_chunks_passes_big_pieces_on_without_copying():
    big = bytearray(bytes(range(256)) * 40)  # 10240 bytes
    out = list(wire.iter_chunks([b"x", big, memoryview(b"tail")], size=1000))
    assert b"".join(out) == b"x" + big + b"tail"
    assert [type(c) for c in out] == [bytes, memoryview, bytes]
    big[0] = 255                     # a view of the caller's buffer, not a copy of it
    assert out[1][0] == 255


def test_iter_chunks_of_a_payload_preserves_bytes():
    p = wire.dumps({"a": np.arange(300_000, dtype=np.float64), "s": "x" * 1000})
    joined = b"".join(wire.iter_chunks(p.chunks, size=1 << 16))
    assert joined == p.to_bytes()
    assert np.array_equal(wire.loads(bytearray(joined))["a"], np.arange(300_000, dtype=np.float64))


def test_iter_chunks_empty():
    assert list(wire.iter_chunks([])) == []
    assert list(wire.iter_chunks([b"", b""])) == []


def test_a_cache_function_of_the_callers_own_code_travels_as_a_fresh_cache():
    """``functools.cache``/``lru_cache`` made in the caller's code went by reference to a
    name the worker lacks (and under @mesh failed here: "it's not the same object")."""
    import functools

    calls = []

    @functools.lru_cache(maxsize=7, typed=True)
    def square(x):
        """Squares."""
        calls.append(x)
        return x * x

    square(3)  # the caller's cache holds a result: it does not travel
    for code in (True, False):
        got = wire.loads(wire.dumps(square, code=code).to_bytes())
        assert type(got) is type(square) and got is not square
        assert got.cache_parameters() == {"maxsize": 7, "typed": True}
        assert (got.__name__, got.__qualname__, got.__doc__) == (
            "square", square.__qualname__, "Squares.")
        assert got.cache_info().currsize == 0
        assert got(4) == 16 and got(4) == 16 and got.cache_info().hits == 1
        assert got.__wrapped__(5) == 25
    # in a closure and as a global the function reads, the same
    cached = functools.cache(lambda x: -x)
    got = wire.loads(wire.dumps(lambda y: cached(y) + 1, code=True).to_bytes())
    assert got(2) == -1
    # an installed module's cache function still goes by reference: its module has it
    import fnmatch
    assert wire.loads(wire.dumps(fnmatch._compile_pattern, code=True).to_bytes()) \
        is fnmatch._compile_pattern
