"""Results posted several per request and a slot's queue of grants (``result_batch``):
the same values, in order, with a batching coordinator and worker, and with either end
from before the feature (the one-at-a-time path)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from gpumesh import accelerate

from ..conftest import Proc

#: Imported at start-up by each process whose PYTHONPATH names its directory: applies the
#: hooks $GPUMESH_TEST_HOOK lists, then drops the variable (the task processes get none).
#:   count:PATH      the coordinator appends the size of each result batch to PATH
#:   old-coordinator the coordinator offers no feature (as one from before result_batch)
#:   old-worker      the worker uses no feature (as one from before result_batch)
SITECUSTOMIZE = '''
import os
for hook in filter(None, os.environ.pop("GPUMESH_TEST_HOOK", "").split(",")):
    if hook.startswith("count:"):
        from gpumesh.coordinator.routes import batch
        def _counted(meta, n, _read=batch.read_batch, _path=hook[6:]):
            got = _read(meta, n)
            with open(_path, "a") as fh:
                fh.write(f"{len(got.results)}\\n")
            return got
        batch.read_batch = _counted
    elif hook == "old-coordinator":
        from gpumesh.coordinator.routes import workers
        workers.FEATURES = ()
    elif hook == "old-worker":
        from gpumesh.worker.agent import WorkerAgent
        WorkerAgent.FEATURES = frozenset()
'''


def hooked(m, tmp_path: Path, coordinator: str = "", worker: str = "", workers: int = 1,
           slots: int = 2) -> Path:
    """Start ``m``'s coordinator and ``workers`` workers with the hooks named (see
    :data:`SITECUSTOMIZE`); returns the file the batch sizes are counted in."""
    hooks = tmp_path / "hooks"
    hooks.mkdir(exist_ok=True)
    (hooks / "sitecustomize.py").write_text(SITECUSTOMIZE)
    counts = tmp_path / "batches.txt"
    counts.write_text("")
    env = dict(m.env, PYTHONPATH=str(hooks),
               GPUMESH_TEST_HOOK=",".join(filter(None, [f"count:{counts}", coordinator])))
    args = ["serve", "--port", str(m.port), "--data-dir", str(m.root / "data"), "--no-self-worker"]
    m.serve_args = args
    m.coordinator = Proc(args, env, m.root / "coordinator.log")
    m.procs.append(m.coordinator)
    m.wait_health()
    for n in range(workers):
        wenv = dict(m.env, PYTHONPATH=str(hooks), GPUMESH_TEST_HOOK=worker)
        m.procs.append(Proc(["join", m.url, "--slots", str(slots)], wenv,
                            m.root / f"worker{n}.log"))
    m.wait_alive(workers)
    return counts


def batches(counts: Path) -> list[int]:
    return [int(x) for x in counts.read_text().split()]


def _attempts(m) -> list[int]:
    """Each task's attempt number in the mesh's (one) job."""
    auth = {"authorization": f"Bearer {m.token}"}
    (job,) = httpx.get(f"{m.url}/v1/jobs", headers=auth, timeout=10).json()
    view = httpx.get(f"{m.url}/v1/jobs/{job['id']}", headers=auth, timeout=10).json()
    return [t["attempts"] for t in view["tasks"]]


def _square_map(m, n: int):
    @accelerate(m.client(output=False), isolation="job")
    def square(i):
        import os
        return i * i, os.getpid()

    return square.map(range(n))


def test_a_200_task_job_isolation_map_returns_every_value_in_order_in_batches(tmp_path, make_mesh):
    m = make_mesh(workers=0)
    m.stop()
    m.procs.clear()
    counts = hooked(m, tmp_path, workers=2, slots=2)
    got = _square_map(m, 200)
    assert [v for v, _pid in got] == [i * i for i in range(200)]
    assert 1 <= len({pid for _v, pid in got}) <= 4, "one process per slot for the job"
    sizes = batches(counts)
    assert sum(sizes) == 200, "every result went in a batch, once"
    assert len(sizes) < 200 and max(sizes) > 1, "several results per request"
    assert _attempts(m) == [1] * 200, "no task ran twice"


def test_an_old_coordinator_gets_one_result_per_request_from_a_new_worker(tmp_path, make_mesh):
    m = make_mesh(workers=0)
    m.stop()
    m.procs.clear()
    counts = hooked(m, tmp_path, coordinator="old-coordinator")
    registered = m.workers()
    assert len(registered) == 1
    got = _square_map(m, 60)
    assert [v for v, _pid in got] == [i * i for i in range(60)]
    assert batches(counts) == [], "the worker used the one-at-a-time path"
    assert _attempts(m) == [1] * 60


def test_a_new_coordinator_serves_an_old_worker_one_result_per_request(tmp_path, make_mesh):
    m = make_mesh(workers=0)
    m.stop()
    m.procs.clear()
    counts = hooked(m, tmp_path, worker="old-worker")
    got = _square_map(m, 60)
    assert [v for v, _pid in got] == [i * i for i in range(60)]
    assert batches(counts) == []
    assert _attempts(m) == [1] * 60


def test_the_registration_answer_names_the_feature_unless_the_coordinator_lacks_it(tmp_path,
                                                                                   make_mesh):
    m = make_mesh(workers=0)
    r = httpx.post(f"{m.url}/v1/workers", json={"slots": 1, "hostname": "box"},
                   headers={"authorization": f"Bearer {m.token}"}, timeout=10)
    assert r.status_code == 200, r.text
    assert r.json()["features"] == ["result_batch"]
    assert json.loads(r.text)["version"]
