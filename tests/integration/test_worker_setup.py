"""Setup that works the first time: join waits for its coordinator saying so, and a
worker's temporary directory goes away when it stops or after it was killed."""

from __future__ import annotations

import os
import signal
import tempfile
import time
from pathlib import Path

from gpumesh import oslock
from gpumesh.worker import tempdirs

from ..conftest import Mesh, Proc, wait_for


def _worker_dirs(root: Path) -> dict[Path, int | None]:
    """gpumesh worker directories under ``root`` -> the pid in their lock file."""
    out = {}
    for d in root.glob(tempdirs.PREFIX + "*"):
        text = (d / tempdirs.LOCK_NAME).read_text().strip() if (d / tempdirs.LOCK_NAME).exists() else ""
        out[d] = int(text) if text.isdigit() else None
    return out


def test_join_says_coordinator_unreachable_while_it_waits_then_joins(tmp_path):
    mesh = Mesh(tmp_path / "mesh")  # not started yet: its port is free
    worker = Proc(["join", mesh.url], mesh.env, tmp_path / "worker.log")
    try:
        line = wait_for(lambda: next((ln for ln in worker.output().splitlines()
                                      if "coordinator unreachable (" in ln), None),
                        30, "the unreachable line")
        assert line.startswith("[worker] coordinator unreachable (")
        assert line.endswith("), retrying")
        assert f"127.0.0.1:{mesh.port}" in line
        # a few tries later, once, where to look; still the one unreachable line (not one
        # a second, as a wrong URL or port used to print)
        hint = wait_for(lambda: next((ln for ln in worker.output().splitlines()
                                      if "gpumesh doctor" in ln), None), 30, "the doctor pointer")
        assert hint == ("[worker] still no answer after 3 tries; retrying, at most 30 s apart. "
                        f"Check the address with: gpumesh doctor {mesh.url}")
        assert worker.output().count("coordinator unreachable (") == 1
        assert worker.p.poll() is None  # still waiting, not given up
        mesh.start()
        mesh.wait_alive(1, worker, timeout=60)  # backoff is capped: it joins on its own
        wait_for(lambda: "joined mesh as" in worker.output(), 10, "the joined line")
        assert worker.output().count("coordinator unreachable (") == 1
        assert worker.output().count("gpumesh doctor") == 1
    finally:
        worker.stop()
        mesh.stop()


def test_a_worker_stopped_while_it_waits_for_its_coordinator_leaves_no_directory(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    mesh = Mesh(tmp_path / "mesh")  # never started
    worker = Proc(["join", mesh.url], dict(mesh.env, TMPDIR=str(tmp)), tmp_path / "worker.log")
    wait_for(lambda: "coordinator unreachable (" in worker.output(), 30, "the unreachable line")
    assert list(_worker_dirs(tmp).values()) == [worker.p.pid]
    assert worker.stop() == 0
    assert _worker_dirs(tmp) == {}


def test_worker_directory_is_removed_on_stop_and_after_a_kill(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    mesh = Mesh(tmp_path / "mesh")
    mesh.env["TMPDIR"] = str(tmp)  # the workers' temporary directory, ours to inspect
    mesh.start()
    try:
        first = mesh.add_worker()
        dirs = _worker_dirs(tmp)
        assert list(dirs.values()) == [first.p.pid]
        assert oct(next(iter(dirs)).stat().st_mode & 0o777) == "0o700"
        assert first.stop() == 0  # Ctrl+C: a clean stop removes its directory
        assert _worker_dirs(tmp) == {}, [sorted(str(p) for p in d.rglob("*")) for d in _worker_dirs(tmp)]

        killed = mesh.add_worker()
        wait_for(lambda: _worker_dirs(tmp), 10, "the second worker's directory")
        os.killpg(killed.p.pid, signal.SIGKILL)
        killed.p.wait(10)
        mesh.wait_alive(0)
        left = _worker_dirs(tmp)
        assert list(left.values()) == [killed.p.pid]  # a killed worker cannot clean up

        third = mesh.add_worker()  # starting removes the dead worker's directory
        assert list(_worker_dirs(tmp).values()) == [third.p.pid]
        assert not next(iter(left)).exists()
        third.stop()
        assert _worker_dirs(tmp) == {}
    finally:
        mesh.stop()


def test_sweep_leaves_live_and_unlocked_directories_alone(tmp_path):
    live, live_lock = tempdirs.create(tmp_path)
    dead = Path(tempfile.mkdtemp(prefix=tempdirs.PREFIX, dir=tmp_path))
    oslock.acquire(dead / tempdirs.LOCK_NAME).release()  # its worker is gone
    (dead / "fn").mkdir()
    (dead / "fn" / "blob").write_bytes(b"x" * 100)
    fresh = Path(tempfile.mkdtemp(prefix=tempdirs.PREFIX, dir=tmp_path))  # not locked yet
    other = tmp_path / "gpumesh-other"
    other.mkdir()
    try:
        assert tempdirs.sweep(tmp_path) == [dead]
        assert live.exists() and fresh.exists() and other.exists() and not dead.exists()
    finally:
        live_lock.release()
    assert tempdirs.sweep(tmp_path) == [live]  # released: now it is a dead worker's


def test_a_joined_worker_says_so_once_when_its_coordinator_goes_away(make_mesh):
    mesh = make_mesh(workers=0)
    worker = mesh.add_worker()
    mesh.kill_coordinator()
    wait_for(lambda: "coordinator unreachable (" in worker.output(), 30, "the unreachable line")
    time.sleep(3)  # several retries later: still one line for this outage
    assert worker.output().count("coordinator unreachable (") == 1
    mesh.restart()
    mesh.wait_alive(1, worker, timeout=60)  # it comes back on its own
    wait_for(lambda: "re-joined mesh as" in worker.output(), 10, "the re-joined line")
