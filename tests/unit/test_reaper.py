"""Released payload files are unlinked by the store's reaper thread, not by the request
that released them (an unlink frees the file's pages there and then: tens of ms for a
64 MiB payload, which the coordinator's event loop used to spend)."""

from __future__ import annotations

import threading

from gpumesh.coordinator import reaper
from gpumesh.coordinator.store import Incoming, Store
from gpumesh.limits import INLINE_BLOB_BYTES


def incoming(store: Store, data: bytes) -> Incoming:
    inc = store.incoming()
    inc.write(data)
    inc.finish()
    return inc


def test_a_released_jobs_files_are_unlinked_on_the_reaper_thread(tmp_path, monkeypatch):
    s = Store(tmp_path / "data")
    try:
        big = b"x" * (INLINE_BLOB_BYTES + 1)
        s.create_job("j1", "", "function", None, {}, [("t1", 0, 1.0, incoming(s, big))])
        s.finish("t1", "done", 0, None, incoming(s, big), "j1")
        _, args_file = s.task_args("t1")
        (row,) = list(s.results_after("j1", -1, 10))
        paths = [s.file_path(args_file), s.file_path(row.result_file)]
        assert all(p.exists() for p in paths)
        unlinked_by: list[str] = []
        real_unlink = reaper.os.unlink

        def unlink(path):
            unlinked_by.append(threading.current_thread().name)
            real_unlink(path)
        monkeypatch.setattr(reaper.os, "unlink", unlink)
        s.release_job("j1")
        assert s.task_args("t1") == (None, None)  # the rows let go at once
        assert s.reaper.flush(10)
        assert not any(p.exists() for p in paths)
        assert unlinked_by == ["payload-reaper"] * 2
        # ...and the job's now empty folders went after their files
        assert not (s.blob_dir / "args" / "j1").exists()
        assert not (s.blob_dir / "results" / "j1").exists()
    finally:
        s.close()


def test_close_finishes_what_is_queued_and_a_missing_file_is_skipped(tmp_path):
    r = reaper.Reaper()
    files = [tmp_path / f"f{i}" for i in range(3)]
    for f in files:
        f.write_bytes(b"1")
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "sub" / "g").write_bytes(b"2")
    r.remove(files=[*files, tmp_path / "never-there"], dirs=[tmp_path / "d"],
             trees=[tmp_path / "d"])
    r.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    r.close()  # twice: nothing happens


def test_only_the_results_of_jobs_read_under_locks_go_to_the_pool(tmp_path):
    from gpumesh import handoff
    if handoff.fcntl is None:
        return  # (no pool without flock)
    s = Store(tmp_path / "data")
    try:
        big = b"x" * (2 << 20)
        for j in ("locked", "unlocked", "unread"):
            s.create_job(j, "", "function", None, {}, [(f"{j}t", 0, 1.0, incoming(s, big))])
            s.finish(f"{j}t", "done", 0, None, incoming(s, big), j)
        s.note_readers("locked", "result", True)
        s.note_readers("unlocked", "result", True)
        s.note_readers("unlocked", "result", False)  # one answer went to a reader without locks
        results = {j: s.file_path(next(iter(s.results_after(j, -1, 1))).result_file)
                   for j in ("locked", "unlocked", "unread")}
        inode = {j: p.stat().st_ino for j, p in results.items()}
        s.release_jobs(["locked", "unlocked", "unread"])
        assert s.reaper.flush(10)
        pooled = {p.stat().st_ino for p in s.handoff_dir.iterdir() if handoff.FREE.fullmatch(p.name)}
        assert pooled == {inode["locked"]}  # its arguments' file and the others' were deleted
        assert not any(p.exists() for p in results.values())
        assert not list((s.blob_dir / "args").iterdir())
    finally:
        s.close()
    assert not [p for p in s.handoff_dir.iterdir() if handoff.FREE.fullmatch(p.name)]  # closed: emptied


def test_only_the_arguments_of_jobs_leased_under_locks_go_to_the_pool(tmp_path):
    """A lease that named a job's arguments' file to a worker that maps under locks lets
    it be pooled once the job is released; one that sent the bytes (the coordinator
    streams them from the file), or none at all, does not."""
    from gpumesh import handoff
    if handoff.fcntl is None:
        return  # (no pool without flock)
    s = Store(tmp_path / "data")
    try:
        big = b"x" * (2 << 20)
        jobs = ("locked", "sent", "unleased")
        for j in jobs:
            s.create_job(j, "", "function", None, {}, [(f"{j}t", 0, 1.0, incoming(s, big))])
            s.finish(f"{j}t", "done", 0, None, incoming(s, big), j)
        s.note_readers("locked", "args", True)
        s.note_readers("locked", "args", True)  # a retry, leased by path again
        s.note_readers("sent", "args", True)
        s.note_readers("sent", "args", False)  # its retry went to a worker over HTTP
        args = {j: s.file_path(s.task_args(f"{j}t")[1]) for j in jobs}
        inode = {j: p.stat().st_ino for j, p in args.items()}
        s.release_jobs(list(jobs))
        assert s.reaper.flush(10)
        pooled = {p.stat().st_ino for p in s.handoff_dir.iterdir() if handoff.FREE.fullmatch(p.name)}
        assert pooled == {inode["locked"]}  # the results (no reader noted) were deleted too
        assert not any(p.exists() for p in args.values())
        assert not list((s.blob_dir / "args").iterdir()) and not list((s.blob_dir / "results").iterdir())
    finally:
        s.close()
