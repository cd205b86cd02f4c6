"""Unit tests for the placement policy (pure) and the coordinator's use of it (real Store,
fake clock, no sockets): hard filters, cost ranking, stragglers, fairness, VRAM hints,
unsatisfiable jobs."""

from __future__ import annotations

import asyncio

import pytest

from gpumesh import hardware as hw
from gpumesh.coordinator import placement as pl
from gpumesh.coordinator.core import Unsatisfiable
from gpumesh.hardware import Slot

# ---------------------------------------------------------------- pick() -------------


@pytest.mark.parametrize("costs, p, chosen", [
    ([1, 1, 1], 1.0, 0),          # equal costs: FIFO, whatever the slot
    ([1, 1, 1], 0.0, 0),
    ([1, 5, 3], 1.0, 1),          # the strongest slot takes the heaviest
    ([1, 5, 3], 0.0, 0),          # the weakest the lightest
    ([1, 5, 3], 0.5, 2),          # the middle one the median
    ([2, 9, 9, 1], 1.0, 1),       # ties: the earliest of the chosen cost
    ([2, 9, 9, 1], 0.01, 3),
    ([4, 4, 8], 0.4, 0),
])
def test_pick(costs, p, chosen):
    assert pl.pick(list(enumerate(costs)), p) == chosen


def test_pick_keeps_positions():
    assert pl.pick([(3, 1.0), (7, 2.0)], 1.0) == 7


def test_relative_and_strength():
    assert pl.relative(50, 100) == 0.5 and pl.relative(0, 0) == 1.0 and pl.relative(200, 100) == 1.0
    s = Slot("w", 0, "cpu", score=80.0)
    assert pl.strength(s) == 80.0
    assert pl.strength(s, {("w", 0)}) == 80.0 * pl.STRAGGLER_PENALTY


def test_order_slots_strongest_first_gpu_before_cpu_on_ties():
    slots = [Slot("w", 0, "cpu", score=10), Slot("w", 1, "cuda", 0, score=500),
             Slot("w", 2, "cuda", 1, score=10), Slot("w", 3, "cuda", 2, score=900)]
    assert [s.id for s in pl.order_slots(slots)] == [3, 1, 2, 0]
    assert [s.id for s in pl.order_slots(slots, {("w", 3)})] == [1, 3, 2, 0]


# ---------------------------------------------------------------- stragglers ---------

def test_one_heavy_task_does_not_make_the_strong_slot_a_straggler():
    st = pl.SlotStats()
    strong, weak = ("big", 0), ("small", 0)
    st.record(strong, "f", seconds=40.0, cost=10.0, now=0)   # the heavy task: 4 s per unit
    for i in range(5):
        st.record(weak, "f", seconds=8.0, cost=1.0, now=i)   # light tasks: 8 s per unit
    assert st.rate(strong, "f", 10) == pytest.approx(4.0)
    assert st.stragglers("f", 10) == set()     # per unit of cost, the strong slot is faster


def test_straggler_needs_evidence_and_compares_with_the_others():
    st = pl.SlotStats()
    for k in range(3):
        st.record(("w", k), "f", 3.0, 3.0, now=0)
    st.record(("slow", 0), "f", 10.0, 1.0, now=0)
    assert st.rate(("slow", 0), "f", 0) is None           # 1 unit of cost: not enough
    assert st.stragglers("f", 0) == set()
    st.record(("slow", 0), "f", 20.0, 2.0, now=0)
    assert st.rate(("slow", 0), "f", 0) == pytest.approx(10.0)
    assert st.stragglers("f", 0) == {("slow", 0)}          # 10 s/unit vs a median of 1
    assert st.stragglers("g", 0) == set()                  # judged per function


def test_old_samples_fade():
    st = pl.SlotStats(half_life_s=100.0)
    for key in (("a", 0), ("b", 0)):
        st.record(key, "f", 3.0, 3.0, now=0)
    st.record(("slow", 0), "f", 30.0, 3.0, now=0)
    assert st.stragglers("f", 0) == {("slow", 0)}
    # A later run at normal speed outweighs the old samples...
    st.record(("slow", 0), "f", 12.0, 12.0, now=200)        # old weight 0.25: 7.5 s over 12.75
    assert st.rate(("slow", 0), "f", 200) == pytest.approx((7.5 + 12) / (0.75 + 12))
    # ...and without new samples the verdict lapses as the evidence decays.
    st2 = pl.SlotStats(half_life_s=100.0)
    for key in (("a", 0), ("b", 0)):
        st2.record(key, "f", 3.0, 3.0, now=0)
    st2.record(("slow", 0), "f", 30.0, 3.0, now=0)
    assert st2.stragglers("f", 50) == set()                 # 3 units decayed below the minimum
    st2.forget_worker("slow")
    assert st2.rate(("slow", 0), "f", 0) is None


def _stragglers_by_definition(st: pl.SlotStats, fn: str, now: float) -> set:
    """The rule as written in the docs: each slot against the median of the others."""
    rates = {k: r for k in st._acc.get(fn, {}) if (r := st.rate(k, fn, now)) is not None}
    out = set()
    for key, r in rates.items():
        others = sorted(v for k, v in rates.items() if k != key)
        if not others:
            continue
        mid = len(others) // 2
        median = others[mid] if len(others) % 2 else (others[mid - 1] + others[mid]) / 2
        if r > pl.STRAGGLER_FACTOR * median:
            out.add(key)
    return out


@pytest.mark.parametrize("n", [2, 3, 4, 7, 50, 301])
def test_stragglers_match_the_definition_on_any_pool(n):
    import random
    rng = random.Random(n)
    st = pl.SlotStats()
    for i in range(n):
        per_unit = rng.choice([1.0, 1.0, 1.2, 2.0, 3.0, 10.0, rng.uniform(0.5, 20)])
        st.record((f"w{i}", 0), "f", per_unit * 4, 4.0, now=0)
    expected = _stragglers_by_definition(st, "f", 0)
    assert st.stragglers("f", 0) == expected
    if n >= 50:
        assert expected  # the pool has real stragglers, so the comparison means something


def test_many_slots_keep_memory_bounded_and_sweeps_rare(monkeypatch):
    st = pl.SlotStats(half_life_s=1.0)
    sweeps = []
    decayed = st._decayed
    monkeypatch.setattr(st, "_decayed", lambda a, now: (sweeps.append(1), decayed(a, now))[1])
    # 5,000 slots over 5,000 s: each one's evidence fades long before the end
    for i in range(5000):
        st.record((f"w{i}", 0), "f", 1.0, 1.0, now=float(i))
    assert len(st._acc["f"]) <= 2 * 64                   # faded entries were swept
    assert len(sweeps) < 5 * 5000                        # amortised: not a sweep per call
    # 500 live slots, all recent: none is dropped, and recording stays O(1) each
    st = pl.SlotStats()
    for i in range(500):
        st.record((f"w{i}", 0), "f", 1.0, 1.0, now=0.0)
    assert len(st._acc["f"]) == 500


def test_free_tasks_and_nonsense_are_ignored():
    st = pl.SlotStats()
    st.record(("a", 0), "f", 5.0, 0.0, now=0)
    st.record(("a", 0), "f", float("nan"), 5.0, now=0)
    st.record(("a", 0), "f", -1.0, 5.0, now=0)
    assert st.rate(("a", 0), "f", 0) is None


# ---------------------------------------------------------------- the coordinator ----

A100 = {"index": 0, "name": "NVIDIA A100-SXM4-80GB", "memory_total_mb": 81920, "memory_free_mb": 80000}
RTX = {"index": 1, "name": "NVIDIA GeForce RTX 4090", "memory_total_mb": 24564, "memory_free_mb": 2000}


def register(coord, gpus=(), cpu_slots=1, scores=None, cores=8, ram_mb=32000, host="h"):
    gpus = [dict(g) for g in gpus]
    slot_list = hw.slot_list(gpus, cpu_slots)
    info = {"hostname": host, "cpu": "CPU", "cores": cores, "ram_mb": ram_mb, "gpus": gpus,
            "slot_list": slot_list, "scores": dict(scores or {"cpu": 10.0})}
    return coord.register(info, None, len(slot_list))


def submit(coord, job_id, n=1, require=None, costs=None, vram=None, fn="f" * 64):
    meta = {"timeout": None}
    if require:
        meta["require"] = hw.Requirements.from_options(**require).to_meta()
    if vram:
        meta["gpu_memory_mb"] = {str(i): v for i, v in vram.items()}
    args = [f"{job_id}-{i}".encode() for i in range(n)]
    job, _ = coord.submit(job_id, "fn", "function", fn, meta, args, costs or [1.0] * n, False)
    return job


def lease(coord, wid, free, wait=0.0):
    return asyncio.run(coord.lease(wid, len(free), wait, free))


def test_gpu_model_goes_only_to_a_matching_slot(coord):
    box = register(coord, [A100, RTX], scores={"cpu": 10, "cuda:0": 5000, "cuda:1": 3000})
    submit(coord, "aa0001", n=2, require={"gpu": "RTX 4090"})
    grants = lease(coord, box.id, [0, 1, 2])
    assert [(g.slot, g.index) for g in grants] == [(1, 0)]   # one RTX: one task at a time
    assert lease(coord, box.id, [0, 2]) == []                  # nothing the A100 or CPU may run


def test_cpu_kind_and_kind_filters(coord):
    box = register(coord, [A100], cpu_slots=1, scores={"cpu": 10, "cuda:0": 5000})
    submit(coord, "aa0002", n=1, require={"gpu": "cpu"})
    submit(coord, "aa0003", n=1, require={"gpu": "cuda"})
    grants = lease(coord, box.id, [0, 1])
    assert {(g.job_id, g.slot) for g in grants} == {("aa0002", 1), ("aa0003", 0)}


def test_gpu_slot_serves_gpu_jobs_before_jobs_that_may_run_anywhere(coord):
    box = register(coord, [A100], cpu_slots=1, scores={"cpu": 10, "cuda:0": 5000})
    submit(coord, "aa0004", n=1)                               # anywhere, and first in line
    submit(coord, "aa0005", n=1, require={"gpu": "A100"})
    (g,) = lease(coord, box.id, [0])
    assert g.job_id == "aa0005"
    (g,) = lease(coord, box.id, [1])
    assert g.job_id == "aa0004"


def test_untyped_tasks_go_to_the_strongest_slot_first(coord):
    box = register(coord, [A100], cpu_slots=1, scores={"cpu": 10, "cuda:0": 5000})
    submit(coord, "aa0006", n=1)
    (g,) = lease(coord, box.id, [0, 1])
    assert g.slot == 0


def test_cores_and_memory_filter_workers(coord):
    small = register(coord, cores=4, ram_mb=8000, host="small")
    big = register(coord, cores=32, ram_mb=128000, host="big")
    submit(coord, "aa0007", n=1, require={"cores": 8, "memory": "16GB"})
    assert lease(coord, small.id, [0]) == []
    (g,) = lease(coord, big.id, [0])
    assert g.job_id == "aa0007"


def test_memory_is_held_by_the_tasks_running_on_a_worker(coord):
    # Two tasks asking 16 GB do not run side by side on a 24 GB machine (a lender's did),
    # while a task asking nothing still takes the free slot.
    box = register(coord, cpu_slots=3, ram_mb=24000, host="box")
    submit(coord, "aa0101", n=2, require={"memory": "16GB"})
    submit(coord, "aa0102", n=1)
    grants = lease(coord, box.id, [0, 1, 2])
    assert sorted((g.job_id, g.index) for g in grants) == [("aa0101", 0), ("aa0102", 0)]
    assert lease(coord, box.id, [2]) == []  # 16 GB more does not fit beside the first
    first = next(g for g in grants if g.job_id == "aa0101")
    coord.post_result(first.task_id, first.lease_id, "ok", None, b"r")
    (g,) = lease(coord, box.id, [0])  # its 16 GB are free again
    assert (g.job_id, g.index) == ("aa0101", 1)


def test_vram_hint_against_last_reported_free_memory(coord):
    box = register(coord, [A100, RTX], cpu_slots=0, scores={"cuda:0": 5000, "cuda:1": 3000})
    submit(coord, "aa0008", n=3, require={"gpu": "cuda"}, vram={0: 5000, 1: 1000, 2: 5000})
    grants = lease(coord, box.id, [1])                         # the RTX has 2000 MiB free
    assert [(g.index, g.slot) for g in grants] == [(1, 1)]     # skips task 0, takes task 1
    assert lease(coord, box.id, [1]) == []                     # 5000 > 2000: waits
    # the RTX frees memory: the next heartbeat says so, and the task fits
    coord.heartbeat(box.id, None, {"gpu_free_mb": {1: 20000}})
    assert [(g.index, g.slot) for g in lease(coord, box.id, [1])] == [(0, 1)]
    assert [(g.index, g.slot) for g in lease(coord, box.id, [0])] == [(2, 0)]


def test_heartbeat_with_more_free_memory_wakes_a_waiting_worker(coord):
    box = register(coord, [RTX], cpu_slots=0, scores={"cuda:1": 3000})

    async def scenario():
        fut = asyncio.ensure_future(coord.lease(box.id, 1, 5.0, [0]))
        await asyncio.sleep(0.01)
        submit(coord, "aa0009", n=1, vram={0: 4000})
        await asyncio.sleep(0.01)
        assert not fut.done()                                  # 2000 MiB free < 4000
        coord.heartbeat(box.id, None, {"gpu_free_mb": {1: 9000}})
        return await asyncio.wait_for(fut, 1.0)

    (g,) = asyncio.run(scenario())
    assert g.job_id == "aa0009" and g.slot == 0


def test_a_hinted_task_never_runs_on_a_cpu_slot(coord):
    box = register(coord, [RTX], cpu_slots=2, scores={"cpu": 10, "cuda:1": 3000})
    submit(coord, "aa0010", n=2, vram={0: 1000, 1: 1000})      # every task hints: a GPU job
    assert lease(coord, box.id, [1, 2]) == []                  # the CPU slots may not take them
    (g,) = lease(coord, box.id, [0])
    assert (g.job_id, g.slot) == ("aa0010", 0)
    # mixed: a CPU slot takes the tasks without a hint and leaves the hinted one waiting
    submit(coord, "aa0013", n=3, vram={1: 1000})
    got = lease(coord, box.id, [1, 2])
    assert sorted((g.job_id, g.index) for g in got) == [("aa0013", 0), ("aa0013", 2)]
    assert lease(coord, box.id, [1]) == []


def test_a_hinted_job_waits_for_a_busy_gpu(coord):
    box = register(coord, [RTX], cpu_slots=1, scores={"cpu": 10, "cuda:1": 3000})
    submit(coord, "aa0014", n=2, vram={0: 1500, 1: 1500})
    (g,) = lease(coord, box.id, [0, 1])                        # one GPU: one task; CPU idle
    assert g.slot == 0 and g.index == 0
    assert lease(coord, box.id, [1]) == []                     # the GPU is busy: it waits
    coord.post_result(g.task_id, g.lease_id, "ok", None, b"x")
    (g,) = lease(coord, box.id, [0])
    assert g.index == 1


def test_a_hint_with_only_cpu_workers_is_unsatisfiable(coord):
    register(coord, host="laptop")
    with pytest.raises(Unsatisfiable) as e:
        submit(coord, "aa0015", n=1, vram={0: 100})
    assert "gpu_memory_mb=100" in str(e.value) and "laptop [CPU CPU; 8 cores" in str(e.value)
    assert not coord.store.job_exists("aa0015")
    register(coord, [A100], host="box")
    with pytest.raises(Unsatisfiable):                          # gpu="cpu" and a GPU hint
        submit(coord, "aa0016", n=1, require={"gpu": "cpu"}, vram={0: 100})


def test_heavier_cost_to_stronger_slots(coord):
    fast = register(coord, scores={"cpu": 1000.0}, host="fast")
    slow = register(coord, scores={"cpu": 10.0}, host="slow")
    submit(coord, "aa0011", n=4, costs=[1.0, 8.0, 2.0, 4.0])
    (g,) = lease(coord, slow.id, [0])
    assert g.index == 0                                        # the weakest: the lightest
    (g,) = lease(coord, fast.id, [0])
    assert g.index == 1                                        # the strongest: the heaviest
    (g,) = lease(coord, fast.id, [0])
    assert g.index == 3


def test_equal_slots_take_the_heaviest_first(coord):
    a = register(coord, scores={"cpu": 100.0})
    submit(coord, "aa0012", n=3, costs=[1.0, 3.0, 2.0])
    assert [lease(coord, a.id, [0])[0].index for _ in range(3)] == [1, 2, 0]


def test_fair_between_jobs_fifo_within_with_requirements(coord):
    box = register(coord, [A100], cpu_slots=1, scores={"cpu": 10, "cuda:0": 5000})
    submit(coord, "bb0001", n=3, require={"gpu": "cuda"})
    submit(coord, "bb0002", n=3, require={"gpu": "cuda"})
    order = []
    for _ in range(6):
        (g,) = lease(coord, box.id, [0])
        order.append((g.job_id, g.index))
    assert order == [("bb0001", 0), ("bb0002", 0), ("bb0001", 1), ("bb0002", 1),
                     ("bb0001", 2), ("bb0002", 2)]


def test_straggler_gets_lighter_work(coord, clock):
    a = register(coord, scores={"cpu": 100.0}, host="a")
    b = register(coord, scores={"cpu": 100.0}, host="b")
    c = register(coord, scores={"cpu": 100.0}, host="c")
    fn = "e" * 64
    submit(coord, "cc0001", n=12, fn=fn)                       # warm-up: learn the speeds
    for _ in range(4):
        for w, secs in ((a, 1.0), (b, 1.0), (c, 9.0)):
            (g,) = lease(coord, w.id, [0])
            clock.t += secs
            coord.post_result(g.task_id, g.lease_id, "ok", None, b"x")
    assert coord.stats.stragglers(fn, clock()) == {(c.id, 0)}
    submit(coord, "cc0002", n=3, costs=[1.0, 5.0, 9.0], fn=fn)
    (g,) = lease(coord, c.id, [0])
    assert g.index == 0                    # the straggler counts at a quarter: the lightest


def test_unsatisfiable_lists_the_pool_and_stores_nothing(coord):
    register(coord, [RTX], scores={"cpu": 10}, host="gamer")
    with pytest.raises(Unsatisfiable) as e:
        submit(coord, "dd0001", n=2, require={"gpu": "A100"})
    msg = str(e.value)
    assert "gpu='A100'" in msg
    assert "gamer [NVIDIA GeForce RTX 4090 (24564 MiB, 2000 MiB free), CPU CPU; 8 cores, 32000 MiB RAM]" in msg
    assert "dd0001" not in coord.jobs and not coord.store.job_exists("dd0001")
    with pytest.raises(Unsatisfiable, match="gpu_memory_mb=30000"):
        submit(coord, "dd0002", n=1, require={"gpu": "cuda"}, vram={0: 30000})
    submit(coord, "dd0003", n=1, require={"gpu": "cuda"}, vram={0: 20000})   # fits the card: waits
    assert "dd0003" in coord.jobs


def test_no_alive_worker_is_not_unsatisfiable(coord):
    submit(coord, "dd0004", n=1, require={"gpu": "A100"})      # queued for a worker to come
    assert "dd0004" in coord.jobs


def test_worker_view_lists_slots_and_busy_ones(coord):
    box = register(coord, [A100], cpu_slots=2, scores={"cpu": 10, "cuda:0": 5000})
    submit(coord, "ee0001", n=1)
    lease(coord, box.id, [0, 1, 2])
    view = coord.worker_view(coord.workers[box.id])
    assert view["slots"] == 3 and view["running"] == 1
    assert view["slot_list"] == hw.slot_list([A100], 2)
    assert view["busy_slots"] == [0]


def test_legacy_lease_without_slot_names(coord):
    w = coord.register({}, None, 2)
    submit(coord, "ff0001", n=3)
    grants = asyncio.run(coord.lease(w.id, 2, 0))
    assert [(g.index, g.slot) for g in grants] == [(0, 0), (1, 1)]
    (g,) = coord.grant_now(w.id, 1, slot=1)
    assert (g.index, g.slot) == (2, 1)


def test_a_slot_freed_while_a_poll_is_open_joins_that_poll(coord):
    box = register(coord, [A100], cpu_slots=1, scores={"cpu": 10, "cuda:0": 5000})

    async def scenario():
        fut = asyncio.ensure_future(coord.lease(box.id, 1, 5.0, [1]))  # the GPU slot is busy
        await asyncio.sleep(0.01)
        assert coord.grant_now(box.id, 1, slot=0) == []   # its task ended; nothing pending
        submit(coord, "gg0001", n=1, require={"gpu": "cuda"})
        return await asyncio.wait_for(fut, 1.0)

    (g,) = asyncio.run(scenario())
    assert (g.job_id, g.slot) == ("gg0001", 0)
