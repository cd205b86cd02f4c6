"""Tokens overwritten in the memory ``ps`` reads: the macOS argument area's bounds (found
through libSystem's ``_NSGetArgv``/``_NSGetEnviron``, faked here with real memory laid out
as exec lays it) and the overwrite itself."""

from __future__ import annotations

import ctypes
import os
import sys

import pytest

from gpumesh.cli import secrecy

SECRET = b"s3cret-token-0123456789abcdef"


class FakeLibSystem:
    """The three C-runtime calls, over one buffer laid out as exec lays the argument area:
    argv strings, then environment strings, back to back; then a gap and a string
    elsewhere (a variable set after start-up, on the heap)."""

    def __init__(self, argv: list[bytes], env: list[bytes], later: bytes):
        area = b"".join(a + b"\0" for a in argv + env)
        self.buf = ctypes.create_string_buffer(area + b"\0" * 4096 + later + b"\0")
        base = ctypes.addressof(self.buf)
        offsets, pos = [], 0
        for a in argv + env:
            offsets.append(base + pos)
            pos += len(a) + 1
        self.area = (base, base + len(area))
        later_at = base + len(area) + 4096
        self._argc = ctypes.c_int(len(argv))
        self._argv = (ctypes.c_void_p * (len(argv) + 1))(*offsets[:len(argv)], None)
        self._env = (ctypes.c_void_p * (len(env) + 2))(*offsets[len(argv):], later_at, None)
        self._argv_p = ctypes.cast(self._argv, ctypes.POINTER(ctypes.c_void_p))
        self._env_p = ctypes.cast(self._env, ctypes.POINTER(ctypes.c_void_p))
        self._NSGetArgc = lambda: ctypes.pointer(self._argc)
        self._NSGetArgv = lambda: ctypes.pointer(self._argv_p)
        self._NSGetEnviron = lambda: ctypes.pointer(self._env_p)

    def raw(self) -> bytes:
        return self.buf.raw


def test_darwin_argument_area_is_argv_then_environment_and_stops_at_a_gap():
    lib = FakeLibSystem([b"/usr/bin/python3", b"-m", b"gpumesh", b"join", b"--token=" + SECRET],
                        [b"HOME=/Users/alex", b"GPUMESH_TOKEN=" + SECRET], b"LATER=" + SECRET)
    assert secrecy._darwin_regions(lib) == [lib.area]
    assert secrecy.overwrite(secrecy._darwin_regions(lib), [SECRET])
    area = lib.raw()[:lib.area[1] - lib.area[0]]
    assert SECRET not in area
    assert b"--token=" + b"*" * len(SECRET) in area and b"GPUMESH_TOKEN=" + b"*" * len(SECRET) in area
    assert b"HOME=/Users/alex\0" in area and area.startswith(b"/usr/bin/python3\0-m\0")
    assert b"LATER=" + SECRET + b"\0" in lib.raw()[len(area):]  # outside the area: left alone


def test_overwrite_skips_regions_that_are_empty_or_too_large():
    buf = ctypes.create_string_buffer(b"x" + SECRET + b"y")
    start = ctypes.addressof(buf)
    assert not secrecy.overwrite([(0, 10), (start, start)], [SECRET])
    assert not secrecy.overwrite([(start, start + secrecy.MAX_REGION_BYTES + 1)], [SECRET])
    assert buf.raw.count(SECRET) == 1
    assert secrecy.overwrite([(start, start + len(buf.raw))], [SECRET])
    assert buf.raw == b"x" + b"*" * len(SECRET) + b"y\0"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/cmdline")
def test_hide_in_this_process_removes_the_variables(monkeypatch):
    monkeypatch.setenv("GPUMESH_TOKEN", "not-on-the-command-line-xyz")
    assert secrecy.hide("not-on-the-command-line-xyz")
    assert "GPUMESH_TOKEN" not in os.environ
    with open("/proc/self/cmdline", "rb") as fh:
        assert b"not-on-the-command-line-xyz" not in fh.read()
