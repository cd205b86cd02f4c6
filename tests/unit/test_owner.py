"""The machine owner's rules without a worker: windows, durations, thresholds, the
decisions over (fake) time and GPU readings, the config file, the coordinator's side of a
hand-back, and the control channel's refusal of another OS user."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from datetime import datetime
from pathlib import Path

import pytest

from gpumesh import availability
from gpumesh.cli import owner as owner_cli
from gpumesh.coordinator import views
from gpumesh.coordinator.core import StaleLease
from gpumesh.limits import MAX_ATTEMPTS
from gpumesh.worker import control
from gpumesh.worker.owner import (GpuReading, OwnerState, Policy, Threshold, Window, cap_memory,
                                  parse_duration, share_gpus)

from ..conftest import FakeClock


# 2026-12-07 is a Monday; the fake clock's seconds are read as that day plus seconds.
MONDAY = datetime(2026, 12, 7)


def local(t: float) -> datetime:
    return datetime.fromtimestamp(MONDAY.timestamp() + t)


def at(day: int, hh: int, mm: int) -> float:
    return day * 86400 + hh * 3600 + mm * 60


# ---------------------------------------------------------------- parsing ------------

@pytest.mark.parametrize("text, seconds", [("2h", 7200), ("30m", 1800), ("1h30m", 5400), ("45s", 45),
                                           ("1d", 86400), ("90", 90), ("1.5h", 5400)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("bad", ["", "2x", "h", "-5", "0", "0s", "2 hours", "400d"])
def test_bad_durations_name_the_setting(bad):
    with pytest.raises(ValueError, match="--for="):
        parse_duration(bad, "--for")


def test_windows_same_day_overnight_and_weekdays():
    evening = Window.parse("mon-fri 19:00-23:30")
    assert evening.contains(local(at(0, 19, 0))) and evening.contains(local(at(4, 23, 29)))
    assert not evening.contains(local(at(0, 23, 30))) and not evening.contains(local(at(0, 18, 59)))
    assert not evening.contains(local(at(5, 20, 0)))                 # Saturday
    night = Window.parse("22:00-08:00")
    assert night.contains(local(at(0, 23, 0))) and night.contains(local(at(1, 7, 59)))
    assert not night.contains(local(at(1, 8, 0))) and not night.contains(local(at(1, 12, 0)))
    friday_night = Window.parse("fri 22:00-06:00")                   # belongs to Friday
    assert friday_night.contains(local(at(5, 3, 0)))                 # Saturday 03:00
    assert not friday_night.contains(local(at(4, 3, 0)))             # Friday 03:00 (Thursday's night)
    weekend = Window.parse("sat,sun 00:00-24:00")
    assert weekend.contains(local(at(6, 23, 59))) and not weekend.contains(local(at(0, 0, 0)))
    wrap = Window.parse("sat-mon 10:00-11:00")
    assert wrap.days == frozenset({5, 6, 0})


@pytest.mark.parametrize("bad, why", [("25:00-08:00", "not a time of day"), ("10:00", "not a time window"),
                                      ("mon-fry 10:00-11:00", "not a day"), ("10:00-10:00", "is empty"),
                                      ("24:00-08:00", "cannot start"), ("a b 10:00-11:00", "not a time window")])
def test_bad_windows(bad, why):
    with pytest.raises(ValueError, match=why) as e:
        Window.parse(bad, "--hours")
    assert "--hours=" in str(e.value)


def test_thresholds():
    assert Threshold.parse("10%").exceeded(GpuReading(0, other_util_pct=10))
    assert not Threshold.parse("10%").exceeded(GpuReading(0, other_util_pct=9.5))
    mib = Threshold.parse("500MiB")
    assert mib.mib == 500 and mib.exceeded(GpuReading(0, other_mb=600))
    assert not mib.exceeded(GpuReading(0, other_util_pct=100, other_mb=10))
    for bad in ("0%", "101%", "ten%", "500"):
        with pytest.raises(ValueError, match="busy_threshold="):
            Threshold.parse(bad)


def test_what_is_shared():
    gpus = [{"index": i, "name": "g", "memory_total_mb": 24000, "memory_free_mb": 20000} for i in range(3)]
    assert [g["index"] for g in share_gpus(gpus, Policy(gpus=(0, 2)))] == [0, 2]
    assert share_gpus(gpus, Policy(gpus=())) == []
    assert share_gpus(gpus, Policy()) == gpus
    with pytest.raises(ValueError, match="no GPU 5"):
        share_gpus(gpus, Policy(gpus=(5,)))
    capped = share_gpus(gpus, Policy(gpus=(1,), max_gpu_memory_mb=8000))
    assert capped == [{"index": 1, "name": "g", "memory_total_mb": 8000, "memory_free_mb": 8000}]
    assert cap_memory({"memory_total_mb": 24000, "memory_free_mb": 3000}, 8000)["memory_free_mb"] == 3000


# ---------------------------------------------------------------- GPU rules without NVML ---

class _FakeNvml:
    """A stand-in for the pynvml module: ``nvmlInit`` raises ``error`` when given."""

    def __init__(self, error: Exception | None = None):
        self.error, self.shut = error, False

    def nvmlInit(self):
        if self.error is not None:
            raise self.error

    def nvmlShutdown(self):
        self.shut = True


def test_nvml_missing_says_why(monkeypatch):
    from gpumesh.worker import device
    monkeypatch.delenv(device.FAKE_GPUS_ENV, raising=False)
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed: the import fails
    assert device.nvml_missing() == "NVML is not installed (pip install 'gpumesh[gpu]')"
    monkeypatch.setitem(sys.modules, "pynvml", _FakeNvml(RuntimeError("Driver Not Loaded")))
    assert device.nvml_missing() == ("NVML cannot start (Driver Not Loaded); is the NVIDIA "
                                     "driver installed?")
    works = _FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", works)
    assert device.nvml_missing() is None and works.shut
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setenv(device.FAKE_GPUS_ENV, "[]")  # the testing hook stands in for NVML
    assert device.nvml_missing() is None


GPU = [{"index": 0, "name": "NVIDIA GeForce RTX 4090", "memory_total_mb": 24564, "memory_free_mb": 24000}]


def test_gpu_rules_inactive_names_the_rules_and_the_reason(monkeypatch):
    from gpumesh.worker import device
    both = Policy(yield_gpu=True, max_temp_c=80.0)
    monkeypatch.setattr(device, "nvml_missing", lambda: None)
    assert owner_cli.gpu_rules_inactive(both, GPU) is None  # they can act
    assert owner_cli.gpu_rules_inactive(both, []) == (
        "warning: the GPU rules (--yield-gpu, --max-temp) are inactive on this machine: no "
        "NVIDIA GPU was found to share; the worker starts without them")
    assert owner_cli.gpu_rules_inactive(Policy(hours=()), []) is None  # no GPU rule set
    monkeypatch.setattr(device, "nvml_missing",
                        lambda: "NVML is not installed (pip install 'gpumesh[gpu]')")
    assert owner_cli.gpu_rules_inactive(Policy(max_power_w=250.0), GPU) == (
        "warning: the GPU rules (--max-power) are inactive on this machine: NVML is not "
        "installed (pip install 'gpumesh[gpu]'); the worker starts without them")
    assert owner_cli.gpu_rules_inactive(both, []) == (
        "warning: the GPU rules (--yield-gpu, --max-temp) are inactive on this machine: no "
        "NVIDIA GPU was found to share and NVML is not installed (pip install 'gpumesh[gpu]'); "
        "the worker starts without them")
    # the rules in force are still listed, the GPU ones only when they can act
    assert owner_cli.describe_policy(both, gpu_rules=False) == []
    assert owner_cli.describe_policy(both) == [
        "yielding a GPU another program uses above 10% (grace 30s)",
        "no new tasks on a GPU at 80C or hotter"]


@pytest.mark.parametrize("gpus, nvml, why", [
    ([], "NVML is not installed (pip install 'gpumesh[gpu]')",
     "no NVIDIA GPU was found to share and NVML is not installed (pip install 'gpumesh[gpu]')"),
    (GPU, "NVML is not installed (pip install 'gpumesh[gpu]')",
     "NVML is not installed (pip install 'gpumesh[gpu]')"),
])
def test_join_without_nvml_warns_once_instead_of_announcing_gpu_rules(monkeypatch, tmp_path, gpus, nvml, why):
    import signal

    from click.testing import CliRunner

    from gpumesh.cli import join as join_cli
    from gpumesh.cli import main
    from gpumesh.worker import agent, device

    started = []

    class Agent:  # joins nothing: the banner is printed before the agent runs
        def __init__(self, *args, **kw):
            self.on_event = kw.get("on_event")

        def run(self):
            started.append(True)
            raise KeyboardInterrupt

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("GPUMESH_CONFIG", str(tmp_path / "config.json"))
    monkeypatch.delenv(device.FAKE_GPUS_ENV, raising=False)
    monkeypatch.setattr(device, "detect", lambda: {"gpus": list(gpus), "mps": False, "cpu": "Test CPU",
                                                   "cores": 2, "device": "CPU", "device_name": "Test CPU"})
    monkeypatch.setattr(device, "nvml_missing", lambda: nvml)
    monkeypatch.setattr(agent, "WorkerAgent", Agent)
    monkeypatch.setattr(join_cli, "_control_channel", lambda a: None)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        r = CliRunner().invoke(main, ["join", "http://127.0.0.1:18799", "--token", "t" * 32,
                                      "--yield-gpu", "--max-temp", "80", "--hours", "22:00-08:00"])
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    assert r.exit_code == 0, r.output
    assert started == [True]  # the worker still starts
    lines = r.output.splitlines()
    assert f"[worker] warning: the GPU rules (--yield-gpu, --max-temp) are inactive on this machine: {why}; the worker starts without them" in lines
    assert not [ln for ln in lines if "yielding a GPU" in ln or "or hotter" in ln]
    assert "[worker] hours: 22:00-08:00 (local time; at the end running tasks finish)" in lines


@pytest.mark.parametrize("flags, warned", [
    (["--max-gpu-memory", "8GB"], True),   # no GPU here: a warning
    (["--gpus", "none"], False),           # the cap in worker.toml, GPUs off for this run: silent
])
def test_join_gpu_memory_cap_with_no_gpu_shared(monkeypatch, tmp_path, flags, warned):
    import signal

    from click.testing import CliRunner

    from gpumesh.cli import join as join_cli
    from gpumesh.cli import main
    from gpumesh.worker import agent, device

    class Agent:
        def __init__(self, *args, **kw):
            self.on_event = kw.get("on_event")

        def run(self):
            raise KeyboardInterrupt

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("GPUMESH_CONFIG", str(tmp_path / "config.json"))
    monkeypatch.delenv(device.FAKE_GPUS_ENV, raising=False)
    monkeypatch.setattr(device, "detect", lambda: {"gpus": [], "mps": False, "cpu": "Test CPU",
                                                   "cores": 2, "device": "CPU", "device_name": "Test CPU"})
    monkeypatch.setattr(agent, "WorkerAgent", Agent)
    monkeypatch.setattr(join_cli, "_control_channel", lambda a: None)
    conf = owner_cli.worker_config_path()
    conf.parent.mkdir(parents=True, exist_ok=True)
    conf.write_text('max_gpu_memory = "1GB"\n')
    conf.chmod(0o600)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        r = CliRunner().invoke(main, ["join", "http://127.0.0.1:18799", "--token", "t" * 32, *flags])
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert not [ln for ln in lines if "GPU memory" in ln]
    warning = ("[worker] warning: --max-gpu-memory is inactive on this machine: no NVIDIA GPU "
               "was found to share; the worker starts without it")
    assert (warning in lines) is warned
    assert ("[worker] GPUs shared: none" in lines) is not warned


def test_a_worker_started_outside_its_hours_says_until_when():
    from gpumesh.worker.lending import OwnerRules

    class Agent(OwnerRules):
        slot_list = [{"id": 0}]

        def __init__(self):
            self.events = []
            self.on_event = lambda kind, text: self.events.append((kind, text))

    clock = FakeClock(at(0, 21, 0))
    a = Agent()
    a._init_owner(OwnerState(Policy(hours=(Window.parse("22:00-08:00"),)), clock=clock,
                             localtime=local), [])
    a._announce_start()
    from gpumesh.worker.owner import clock_time
    opens = clock_time(clock.t + 3600, clock.t)  # (FakeClock's seconds, read as epoch seconds)
    assert a.events == [("owner", f"outside the sharing hours until {opens}: no new tasks; "
                                  "running ones finish")]
    assert a._owner_report()["owner"]["until"] == at(0, 22, 0)
    clock.t = at(0, 22, 30)
    b = Agent()
    b._init_owner(OwnerState(Policy(hours=(Window.parse("22:00-08:00"),)), clock=clock,
                             localtime=local), [])
    b._announce_start()
    assert b.events == []                                               # open: nothing to say


# ---------------------------------------------------------------- decisions ----------

def test_pause_finish_now_and_for():
    clock = FakeClock()
    s = OwnerState(Policy(), clock=clock)
    assert s.decide().open(None) and s.decide().worker is None
    s.pause()
    d = s.decide()
    assert d.worker == {"state": "paused", "label": "paused: owner"}
    assert not d.open(None) and not d.open(0) and not d.hand_back(None)   # running ones finish
    s.pause(now=True, for_s=7200)
    d = s.decide()
    assert d.hand_back(None) and d.hand_back(1) and d.worker["until"] == clock.t + 7200
    clock.advance(7199)
    assert not s.decide().open(None)
    clock.advance(1)
    assert s.decide().open(None) and not s.paused                        # resumed by itself
    s.pause()
    assert s.resume() is True and s.resume() is False and s.decide().open(0)


def test_hours_and_window_end():
    clock = FakeClock(at(0, 21, 59))
    policy = Policy(hours=(Window.parse("22:00-08:00"),), at_window_end="finish")
    s = OwnerState(policy, clock=clock, localtime=local)
    d = s.decide()
    assert d.worker == {"state": "outside_hours", "label": "outside hours",
                        "until": at(0, 22, 0)} and not d.hand_back(None)  # when it opens next
    clock.t = at(0, 22, 0)
    assert s.decide().open(None)
    clock.t = at(1, 8, 0)
    d = s.decide()
    assert not d.open(None) and not d.hand_back(None)                    # finish
    s.policy = Policy(hours=policy.hours, at_window_end="requeue")
    assert s.decide().hand_back(None)                                    # requeue
    s.pause()
    assert s.decide().worker["state"] == "paused"                        # the pause names itself first


def test_next_open_names_when_the_next_window_opens():
    clock = FakeClock(at(0, 8, 30))  # Monday 08:30
    s = OwnerState(Policy(hours=(Window.parse("22:00-08:00"),)), clock=clock, localtime=local)
    assert s.next_open() == at(0, 22, 0)
    s.policy = Policy(hours=(Window.parse("sat,sun 10:00-12:00"), Window.parse("fri 23:00-01:00")))
    assert s.next_open() == at(4, 23, 0)                                 # Friday 23:00 first
    assert s.decide().worker["until"] == at(4, 23, 0)
    clock.t = at(5, 0, 30)                                               # inside Friday's, past midnight
    assert s.decide().worker is None and s.next_open() == at(5, 10, 0)
    clock.t = at(6, 12, 0)                                               # Sunday noon: next Friday
    assert s.next_open() == at(11, 23, 0)
    assert OwnerState(Policy(), clock=clock).next_open() is None


def test_next_open_is_the_exact_second_the_window_opens():
    """From a clock with a fraction of a second, at a real epoch (2026-12-08 02:40:34.0015
    UTC), the 03:00 opening came out as 02:59:59.9999998, shown as "until 02:59"."""
    from datetime import timezone

    def utc(t: float) -> datetime:
        return datetime.fromtimestamp(t, timezone.utc)
    opens = datetime(2026, 12, 8, 3, 0, tzinfo=timezone.utc).timestamp()
    assert opens == 1796698800.0
    for now in (1796696434.0015008, 1796696434.0035017, 1796696434.5, opens - 0.25):
        s = OwnerState(Policy(hours=(Window.parse("03:00-04:00"),)), clock=FakeClock(now),
                       localtime=utc)
        assert s.next_open() == opens, now
        until = s.decide().worker["until"]
        assert until == opens and utc(until).strftime("%H:%M") == "03:00", now


def test_clock_time_shows_seconds_within_the_hour():
    from gpumesh.worker.owner import clock_time
    import time
    now = 1_800_000_000.0
    assert clock_time(now + 20, now) == time.strftime("%H:%M:%S", time.localtime(now + 20))
    assert clock_time(now + 7200, now) == time.strftime("%H:%M", time.localtime(now + 7200))
    assert clock_time(now + 3 * 86400, now) == time.strftime("%a %H:%M", time.localtime(now + 3 * 86400))


def test_gpu_memory_cap_without_a_shared_gpu_warns_instead_of_announcing_it():
    cap = Policy(max_gpu_memory_mb=7629)
    assert owner_cli.gpu_memory_inactive(cap, GPU) is None
    assert owner_cli.gpu_memory_inactive(Policy(), []) is None
    assert owner_cli.gpu_memory_inactive(cap, []) == (
        "warning: --max-gpu-memory is inactive on this machine: no NVIDIA GPU was found to "
        "share; the worker starts without it")
    none = Policy(gpus=(), max_gpu_memory_mb=953)  # (a cap in worker.toml, --gpus none)
    assert owner_cli.gpu_memory_inactive(none, []) is None
    assert owner_cli.describe_policy(none) == ["GPUs shared: none"]
    assert owner_cli.describe_policy(cap) == ["GPU memory offered: at most 7629 MiB per GPU"]


def test_yield_gpu_grace_and_quiet_spell():
    clock = FakeClock()
    s = OwnerState(Policy(yield_gpu=True, yield_grace_s=10), clock=clock)
    quiet = {0: GpuReading(0, other_util_pct=0), 1: GpuReading(1, other_util_pct=0)}
    game = {0: GpuReading(0, other_util_pct=85), 1: GpuReading(1, other_util_pct=3)}
    assert s.decide(quiet).open(0)
    d = s.decide(game)
    assert d.gpus == {0: {"state": "yielding", "label": "yielding: GPU busy"}}
    assert not d.open(0) and d.open(1) and d.open(None) and not d.hand_back(0)
    clock.advance(9.9)
    assert not s.decide(game).hand_back(0)
    clock.advance(0.1)
    d = s.decide(game)
    assert d.hand_back(0) and not d.hand_back(1) and not d.hand_back(None)
    clock.advance(1)
    assert not s.decide(quiet).open(0)                                  # quiet, but not for long
    clock.advance(9)
    assert not s.decide(quiet).open(0)
    clock.advance(1)
    assert s.decide(quiet).open(0)                                      # 10 s of quiet: reopened
    assert s.decide(game).gpus and not s.decide(game).hand_back(0)      # a new grace starts


def test_yield_by_memory_threshold():
    s = OwnerState(Policy(yield_gpu=True, busy_threshold=Threshold.parse("2GiB")), clock=FakeClock())
    assert s.decide({0: GpuReading(0, other_util_pct=99, other_mb=100)}).open(0)
    assert not s.decide({0: GpuReading(0, other_util_pct=0, other_mb=2048)}).open(0)


def test_hot_and_power_with_hysteresis():
    s = OwnerState(Policy(max_temp_c=80, max_power_w=250), clock=FakeClock())
    def temp(c, w=100):
        return s.decide({0: GpuReading(0, temp_c=c, power_w=w)})
    assert temp(79).open(0)
    d = temp(83)
    assert d.gpus == {0: {"state": "hot", "label": "hot 83C"}} and not d.hand_back(0)
    assert temp(78).gpus[0]["label"] == "hot 78C"                      # cooling, not cool enough
    assert not temp(75.5).open(0)
    assert temp(75).open(0)                                             # 5C below the limit
    assert temp(79.9).open(0)                                           # no flapping below it
    d = temp(60, 260)
    assert d.gpus == {0: {"state": "power", "label": "power 260W"}}
    assert not temp(60, 230).open(0) and temp(60, 224).open(0)         # 90% of 250 W


def test_unknown_readings_change_nothing():
    s = OwnerState(Policy(yield_gpu=True, max_temp_c=80), clock=FakeClock())
    assert s.decide({0: GpuReading(0)}).open(0)
    assert s.decide({}).open(0)


# ---------------------------------------------------------------- availability -------

def test_availability_checks_and_labels():
    assert availability.check_owner(None) is None
    assert availability.check_owner({"state": "paused", "label": "paused: owner", "until": 5}) == {
        "state": "paused", "label": "paused: owner", "until": 5.0}
    for bad in ({"state": "asleep", "label": "x"}, {"state": "paused", "label": ""}, "paused",
                {"state": "paused", "label": "x", "extra": 1}, {"state": "paused", "label": "a\nb"}):
        with pytest.raises(ValueError, match="owner"):
            availability.check_owner(bad)
    assert availability.check_gpu_states({"1": {"state": "hot", "label": "hot 83C"}}) == {
        "1": {"state": "hot", "label": "hot 83C"}}
    for bad in ({"x": {"state": "hot", "label": "h"}}, {"0": {"state": "paused", "label": "p"}}, []):
        with pytest.raises(ValueError, match="gpu_states"):
            availability.check_gpu_states(bad)
    slots = [{"id": 0, "kind": "cuda", "gpu": 0}, {"id": 1, "kind": "cuda", "gpu": 1}, {"id": 2, "kind": "cpu"}]
    w = {"gpus": [{"index": 0}, {"index": 1}], "gpu_states": {"1": {"state": "hot", "label": "hot 83C"}}}
    assert availability.closed_slots(w, slots) == {1}
    assert availability.labels(w) == ["cuda:1 hot 83C"]
    assert availability.device_state(w, "cuda:1")["label"] == "hot 83C"
    assert availability.device_state(w, "cpu") is None
    w["owner"] = {"state": "paused", "label": "paused: owner"}
    assert availability.closed_slots(w, slots) == {0, 1, 2}
    assert availability.labels(w) == ["paused: owner", "cuda:1 hot 83C"]


def test_a_caller_is_told_how_many_workers_wait_in_each_state():
    assert availability.describe_closed({"paused": 1}) == "1 worker paused by its owner"
    assert availability.describe_closed({"hot": 2, "outside_hours": 1, "paused": 3}) == (
        "3 workers paused by their owners, 1 worker outside its lending hours, "
        "2 workers whose GPUs are too hot")
    # a state of a newer coordinator is named as it came; one that is not text is not echoed
    assert availability.describe_closed({"asleep": 1, "b\x1b[2J": 2}) == (
        "1 worker closed by its owner (asleep), 2 workers closed by their owners (?)")


# ---------------------------------------------------------------- the coordinator ----

def _lease(coord, wid, free=None):
    return asyncio.run(coord.lease(wid, 1, 0, free))


def test_hand_back_is_fenced_costs_no_attempt_and_marks_the_output(coord):
    a = coord.register({"hostname": "lender"}, None, 1)
    b = coord.register({"hostname": "other"}, None, 1)
    coord.submit("aaaa01", "fn", "function", "f" * 64, {"timeout": None}, [b"x"], [1.0], False)
    for n in range(1, MAX_ATTEMPTS + 3):                   # far more hand-backs than attempts
        (g,) = _lease(coord, a.id)
        assert g.attempt == n  # each run its own number; none of them counts as a loss
        coord.post_output(g.task_id, g.lease_id, b"partial\n", b"")
        coord.hand_back(g.task_id, g.lease_id, "paused: owner")
        with pytest.raises(StaleLease):
            coord.hand_back(g.task_id, g.lease_id, "again")
        with pytest.raises(StaleLease):
            coord.post_result(g.task_id, g.lease_id, "ok", None, b"late")
    assert coord.store.preempted_count("aaaa01") == MAX_ATTEMPTS + 2
    row = coord.store.task_rows("aaaa01")[0]
    assert (row["state"], row["attempts"]) == ("pending", MAX_ATTEMPTS + 2)
    (g,) = _lease(coord, b.id)
    coord.post_result(g.task_id, g.lease_id, "ok", None, b"value")
    rows = list(coord.store.results_after("aaaa01", -1, 10))
    assert len(rows) == 1 and coord.store.task_rows("aaaa01")[0]["attempts"] == MAX_ATTEMPTS + 3
    log = coord.output.task_log("aaaa01", g.task_id, "stderr").decode()
    assert "[gpumesh: attempt 1 on lender ended here, preempted (paused: owner);" in log


def test_a_hand_back_marks_the_log_of_the_attempt_it_ends(coord):
    # `gpumesh logs` shows each attempt apart, so the marker belongs with the output it
    # is about: attempt 2's, not the first attempt's file
    a = coord.register({"hostname": "lender"}, None, 1)
    coord.submit("aaaa03", "fn", "function", "f" * 64, {"timeout": None}, [b"x"], [1.0], False)
    for n in (1, 2):
        (g,) = _lease(coord, a.id)
        coord.post_output(g.task_id, g.lease_id, b"", f"partial {n}\n".encode())
        coord.hand_back(g.task_id, g.lease_id, "paused: owner")
    first = coord.output.task_log("aaaa03", g.task_id, "stderr", 1).decode()
    second = coord.output.task_log("aaaa03", g.task_id, "stderr", 2).decode()
    assert first.startswith("partial 1\n[gpumesh: attempt 1 on lender ended here")
    assert "attempt 2" not in first
    assert second.startswith("partial 2\n[gpumesh: attempt 2 on lender ended here")


def test_closed_worker_gets_nothing_and_the_job_says_why(coord):
    a = coord.register({"hostname": "lender", "slot_list": [{"id": 0, "kind": "cpu"}]}, None, 1)
    coord.heartbeat(a.id, [], {"owner": {"state": "paused", "label": "paused: owner"}})
    coord.submit("aaaa02", "fn", "function", "f" * 64, {"timeout": None}, [b"x"], [1.0], False)
    assert _lease(coord, a.id) == [] and _lease(coord, a.id, [0]) == []
    assert coord.waiting_reason("aaaa02") == (
        "waiting: every worker that can run it is unavailable: lender [paused: owner]")
    assert views.closed_counts(coord, "aaaa02") == {"paused": 1}   # what its results pages say
    b = coord.register({"hostname": "night", "slot_list": [{"id": 0, "kind": "cpu"}],
                        "owner": {"state": "outside_hours", "label": "outside hours"}}, None, 1)
    assert views.closed_counts(coord, "aaaa02") == {"paused": 1, "outside_hours": 1}
    coord.deregister(b.id)
    coord.heartbeat(a.id, [], {"owner": None})
    assert coord.waiting_reason("aaaa02") is None
    assert views.closed_counts(coord, "aaaa02") is None
    (g,) = _lease(coord, a.id, [0])
    assert g.job_id == "aaaa02"


def test_a_closed_gpu_leaves_the_others_open(coord):
    gpus = [{"index": 0, "name": "NVIDIA RTX 4090", "memory_total_mb": 24000},
            {"index": 1, "name": "NVIDIA RTX 4090", "memory_total_mb": 24000}]
    slots = [{"id": 0, "kind": "cuda", "gpu": 0}, {"id": 1, "kind": "cuda", "gpu": 1}]
    a = coord.register({"hostname": "box", "gpus": gpus, "slot_list": slots}, None, 2)
    coord.heartbeat(a.id, [], {"gpu_states": {"0": {"state": "yielding", "label": "yielding: GPU busy"}}})
    coord.submit("aaaa03", "fn", "function", "f" * 64, {"timeout": None, "require": {"gpu": "cuda"}},
                 [b"x", b"y"], [1.0, 1.0], False)
    got = asyncio.run(coord.lease(a.id, 2, 0, [0, 1]))
    assert [g.slot for g in got] == [1]
    assert coord.waiting_reason("aaaa03") is None          # GPU 1 can take it in turn
    assert views.closed_counts(coord, "aaaa03") is None


# ---------------------------------------------------------------- config file --------

def _write(path, text, mode=0o600):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    os.chmod(path, mode)
    return path


def test_config_file_and_flags_over_it(tmp_path):
    path = _write(tmp_path / "worker.toml", 'gpus = "0,2"\ncpu_slots = 3\nmax_gpu_memory = "8GB"\n'
                  'hours = ["mon-fri 19:00-23:30", "sat,sun 00:00-24:00"]\nat_window_end = "requeue"\n'
                  'yield_gpu = true\nbusy_threshold = "500MiB"\nyield_grace = "1m"\nmax_temp = 80\n'
                  'max_power = 250\n')
    settings = owner_cli.load_worker_config(path)
    policy, slots = owner_cli.build_policy({}, settings)
    assert policy.gpus == (0, 2) and slots == 3 and policy.max_gpu_memory_mb == 7629
    assert [w.text for w in policy.hours] == ["mon-fri 19:00-23:30", "sat,sun 00:00-24:00"]
    assert policy.at_window_end == "requeue" and policy.yield_gpu and policy.busy_threshold.mib == 500
    assert (policy.yield_grace_s, policy.max_temp_c, policy.max_power_w) == (60, 80, 250)
    flags = {"gpus": "1", "cpu_slots": None, "hours": ("22:00-08:00",), "max_temp": "70",
             "yield_gpu": None, "max_power": None}
    policy, slots = owner_cli.build_policy(flags, settings)
    assert policy.gpus == (1,) and slots == 3 and [w.text for w in policy.hours] == ["22:00-08:00"]
    assert policy.max_temp_c == 70 and policy.yield_gpu
    assert owner_cli.build_policy({}, {}) == (Policy(), None)


@pytest.mark.parametrize("text, named", [("max_temp = \"hot\"\n", "max_temp="), ("gpus = \"a,b\"\n", "gpus="),
                                         ("hours = [\"9-5\"]\n", "hours="), ("cpu_slots = -1\n", "cpu_slots="),
                                         ("yield_gpu = \"yes\"\n", "yield_gpu"), ("colour = 1\n", "'colour'"),
                                         ("at_window_end = \"later\"\n", "at_window_end="),
                                         ("max_gpu_memory = \"8G\"\n", "max_gpu_memory=")])
def test_bad_config_values_name_the_setting(tmp_path, text, named):
    path = _write(tmp_path / "worker.toml", text)
    with pytest.raises(ValueError, match=named):
        owner_cli.build_policy({}, owner_cli.load_worker_config(path))


def test_config_file_others_can_write_is_refused(tmp_path):
    path = _write(tmp_path / "worker.toml", "max_temp = 80\n", mode=0o666)
    with pytest.raises(ValueError, match="writable by other users"):
        owner_cli.load_worker_config(path)
    path.write_text("max_temp = [\n")
    os.chmod(path, 0o600)
    with pytest.raises(ValueError, match="worker.toml"):
        owner_cli.load_worker_config(path)
    assert owner_cli.load_worker_config(tmp_path / "absent.toml") == {}


def test_join_usage_errors_exit_2_naming_the_setting(tmp_path):
    env = dict(os.environ, HOME=str(tmp_path), GPUMESH_TOKEN="t" * 32, GPUMESH_FAKE_GPUS="[]")
    r = subprocess.run([sys.executable, "-m", "gpumesh", "join", "http://127.0.0.1:9", "--max-temp", "hot"],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--max-temp='hot'" in r.stderr
    _write(tmp_path / ".gpumesh" / "worker.toml", "busy_threshold = \"lots\"\n")
    r = subprocess.run([sys.executable, "-m", "gpumesh", "join", "http://127.0.0.1:9"],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "busy_threshold='lots'" in r.stderr
    r = subprocess.run([sys.executable, "-m", "gpumesh", "join", "http://127.0.0.1:9", "--gpus", "1",
                        "--yield-gpu", "--busy-threshold", "5%"], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "--gpus: this machine has no GPU 1 (it has none)" in r.stderr


@pytest.mark.parametrize("flags, file, said", [
    ({"gpus": "none", "max_temp": "80"}, {}, "--gpus none shares no GPU, so --max-temp has nothing"),
    ({"yield_gpu": True}, {"gpus": "none"}, 'gpus = "none" (worker.toml) shares no GPU, so --yield-gpu'),
    ({"gpus": "none", "max_gpu_memory": "8GB"}, {}, "so --max-gpu-memory has nothing to apply to"),
    ({"at_window_end": "requeue"}, {}, "no hours are set: give --hours too, or drop --at-window-end"),
    ({"busy_threshold": "10%"}, {}, "--busy-threshold tunes --yield-gpu, which is off"),
    ({"yield_gpu": False, "yield_grace": "30s"}, {"yield_gpu": True}, "--yield-grace tunes --yield-gpu"),
])
def test_a_flag_the_other_settings_make_do_nothing_is_refused(flags, file, said):
    with pytest.raises(ValueError) as e:
        owner_cli.build_policy(flags, file)
    assert said in str(e.value)


def test_flags_that_do_apply_and_dormant_file_settings_are_accepted():
    policy, _ = owner_cli.build_policy({"at_window_end": "requeue"}, {"hours": ["22:00-08:00"]})
    assert policy.at_window_end == "requeue"
    policy, _ = owner_cli.build_policy({"yield_gpu": True, "busy_threshold": "20%"}, {})
    assert policy.yield_gpu and policy.busy_threshold.percent == 20
    # the file keeps its yield rules while a flag turns yielding off for this run
    policy, _ = owner_cli.build_policy({"yield_gpu": False}, {"yield_gpu": True, "busy_threshold": "20%"})
    assert not policy.yield_gpu
    policy, _ = owner_cli.build_policy({"gpus": "none", "yield_gpu": False}, {"max_temp": 80})
    assert policy.gpus == () and policy.max_temp_c == 80


# ---------------------------------------------------------------- control channel ----

NOBODY = 65534


def _as_nobody(path) -> dict:
    """Connect to ``path`` as another OS user (a forked child that drops to ``nobody``:
    that user could not run this venv's interpreter) and ask for a pause."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.close(r)
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(5)
            try:
                s.connect(str(path))
                s.sendall(b'{"op": "pause", "now": true}\n')
                out = s.recv(4096).decode().strip() or '{"closed": true}'
            except OSError as e:
                out = json.dumps({"connect": type(e).__name__})
            os.write(w, out.encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as fh:
        out = fh.read()
    os.waitpid(pid, 0)
    return json.loads(out)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another OS user")
def test_control_channel_refuses_another_os_user():
    calls = []
    base = tempfile.mkdtemp(prefix="gpumesh-control-")  # not under pytest's 0700 tree
    os.chmod(base, 0o755)                                # only the channel's own dir guards it
    d = Path(base) / "run"
    server = control.ControlServer(lambda req: calls.append(req) or {"ok": True, "worker": "w1"}, d).start()
    try:
        assert oct(d.stat().st_mode & 0o777) == "0o700"
        assert oct(server.path.stat().st_mode & 0o777) == "0o600"
        assert control.send({"op": "status"}, d) == [{"ok": True, "worker": "w1"}]
        # another user cannot even reach the socket ...
        assert _as_nobody(server.path) == {"connect": "PermissionError"}
        # ... and were the directory and socket opened by mistake, the peer check refuses it
        os.chmod(d, 0o755)
        os.chmod(server.path, 0o666)
        answer = _as_nobody(server.path)
        assert answer["ok"] is False and "refused" in answer["error"]
        assert calls == [{"op": "status"}]                 # nothing reached the worker
        # and the client will not use a directory others can open
        with pytest.raises(control.ControlError, match="open to other users"):
            control.send({"op": "status"}, d)
    finally:
        server.close()
        shutil.rmtree(base, ignore_errors=True)
    assert not server.path.exists()


def test_control_channel_without_workers_and_stale_sockets(tmp_path):
    d = tmp_path / "run"
    with pytest.raises(control.NoWorkerRunning):
        control.send({"op": "status"}, d)
    d.mkdir(mode=0o700)
    stale = d / "worker-999999.sock"                       # what a worker killed with -9 leaves
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(stale))
    s.close()
    with pytest.raises(control.NoWorkerRunning):
        control.send({"op": "status"}, d)
    assert not stale.exists() and not d.exists()           # the stale socket was removed
    server = control.ControlServer(lambda req: {"ok": True, "worker": "w"}, d).start()
    try:
        assert control.send({"op": "status"}, d) == [{"ok": True, "worker": "w"}]
    finally:
        server.close()


# ---------------------------------------------------------------- GPU readings -------

def test_fake_gpu_hook_drives_the_readings_at_run_time(tmp_path, monkeypatch):
    from gpumesh.worker import device
    path = tmp_path / "gpus.json"
    path.write_text(json.dumps([{"name": "A"}, {"name": "B", "other_util_pct": 40, "temperature_c": 70}]))
    monkeypatch.setenv(device.FAKE_GPUS_ENV, f"@{path}")
    mon = device.GpuMonitor([0, 1])
    assert mon.readings() == {0: GpuReading(0), 1: GpuReading(1, other_util_pct=40.0, temp_c=70.0)}
    path.write_text(json.dumps([{"name": "A", "other_memory_mb": 3000, "power_w": 310}, {"name": "B"}]))
    assert mon.readings() == {0: GpuReading(0, other_mb=3000.0, power_w=310.0), 1: GpuReading(1)}
    assert device.GpuMonitor([1]).readings() == {1: GpuReading(1)}
    path.write_text("not json")
    assert mon.readings() == {}


def test_nvml_readings_leave_out_gpumesh_processes(monkeypatch):
    from types import SimpleNamespace as NS

    from gpumesh.worker import device
    monkeypatch.delenv(device.FAKE_GPUS_ENV, raising=False)
    seen = []

    def samples(since):
        seen.append(since)
        if since >= 30:
            raise type("NVMLError_NotFound", (Exception,), {})()   # nothing new since
        return [NS(pid=100, smUtil=70, timeStamp=10), NS(pid=100, smUtil=50, timeStamp=20),
                NS(pid=300, smUtil=30, timeStamp=30), NS(pid=200, smUtil=99, timeStamp=25)]

    procs = {"compute": [NS(pid=100, usedGpuMemory=2 * 2**30), NS(pid=200, usedGpuMemory=6 * 2**30)],
             "graphics": [NS(pid=300, usedGpuMemory=2**30)]}
    fake = NS(nvmlInit=lambda: None, nvmlShutdown=lambda: None, NVML_TEMPERATURE_GPU=0,
              nvmlDeviceGetHandleByIndex=lambda i: i,
              nvmlDeviceGetComputeRunningProcesses=lambda h: procs["compute"],
              nvmlDeviceGetGraphicsRunningProcesses=lambda h: procs["graphics"],
              nvmlDeviceGetProcessUtilization=lambda h, since: samples(since),
              nvmlDeviceGetTemperature=lambda h, sensor: 71,
              nvmlDeviceGetPowerUsage=lambda h: 215_500)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    mon = device.GpuMonitor([0])
    got = mon.readings(lambda pid: pid == 200)              # 200 is one of our tasks
    # newest sample per process (100: 50%, not 70%), ours (200) left out
    assert got == {0: GpuReading(0, other_util_pct=80.0, other_mb=3072.0, temp_c=71.0, power_w=215.5)}
    assert mon.readings(lambda pid: pid == 200)[0].other_util_pct == 0.0   # no samples since
    assert seen == [0, 30]


def test_descends_from():
    from gpumesh.worker.device import descends_from
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert descends_from(child.pid, os.getpid()) and descends_from(os.getpid(), os.getpid())
        assert not descends_from(os.getpid(), child.pid) and not descends_from(1, os.getpid())
    finally:
        child.kill()
        child.wait()


def test_every_capable_gpu_closed_says_why(coord):
    gpus = [{"index": 0, "name": "NVIDIA RTX 4090", "memory_total_mb": 24000},
            {"index": 1, "name": "NVIDIA RTX 4090", "memory_total_mb": 24000}]
    slots = [{"id": 0, "kind": "cuda", "gpu": 0}, {"id": 1, "kind": "cuda", "gpu": 1}, {"id": 2, "kind": "cpu"}]
    a = coord.register({"hostname": "box", "gpus": gpus, "slot_list": slots}, None, 3)
    coord.heartbeat(a.id, [], {"gpu_states": {"0": {"state": "yielding", "label": "yielding: GPU busy"},
                                              "1": {"state": "hot", "label": "hot 83C"}}})
    coord.submit("aaaa04", "fn", "function", "f" * 64, {"timeout": None, "require": {"gpu": "cuda"}},
                 [b"x"], [1.0], False)
    assert asyncio.run(coord.lease(a.id, 3, 0, [0, 1, 2])) == []      # the CPU slot cannot run it
    assert coord.waiting_reason("aaaa04") == ("waiting: every worker that can run it is unavailable: "
                                              "box [cuda:0 yielding: GPU busy, cuda:1 hot 83C]")
    assert views.closed_counts(coord, "aaaa04") == {"yielding": 1}  # (its first GPU's state)
    coord.heartbeat(a.id, [], {"gpu_states": {"0": {"state": "yielding", "label": "yielding: GPU busy"}}})
    (g,) = asyncio.run(coord.lease(a.id, 3, 0, [0, 1, 2]))              # GPU 1 cooled down
    assert g.slot == 1


def test_agent_control_requests(tmp_path):
    from gpumesh.worker.agent import WorkerAgent
    events = []
    agent = WorkerAgent("http://127.0.0.1:9", "t" * 32, slots=2, info={"gpus": [], "hostname": "h"},
                        bench=False, cache_dir=tmp_path / "cache", worker_id="abcdef123456",
                        on_event=lambda kind, text: events.append(text))
    try:
        for bad, why in (({"op": "pause", "now": "yes"}, "'now'"), ({"op": "pause", "for_s": -1}, "'for_s'"),
                         ({"op": "pause", "for_s": True}, "'for_s'"), ({"op": "explode"}, "unknown op"),
                         ({"op": "pause", "worker": 5}, "'worker'")):
            with pytest.raises(ValueError, match=why):
                agent.control(bad)
        assert agent._slot_open(0) and agent._slot_open(1)
        assert agent.control({"op": "status", "worker": "ffff"}) == {"ok": True, "skipped": True,
                                                                     "worker": "abcdef123456"}
        got = agent.control({"op": "pause", "worker": "abcd", "for_s": 60})  # a prefix names it
        assert (got["ok"], got["worker"], got["state"], got["running"]) == (True, "abcdef123456", "paused: owner", 0)
        assert not agent._slot_open(0) and not agent._slot_open(1)
        assert agent._owner_report()["owner"]["state"] == "paused"
        assert events[-1].startswith("paused by the owner until ") and events[-1].endswith(
            ": no new tasks; running ones finish")
        assert agent.control({"op": "resume"})["state"] == "open"
        assert agent._slot_open(0) and events[-1] == "taking tasks again"
        assert agent._owner_report() == {"owner": None, "gpu_states": {}}
    finally:
        agent.executor.close()


def test_control_server_answers_bad_requests(tmp_path):
    def handler(req):
        raise ValueError("'now' must be true or false")
    server = control.ControlServer(handler, tmp_path / "run").start()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(str(server.path))
            s.sendall(b"[1, 2\n")
            assert json.loads(s.recv(4096))["error"].startswith("bad request:")
        assert control.send({"op": "pause", "now": "x"}, tmp_path / "run") == [
            {"ok": False, "error": "'now' must be true or false"}]
    finally:
        server.close()


def test_stale_fallback_control_dirs_are_swept_but_a_live_workers_stays(tmp_path):
    import subprocess
    from gpumesh.worker import control
    uid = os.getuid()
    dead = subprocess.Popen(["true"])
    dead.wait()                                             # a pid that no longer exists
    gone = tmp_path / f"gpumesh-{uid}-aaaaaaaaaaaa"
    live = tmp_path / f"gpumesh-{uid}-bbbbbbbbbbbb"
    other = tmp_path / f"gpumesh-{uid}-cccccccccccc"
    for d in (gone, live, other):
        d.mkdir(mode=0o700)
    (gone / f"worker-{dead.pid}.sock").touch()
    (live / f"worker-{os.getpid()}.sock").touch()           # this process: alive
    (other / f"worker-{dead.pid}.sock").touch()
    (other / "notes.txt").write_text("not ours to remove")
    assert control.sweep_stale(tmp_path) == [gone]
    assert not gone.exists()
    assert (live / f"worker-{os.getpid()}.sock").exists()
    assert sorted(p.name for p in other.iterdir()) == ["notes.txt"]
