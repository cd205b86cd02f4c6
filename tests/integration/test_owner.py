"""The machine's owner stays in charge, with real processes on 127.0.0.1: `gpumesh pause`
/ `resume` through the local control channel, tasks handed back as preempted (no attempt
used, exactly one result), GPUs that yield to a "game" or cool down, the end of the hours,
what is shared (--gpus, --max-gpu-memory), and the states in `gpumesh workers` and the API.

A task learns which worker runs it from ``OWNER_TEST_ROLE`` in the worker's environment;
GPUs are faked through the GPUMESH_FAKE_GPUS hook (a file the tests rewrite).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from contextlib import closing
from datetime import datetime

import pytest

from gpumesh import Unsatisfiable, accelerate
from gpumesh.limits import HEARTBEAT_INTERVAL_S, LONG_POLL_S
from tests.conftest import Mesh, Proc, alive, wait_for

RTX = {"name": "NVIDIA GeForce RTX 4090", "memory_total_mb": 24564, "memory_free_mb": 20000, "score": 3000}


def start_worker(m: Mesh, name: str, *args: str, role: str = "", gpus: str = "[]") -> Proc:
    env = dict(m.env, OWNER_TEST_ROLE=role or name, GPUMESH_FAKE_GPUS=gpus)
    proc = Proc(["join", m.url, *args], env, m.root / f"{name}.log")
    m.procs.append(proc)
    return proc


def joined_id(proc: Proc) -> str:
    got = wait_for(lambda: re.search(r"joined mesh as ([0-9a-f]+)", proc.output()), 30, "the join")
    return got.group(1)


def cli(m: Mesh, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpumesh", *args], env=dict(m.env, GPUMESH_URL=m.url),
                          capture_output=True, text=True, timeout=60)


def worker(m: Mesh, wid: str) -> dict:
    return next(w for w in m.workers() if w["id"] == wid)


def owner_label(m: Mesh, wid: str) -> str | None:
    return (worker(m, wid).get("owner") or {}).get("label")


def gone(pid: int) -> bool:
    return not alive(pid)  # a zombie has ended


def markers(d) -> list[tuple[str, str, int, float]]:
    """(item, where, pid, mtime) of every task start recorded in ``d``."""
    out = []
    for p in d.iterdir():
        item, where, pid = p.name.split(".")
        out.append((item, where, int(pid), p.stat().st_mtime))
    return out


def recorder(d, slow_role: str = "slow", seconds: float = 60.0):
    """A task that records where it started, then sleeps ``seconds`` on the ``slow_role``
    worker (forever, for the test) and returns (item, where) at once elsewhere."""
    marker_dir = str(d)

    def work(i):
        import os as _os
        import time as _t
        where = _os.environ.get("CUDA_VISIBLE_DEVICES") or _os.environ.get("OWNER_TEST_ROLE", "")
        open(f"{marker_dir}/{i}.{where}.{_os.getpid()}", "w").close()
        print(f"item {i} started on {where}", flush=True)
        if _os.environ.get("OWNER_TEST_ROLE") == slow_role:
            _t.sleep(seconds)
        return i, where
    return work


# ---------------------------------------------------------------- pause / resume -----

def test_paused_worker_gets_no_task_while_another_takes_the_queue(make_mesh, tmp_path):
    m = make_mesh(workers=0)
    a, b = start_worker(m, "a"), start_worker(m, "b")
    ida, idb = joined_id(a), joined_id(b)
    r = cli(m, "pause", "--worker", ida)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"[OK] paused worker {ida} ({worker(m, ida)['hostname']}): no new tasks; no task running"
    wait_for(lambda: owner_label(m, ida) == "paused: owner", 10, "the coordinator to see the pause")
    assert owner_label(m, idb) is None
    table = cli(m, "workers").stdout
    line_a = next(ln for ln in table.splitlines() if ida[:8] in ln)
    assert line_a.endswith("[alive] [paused: owner]  slots: 1 CPU"), table
    assert next(ln for ln in table.splitlines() if idb[:8] in ln).endswith("[alive]  slots: 1 CPU")

    d = tmp_path / "ran"
    d.mkdir()
    with closing(m.client(output=False)) as c:
        got = accelerate(c)(recorder(d, slow_role="none")).map(range(6))
    assert got == [(i, "b") for i in range(6)]
    assert {w for _, w, _, _ in markers(d)} == {"b"}

    r = cli(m, "resume")                                   # every worker of this user
    assert r.returncode == 0 and sorted(r.stdout.splitlines()) == sorted(
        [f"[OK] resumed worker {ida} ({worker(m, ida)['hostname']})",
         f"[OK] worker {idb} ({worker(m, idb)['hostname']}) was not paused: nothing to resume"])
    wait_for(lambda: owner_label(m, ida) is None, 10, "the coordinator to see the resume")
    r = cli(m, "pause", "--worker", "feedfacecafe")
    assert r.returncode == 1 and "no running worker of this user has the id feedfacecafe" in r.stderr
    r = cli(m, "pause", "--for", "soon")
    assert r.returncode == 2 and "--for='soon'" in r.stderr
    r = cli(m, "pause", "--worker", ida, "--for", "2h")
    assert r.returncode == 0 and re.search(r"for 2h \(until \d\d:\d\d\): no new tasks", r.stdout)
    assert "paused already" not in r.stdout
    r = cli(m, "pause", "--worker", ida)                    # again: the newest command wins
    assert r.returncode == 0 and r.stdout.strip() == (
        f"[OK] paused worker {ida} ({worker(m, ida)['hostname']}): no new tasks; no task running"
        " (it was paused already: this pause replaces that one)")
    r = cli(m, "pause", "--worker", ida, "--for", "2h")
    until = wait_for(lambda: (worker(m, ida).get("owner") or {}).get("until"), 10, "the pause's end")
    assert 7100 < until - time.time() <= 7200
    r = cli(m, "pause", "--worker", ida, "--for", "20s")   # under an hour: to the second
    assert r.returncode == 0 and re.search(r"for 20s \(until \d\d:\d\d:\d\d\): no new tasks", r.stdout)


def test_pause_without_a_worker_says_so(make_mesh):
    m = make_mesh(workers=0)
    r = cli(m, "pause")
    assert r.returncode == 1
    assert r.stderr.strip() == "Error: no gpumesh worker of this user is running on this machine"
    assert cli(m, "resume").returncode == 1


def no_loss(task: dict) -> bool:
    """Every attempt of ``task`` before its last was handed back (preempted), none lost."""
    earlier = task.get("history") or []
    return task["attempts"] == len(earlier) + 1 and all(h.get("preempted") for h in earlier)


def test_pause_now_hands_the_running_task_back(make_mesh, tmp_path):
    m = make_mesh(workers=0)
    slow, fast = start_worker(m, "slow"), start_worker(m, "fast")
    ids, idf = joined_id(slow), joined_id(fast)
    assert cli(m, "pause", "--worker", idf).returncode == 0
    wait_for(lambda: owner_label(m, idf) == "paused: owner", 10, "the pause")
    d = tmp_path / "ran"
    d.mkdir()
    out: list = []
    with closing(m.client(output=False)) as c:
        fn = accelerate(c)(recorder(d))
        th = threading.Thread(target=lambda: out.append(fn.map([0, 1])), daemon=True)
        th.start()
        (item, where, pid, _), = wait_for(lambda: markers(d), 30, "the first task to start")
        assert (item, where) == ("0", "slow")
        job = c.jobs()[0]
        # the job waits for the busy worker, not for the paused one: no "waiting" reason
        assert "waiting" not in c.status(job["id"])
        assert cli(m, "resume", "--worker", idf).returncode == 0
        r = cli(m, "pause", "--now", "--worker", ids)
        t0 = time.monotonic()
        assert r.returncode == 0 and "no new tasks; 1 running task(s) handed back" in r.stdout
        wait_for(lambda: gone(pid), 2.0, "the task's process to be killed")
        assert time.monotonic() - t0 <= 2.0
        th.join(30)
        assert not th.is_alive()
        assert out == [[(0, "fast"), (1, "fast")]]           # exactly one result per item
        view = c.status(job["id"])
        assert view["counts"] == {"done": 2} and view["preempted"] == 1
        # the handed-back try keeps its own number, marked preempted, and is no loss
        assert [t["attempts"] for t in view["tasks"]] == [2, 1]
        assert [(h["attempt"], h.get("preempted")) for h in view["tasks"][0]["history"]] == [(1, True)]
        assert {t["worker_id"] for t in view["tasks"]} == {idf}
        logs = {t["index"]: t for t in c.logs(job["id"])}
        assert "item 0 started on slow" in logs[0]["stdout"] and "item 0 started on fast" in logs[0]["stdout"]
        assert re.search(r"\[gpumesh: attempt 1 on .+ ended here, preempted "
                         r"\(paused: owner\); the task runs again\]", logs[0]["stderr"])
    assert "[worker] paused by the owner: no new tasks; running ones handed back" in slow.output()
    assert re.search(r"\[worker\] task [0-9a-f]+ handed back \(paused: owner\)", slow.output())


def test_pause_lets_the_running_task_finish_and_starts_no_next(make_mesh, tmp_path):
    m = make_mesh(workers=0)
    a = start_worker(m, "slow")
    ida = joined_id(a)
    d = tmp_path / "ran"
    d.mkdir()
    out: list = []
    with closing(m.client(output=False)) as c:
        fn = accelerate(c)(recorder(d, seconds=2.0))
        th = threading.Thread(target=lambda: out.append(fn.map([0, 1])), daemon=True)
        th.start()
        (_, _, pid, _), = wait_for(lambda: markers(d), 30, "the first task to start")
        r = cli(m, "pause")
        assert r.returncode == 0 and "no new tasks; 1 running task(s) finish" in r.stdout
        job = c.jobs()[0]
        wait_for(lambda: c.status(job["id"])["counts"].get("done") == 1, 10,
                 lambda: f"the running task to finish; the job: {c.status(job['id'])}")
        time.sleep(1.5)                                    # the next item does not start here
        assert len(markers(d)) == 1 and gone(pid)           # it ended by itself
        view = c.status(job["id"])
        assert view["counts"] == {"done": 1, "pending": 1} and "preempted" not in view
        assert cli(m, "resume").returncode == 0
        th.join(30)
        assert out == [[(0, "slow"), (1, "slow")]]
        assert [t["attempts"] for t in c.status(job["id"])["tasks"]] == [1, 1]
    assert owner_label(m, ida) is None


def test_a_job_whose_only_worker_is_paused_waits_and_says_why(make_mesh, tmp_path):
    m = make_mesh(workers=0)
    a = start_worker(m, "a")
    ida = joined_id(a)
    assert cli(m, "pause").returncode == 0
    wait_for(lambda: owner_label(m, ida) == "paused: owner", 10, "the pause")
    d = tmp_path / "ran"
    d.mkdir()
    out: list = []
    with closing(m.client(output=False)) as c:
        fn = accelerate(c)(recorder(d, slow_role="none"))
        th = threading.Thread(target=lambda: out.append(fn.map([0])), daemon=True)
        th.start()
        job = wait_for(lambda: c.jobs(), 10, "the job")[0]
        time.sleep(1.0)
        view = c.status(job["id"])
        assert view["state"] == "active" and view["counts"] == {"pending": 1}
        host = worker(m, ida)["hostname"]
        assert view["waiting"] == f"waiting: every worker that can run it is unavailable: {host} [paused: owner]"
        r = cli(m, "status", job["id"])
        assert r.returncode == 0
        assert f"  Waiting: every worker that can run it is unavailable: {host} [paused: owner]" in r.stdout
        assert list(d.iterdir()) == []
        assert cli(m, "resume").returncode == 0
        th.join(30)
        assert out == [[(0, "a")]]
        assert "waiting" not in c.status(job["id"])


CALLER = """\
import sys, time
from gpumesh import GPUMesh, accelerate

marks = sys.argv[3]
timeout = float(sys.argv[2]) if sys.argv[2] != "none" else None

@accelerate(GPUMesh(sys.argv[1]), timeout=timeout)
def double(x):
    import time as _t
    open(f"{marks}/{x}", "w").close()
    if x == 0:
        _t.sleep(8)  # long enough to pause its worker while it runs, and hear of it
    return 2 * x

t = time.monotonic()
try:
    print("value", double.map([int(a) for a in sys.argv[4:]]), flush=True)
except Exception as e:
    print("raised", type(e).__name__, e, flush=True)
print("took", round(time.monotonic() - t, 1), flush=True)
"""


def start_caller(m: Mesh, tmp_path, timeout: str, *items: int) -> tuple[subprocess.Popen, object]:
    """A caller process running ``double.map(items)``; its stderr goes to a file the test reads."""
    script, marks, err = tmp_path / "caller.py", tmp_path / "marks", tmp_path / "caller.err"
    script.write_text(CALLER)
    marks.mkdir(exist_ok=True)
    with open(err, "w") as fh:
        p = subprocess.Popen([sys.executable, str(script), m.url, timeout, str(marks),
                              *map(str, items)], env=m.env, stdout=subprocess.PIPE,
                             stderr=fh, text=True)
    return p, err


def test_a_call_waits_for_its_paused_worker_says_why_and_keeps_to_its_timeout(make_mesh, tmp_path):
    """Pausing the only worker is not losing it: the caller says it waits for a worker
    paused by its owner, and gives up after its own timeout= (TaskTimeout), not the no-worker
    wait; nothing ran, and the job was cancelled."""
    m = make_mesh(workers=0)
    ida = joined_id(start_worker(m, "a"))
    assert cli(m, "pause").returncode == 0
    wait_for(lambda: owner_label(m, ida) == "paused: owner", 10, "the pause")
    p, err = start_caller(m, tmp_path, "3", 1)
    try:
        out, _ = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 0, out
    with closing(m.client(output=False)) as c:
        job = c.jobs()[0]
    jid = job["id"]
    assert f"[gpumesh] job {jid} is waiting: 1 worker paused by its owner (no other worker in the mesh at " \
           f"{m.url} can run its tasks); waiting for up to 3s (the call's timeout=)\n" in err.read_text()
    assert "no live worker" not in err.read_text()
    lines = out.splitlines()
    assert re.fullmatch(rf"raised TaskTimeout 1 of 1 task\(s\) of job {jid} could not start for [34]s "
                        rf"\(the call's timeout=3s\): 1 worker paused by its owner, and no other worker "
                        rf"in the mesh at {re.escape(m.url)} can run them; they were cancelled", lines[0]), out
    assert 3 <= float(lines[1].split()[1]) < 3 + LONG_POLL_S / 2, out
    assert job["state"] == "cancelled" and list((tmp_path / "marks").iterdir()) == []


def test_a_call_waits_without_a_limit_for_a_worker_paused_mid_job_and_ends_on_resume(make_mesh, tmp_path):
    """No timeout=: a worker paused while it runs item 0 finishes it; item 1 waits for it
    (the caller hears why at once, not at the end of its long-poll) and runs on resume."""
    m = make_mesh(workers=0)
    ida = joined_id(start_worker(m, "a"))
    p, err = start_caller(m, tmp_path, "none", 0, 1)
    try:
        wait_for(lambda: (tmp_path / "marks" / "0").exists(), 30, "item 0 to start")
        assert cli(m, "pause").returncode == 0
        paused = time.monotonic()
        said = wait_for(lambda: re.search(r"\[gpumesh\] job ([0-9a-f]+) is waiting: 1 worker paused by "
                                          r"its owner \(no other worker in the mesh at \S+ can run its "
                                          r"tasks\); waiting until one takes tasks again\n",
                                          err.read_text()), 20, "the caller's notice")
        assert time.monotonic() - paused < 3.5  # woken by the pause, not by item 0's end
        time.sleep(1.0)  # item 1 still waits, and nothing gives up
        assert p.poll() is None and not (tmp_path / "marks" / "1").exists()
        assert owner_label(m, ida) == "paused: owner"
        assert cli(m, "resume").returncode == 0
        out, _ = p.communicate(timeout=60)
    finally:
        p.kill()
    assert out.splitlines()[0] == "value [0, 2]", out
    with closing(m.client(output=False)) as c:
        view = c.status(said.group(1))
    assert view["state"] == "finished" and [t["attempts"] for t in view["tasks"]] == [1, 1]
    assert "no live worker" not in err.read_text()


# ---------------------------------------------------------------- GPUs ---------------

def test_a_game_on_gpu0_makes_it_yield_while_gpu1_works_and_a_hot_gpu_pauses(make_mesh, tmp_path):
    m = make_mesh(workers=0)
    gpus = tmp_path / "gpus.json"

    def set_gpus(g0: dict, g1: dict) -> None:
        tmp = gpus.with_suffix(".tmp")
        tmp.write_text(json.dumps([dict(RTX, **g0), dict(RTX, **g1)]))
        os.replace(tmp, gpus)
    set_gpus({}, {})
    w = start_worker(m, "box", "--cpu-slots", "0", "--yield-gpu", "--busy-threshold", "20%",
                     "--yield-grace", "1s", "--max-temp", "80", role="box", gpus=f"@{gpus}")
    wid = joined_id(w)
    assert "[worker] yielding a GPU another program uses above 20% (grace 1s)" in w.output()
    d = tmp_path / "ran"
    d.mkdir()
    out: list = []
    with closing(m.client(output=False)) as c:
        fn = accelerate(c, gpu="cuda")(recorder(d, slow_role="box", seconds=3.0))
        th = threading.Thread(target=lambda: out.append(fn.map(range(6))), daemon=True)
        th.start()
        first0 = wait_for(lambda: [x for x in markers(d) if x[1] == "0"], 30, "a task on GPU 0")[0]
        set_gpus({"other_util_pct": 90}, {})                      # the owner starts a game
        t_game = time.time()
        wait_for(lambda: gone(first0[2]), 6, "GPU 0's task to be handed back after the grace")
        assert time.time() - t_game >= 1.0                        # not before the grace
        info = wait_for(lambda: worker(m, wid).get("gpu_states"), 5, "the GPU state")
        assert info == {"0": {"state": "yielding", "label": "yielding: GPU busy"}}
        assert "[cuda:0 yielding: GPU busy]" in cli(m, "workers").stdout
        dev = {x["device"]: x for x in c.devices()}
        assert dev["cuda:0"]["state"]["label"] == "yielding: GPU busy" and dev["cuda:1"]["state"] is None
        th.join(60)
        assert not th.is_alive()
        got = out[0]
        assert sorted(i for i, _ in got) == list(range(6))          # one result per item
        late = [x for x in markers(d) if x[3] > t_game + 2.5]      # started once the worker knew
        assert late and {x[1] for x in late} == {"1"}
        assert got[int(first0[0])][1] == "1"                        # the handed-back item ran on GPU 1
        view = c.status(c.jobs()[0]["id"])
        assert view["preempted"] >= 1 and all(no_loss(t) for t in view["tasks"])

        # the game ends; GPU 1 runs hot: it takes no new task until 5C below the limit
        set_gpus({}, {"temperature_c": 83})
        wait_for(lambda: worker(m, wid).get("gpu_states") == {"1": {"state": "hot", "label": "hot 83C"}},
                 10, "GPU 0 to reopen and GPU 1 to be hot")
        assert "[cuda:1 hot 83C]" in cli(m, "workers").stdout
        set_gpus({}, {"temperature_c": 78})
        wait_for(lambda: worker(m, wid).get("gpu_states") == {"1": {"state": "hot", "label": "hot 78C"}},
                 10, "GPU 1 still cooling down")
        set_gpus({}, {"temperature_c": 74})
        wait_for(lambda: worker(m, wid).get("gpu_states") == {}, 10, "GPU 1 to reopen")
    assert "[worker] cuda:0 yielding: GPU busy: no new tasks there" in w.output()
    assert "[worker] cuda:1 taking tasks again" in w.output()


def test_a_gpu_that_stops_yielding_takes_the_waiting_task_at_once(make_mesh, tmp_path):
    # While GPU 0 yields, the worker's lease poll names only its CPU slot. When the GPU
    # reopens, the heartbeat that says so must hand it the waiting GPU task then, not
    # when that poll runs out (LONG_POLL_S) and the worker asks again.
    m = make_mesh(workers=0)
    gpus = tmp_path / "gpus.json"

    def set_gpu(**state) -> None:
        tmp = gpus.with_suffix(".tmp")
        tmp.write_text(json.dumps([dict(RTX, **state)]))
        os.replace(tmp, gpus)
    set_gpu(other_util_pct=90)                                 # a game holds GPU 0
    w = start_worker(m, "box", "--cpu-slots", "1", "--yield-gpu", "--busy-threshold", "20%",
                     "--yield-grace", "1s", role="box", gpus=f"@{gpus}")
    wid = joined_id(w)
    wait_for(lambda: worker(m, wid).get("gpu_states") == {"0": {"state": "yielding",
                                                                "label": "yielding: GPU busy"}},
             10, "GPU 0 to yield")

    def where():
        import os as _os
        return _os.environ.get("CUDA_VISIBLE_DEVICES") or "cpu"
    out: list = []
    with closing(m.client(output=False)) as c:
        # A CPU task first: once its result is in, the worker's next poll (naming the CPU
        # slot only) has just begun, so that poll would outlast the bound below.
        assert accelerate(c, gpu="cpu")(where)() == "cpu"
        th = threading.Thread(target=lambda: out.append(accelerate(c, gpu="cuda")(where)()),
                              daemon=True)
        th.start()
        set_gpu()                                              # the game ends
        th.join(LONG_POLL_S - 6)   # a heartbeat, the 1 s quiet spell, the task: seconds
        assert not th.is_alive(), "the GPU task waited for the worker's next lease poll"
    assert out == ["0"]


def test_what_is_shared_gpus_and_their_memory(make_mesh, tmp_path):
    m = make_mesh(workers=0)
    gpus = tmp_path / "gpus.json"
    gpus.write_text(json.dumps([RTX, dict(RTX, memory_free_mb=5000)]))
    w = start_worker(m, "box", "--gpus", "1", "--max-gpu-memory", "8GB", "--cpu-slots", "0", gpus=f"@{gpus}")
    wid = joined_id(w)
    assert "[worker] GPUs shared: cuda:1" in w.output()
    assert "[worker] GPU memory offered: at most 7629 MiB per GPU" in w.output()
    info = worker(m, wid)
    assert [(g["index"], g["memory_total_mb"], g["memory_free_mb"]) for g in info["gpus"]] == [(1, 7629, 5000)]
    gpus.write_text(json.dumps([RTX, dict(RTX, memory_free_mb=3000)]))     # heartbeats report it ...
    wait_for(lambda: worker(m, wid)["gpus"][0]["memory_free_mb"] == 3000, 10, "the new free memory")
    gpus.write_text(json.dumps([RTX, dict(RTX, memory_free_mb=24000)]))    # ... never above the cap
    wait_for(lambda: worker(m, wid)["gpus"][0]["memory_free_mb"] == 7629, 10, "the capped free memory")
    time.sleep(2 * HEARTBEAT_INTERVAL_S)
    assert worker(m, wid)["gpus"][0]["memory_free_mb"] == 7629
    assert info["slot_list"] == [{"id": 0, "kind": "cuda", "gpu": 1}]
    with closing(m.client(output=False)) as c:
        def where():
            import os as _os
            return _os.environ.get("CUDA_VISIBLE_DEVICES")
        assert accelerate(c, gpu="cuda")(where)() == "1"
        with pytest.raises(Unsatisfiable, match="7629 MiB"):
            accelerate(c, gpu_memory="16GB")(where)()
    cpu_only = start_worker(m, "cpu", "--gpus", "none", gpus=f"@{gpus}")
    cid = joined_id(cpu_only)
    info = worker(m, cid)
    assert info["gpus"] == [] and info["device"] == "CPU" and info["slot_list"] == [{"id": 0, "kind": "cpu"}]


# ---------------------------------------------------------------- hours --------------

def test_the_end_of_the_hours_hands_running_tasks_back(make_mesh, tmp_path, monkeypatch):
    """An in-process worker whose clock the test moves past the end of its window."""
    from gpumesh.worker.agent import WorkerAgent
    from gpumesh.worker.device import detect
    from gpumesh.worker.owner import OwnerState, Policy, Window

    m = make_mesh(workers=0)
    b = start_worker(m, "fast")
    idb = joined_id(b)
    assert cli(m, "pause", "--worker", idb).returncode == 0       # B waits while A has the task
    monkeypatch.setenv("OWNER_TEST_ROLE", "slow")
    monkeypatch.setenv("GPUMESH_FAKE_GPUS", "[]")
    now = [datetime(2026, 12, 7, 23, 0).timestamp()]                # Monday 23:00, local time
    policy = Policy(hours=(Window.parse("22:00-08:00"),), at_window_end="requeue")
    events: list = []
    agent = WorkerAgent(m.url, m.token, slots=1, info=detect(), bench=False,
                        owner=OwnerState(policy, clock=lambda: now[0]),
                        on_event=lambda kind, text: events.append(text))
    runner = threading.Thread(target=agent.run, daemon=True)
    runner.start()
    try:
        wait_for(lambda: agent.id and any(x["id"] == agent.id for x in m.workers()), 30, "A to join")
        d = tmp_path / "ran"
        d.mkdir()
        out: list = []
        with closing(m.client(output=False)) as c:
            fn = accelerate(c)(recorder(d))
            th = threading.Thread(target=lambda: out.append(fn.map([0])), daemon=True)
            th.start()
            (_, where, pid, _), = wait_for(lambda: markers(d), 30, "the task to start on A")
            assert where == "slow"
            assert cli(m, "resume", "--worker", idb).returncode == 0
            now[0] = datetime(2026, 12, 8, 8, 0).timestamp()        # Tuesday 08:00: the window ends
            wait_for(lambda: gone(pid), 5, "the task to be handed back")
            th.join(30)
            assert out == [[(0, "fast")]]
            view = c.status(c.jobs()[0]["id"])
            assert view["preempted"] == 1 and view["tasks"][0]["attempts"] == 2
            assert no_loss(view["tasks"][0])
            assert owner_label(m, agent.id) == "outside hours"
            # (when the window opens next, as a pause --for says when it ends)
            assert worker(m, agent.id)["owner"]["until"] == datetime(2026, 12, 8, 22, 0).timestamp()
            line = next(ln for ln in cli(m, "workers").stdout.splitlines() if agent.id[:8] in ln)
            assert "[alive] [outside hours]  slots: " in line
        assert "outside the sharing hours until 22:00: no new tasks; running ones handed back" in events
    finally:
        agent.stop()
        runner.join(15)
