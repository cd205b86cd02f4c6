"""``gpumesh.worker.forking``: a function host's fork runs the at-fork hooks registered
since ``record_hooks`` (``random``'s reseed among them) except the thread-only ones of
``threading`` and ``logging``, in CPython's order; with another Python thread running
when ``prepare`` looked it is ``os.fork()``. Each case runs in a fresh interpreter (the module replaces
``os.register_at_fork`` there), on this one and on every other CPython 3.10-3.13 this
machine has: the module loads from its file, so a bare interpreter can run it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import gpumesh.worker.forking as forking

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the libc fork is Linux-only")

MODULE = Path(forking.__file__)

SCRIPT = r"""
import importlib.util, json, os, sys, threading, time
spec = importlib.util.spec_from_file_location("forking", sys.argv[1])
forking = importlib.util.module_from_spec(spec)
spec.loader.exec_module(forking)
forking.record_hooks()
import random  # registers its reseed from here on: recorded
log = []
def hook(name):
    def h():
        log.append(name)
    return h
def thread_only():
    log.append("thread-only")
thread_only.__module__ = "threading"
def broken():
    raise RuntimeError("a hook that fails")
os.register_at_fork(before=hook("before 1"), after_in_parent=hook("parent 1"),
                    after_in_child=hook("child 1"))
os.register_at_fork(before=hook("before 2"), after_in_child=broken)
os.register_at_fork(after_in_child=hook("child 3"))
os.register_at_fork(after_in_child=thread_only)
if sys.argv[2] == "thread":
    stop = threading.Event()
    threading.Thread(target=stop.wait, daemon=True).start()
forking.prepare()
r, w = os.pipe()
parent_draw = random.random()
pid = forking.fork()
if pid == 0:
    # The child goes on as any task may: an import (the import lock), a thread started
    # and joined (threading's state), the main thread still the main thread.
    import decimal
    t = threading.Thread(target=lambda: log.append("in a thread"))
    t.start(); t.join(10)
    assert threading.current_thread() is threading.main_thread() and not t.is_alive()
    os.write(w, json.dumps({"log": log, "draw": random.random()}).encode())
    os._exit(0)
os.close(w)
child = json.loads(os.read(r, 65536))
_, status = os.waitpid(pid, 0)
print(json.dumps({"parent": log, "child": child["log"], "exit": os.waitstatus_to_exitcode(status),
                  "fresh_draw": child["draw"] != random.random(), "libc": forking._libc_fork is not None,
                  "supported": forking.supported()}))
"""


def _interpreters() -> list[str]:
    """This interpreter, each other ``python3.1x`` on PATH that runs, and those that
    ``GPUMESH_TEST_PYTHONS`` names (paths, separated as in PATH)."""
    found = [sys.executable]
    named = [p for p in os.environ.get("GPUMESH_TEST_PYTHONS", "").split(os.pathsep) if p]
    mine = f"{sys.version_info[0]}.{sys.version_info[1]}"
    for exe in [shutil.which(f"python{v}") for v in ("3.10", "3.11", "3.12", "3.13") if v != mine] + named:
        if not exe:
            continue
        try:
            ok = subprocess.run([exe, "-c", "import ctypes"], capture_output=True,
                                timeout=30).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            ok = False
        if ok:
            found.append(exe)
    return found


def _run(exe: str, mode: str) -> tuple[dict, str]:
    out = subprocess.run([exe, "-c", SCRIPT, str(MODULE), mode], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout), out.stderr


@pytest.mark.parametrize("exe", _interpreters())
def test_the_hooks_that_run_are_all_but_the_thread_only_ones_in_cpythons_order(exe):
    got, stderr = _run(exe, "alone")
    assert got["supported"] and got["libc"], "CPython 3.10-3.13 with a GIL on Linux"
    assert got["parent"] == ["before 2", "before 1", "parent 1"]
    assert got["child"] == ["before 2", "before 1", "child 1", "child 3",   # no thread-only
                            "in a thread"]
    assert "RuntimeError: a hook that fails" in stderr                    # reported, skipped
    assert got["exit"] == 0
    assert got["fresh_draw"], "random's own hook reseeded the child"


@pytest.mark.parametrize("exe", _interpreters())
def test_with_another_python_thread_running_it_is_os_fork_with_every_hook(exe):
    got, _ = _run(exe, "thread")
    assert got["child"] == ["before 2", "before 1", "child 1", "child 3", "thread-only",
                            "in a thread"]
    assert got["parent"] == ["before 2", "before 1", "parent 1"]
    assert got["fresh_draw"]


def test_without_record_hooks_it_is_os_fork(monkeypatch):
    calls = []
    monkeypatch.setattr(forking, "_libc_fork", None)
    monkeypatch.setattr(forking.os, "fork", lambda: calls.append(1) or 12345)
    forking.prepare()
    assert forking._plan is None
    assert forking.fork() == 12345 and calls == [1]


def test_what_register_at_fork_refuses_it_still_refuses_and_notes_nothing():
    script = (
        "import importlib.util, os, sys\n"
        "spec = importlib.util.spec_from_file_location('forking', sys.argv[1])\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "m.record_hooks()\n"
        "try:\n"
        "    os.register_at_fork(before=42)\n"
        "except TypeError as e:\n"
        "    print('refused', len(m._hooks))\n")
    out = subprocess.run([sys.executable, "-c", script, str(MODULE)], capture_output=True,
                         text=True, timeout=60)
    assert out.stdout.strip() == "refused 0", out.stderr
