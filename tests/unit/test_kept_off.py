"""A worker that cannot run a job's tasks (it lacks a module, has another version of the
module's package, cannot build the job's ``requires=``) is kept off the job, and the task
runs on another; only when no alive worker is left that could run it does it fail, with
each worker's reason (coordinator.requeue.keep_off). Real store, fake clock."""

from __future__ import annotations

import asyncio

from gpumesh.cli.doctor import pool_checks


def _lease(coord, wid):
    return asyncio.run(coord.lease(wid, 1, 0.0))


def _submit(coord, job_id="bbbb01", requires=None):
    meta = {"timeout": None}
    if requires:
        meta["require"] = {"requires": requires}
    job, _ = coord.submit(job_id, "fn", "function", "f" * 64, meta, [b"a"], [1.0], False)
    return job


def _worker(coord, host, python, installs=False):
    return coord.register({"hostname": host, "python": python, "allow_installs": installs,
                           "packages": {}}, None, 1)


GAP = {"kind": "unpickle", "type": "ModuleNotFoundError", "module": "numpy._core.numeric",
       "package": "numpy", "package_version": "1.26.4",
       "message": "No module named 'numpy._core.numeric' (raised while loading ...)"}


def _final(store, job_id):
    (row,) = store.results_after(job_id, -1, 10)
    return row


def test_a_version_gap_is_tried_elsewhere_and_never_called_missing(coord, store):
    a = _worker(coord, "vm", "3.12.1")
    b = _worker(coord, "box", "3.12.1")
    job = _submit(coord)
    (g,) = _lease(coord, a.id) or _lease(coord, b.id)
    first = coord.leases[g.task_id].worker_id
    other = b.id if first == a.id else a.id
    assert coord.post_result(g.task_id, g.lease_id, "error", dict(GAP), None) == first
    assert job.excludes(first) and not job.excludes(other)
    assert _lease(coord, first) == []  # kept off this job
    # what the pool remembers says "another version", not "lacks"
    views = {w.id: coord.worker_view(w) for w in (a, b)}
    assert "lacks" not in views[first]
    assert views[first]["version_gaps"] == [
        {"module": "numpy._core.numeric", "package": "numpy", "version": "1.26.4"}]
    (doctor,) = [c for c in pool_checks(list(views.values()), "http://x")
                 if c.name in ("pool versions", "pool modules")]
    assert doctor.name == "pool versions"
    assert doctor.detail.startswith("recent calls needed modules that the workers' versions of "
                                    "their packages do not have: numpy._core.numeric is not in "
                                    "numpy 1.26.4 on ")
    assert "lack" not in doctor.detail and "lack" not in doctor.fix
    # the other worker has it too, in the same version: now it fails, in those words
    (g2,) = _lease(coord, other)
    coord.post_result(g2.task_id, g2.lease_id, "error", dict(GAP), None)
    err = _final(store, job.id).error
    assert err["kind"] == "missing_module" and err["package"] == "numpy"
    hosts = [f"{coord.workers[w].info['hostname']} ({w}, Python 3.12.1) has numpy 1.26.4"
             for w in sorted((a.id, b.id))]  # (by worker id)
    assert err["message"] == (
        f"No module named 'numpy._core.numeric' in the version of numpy on any worker that "
        f"could run this task ({'; '.join(hosts)}): the caller's numpy is likely another "
        f"version, one that has it. Install the same numpy version on the caller and the "
        f"workers, or call with requires=[\"numpy==<the caller's version>\"] on workers "
        f"joined with --allow-installs")


def test_a_missing_module_keeps_its_words(coord, store):
    a = _worker(coord, "vm", "3.12.1")
    job = _submit(coord)
    (g,) = _lease(coord, a.id)
    coord.post_result(g.task_id, g.lease_id, "error", {
        "kind": "raised", "type": "ModuleNotFoundError", "module": "gm_x", "message": "x"}, None)
    assert _final(store, job.id).error["message"] == (
        f"No module named 'gm_x' on any worker that could run this task: vm ({a.id}, Python "
        f"3.12.1) lacks it; install it there (or join a worker that has it) and call again")
    assert coord.worker_view(a)["lacks"] == ["gm_x"] and "version_gaps" not in coord.worker_view(a)


BUILD = {"kind": "requires", "type": "InstallError",
         "message": "uv could not install ['pandas>=3']: the current Python version (3.10.13) "
                    "does not satisfy Python>=3.11"}


def test_a_requires_one_worker_cannot_build_runs_on_another(coord, store):
    old = _worker(coord, "old", "3.10.13", installs=True)
    new = _worker(coord, "new", "3.12.1", installs=True)
    job = _submit(coord, requires=["pandas>=3"])
    (g,) = _lease(coord, old.id)
    assert coord.post_result(g.task_id, g.lease_id, "error", dict(BUILD), None) == old.id
    assert job.excludes(old.id) and job.n_final == 0
    assert _lease(coord, old.id) == []
    (g2,) = _lease(coord, new.id)
    assert g2.task_id == g.task_id and g2.attempt == 2
    coord.post_result(g2.task_id, g2.lease_id, "ok", None, b"R")
    assert _final(store, job.id).state == "done"
    (row,) = store.task_rows(job.id)
    assert row["history"][0]["ended"].startswith(
        "this worker could not provide requires=: uv could not install")


def test_a_requires_no_worker_can_build_names_each_workers_reason(coord, store):
    old = _worker(coord, "old", "3.10.13", installs=True)
    older = _worker(coord, "older", "3.9.18", installs=True)
    job = _submit(coord, requires=["pandas>=3"])
    for w, why in ((old, BUILD["message"]), (older, "uv could not install ['pandas>=3']: no wheels")):
        (g,) = _lease(coord, w.id)
        coord.post_result(g.task_id, g.lease_id, "error", dict(BUILD, message=why), None)
    row = _final(store, job.id)
    assert row.state == "failed" and row.error["kind"] == "requires"
    reasons = sorted([(old.id, f"old ({old.id}, Python 3.10.13) could not provide requires=: "
                               + BUILD["message"]),
                      (older.id, f"older ({older.id}, Python 3.9.18) could not provide requires=: "
                                 "uv could not install ['pandas>=3']: no wheels")])
    assert row.error["message"] == (
        "no alive worker could run this task: " + "; ".join(r for _, r in reasons)
        + "; join a worker that can (for requires=, one whose Python the packages support), "
          "or change what the call needs")
