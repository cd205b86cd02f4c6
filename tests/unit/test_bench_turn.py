"""Workers on one machine take turns to measure it (gpumesh.worker.bench.machine_turn):
two benchmarks at once on the same cores would each measure part of the machine."""

from __future__ import annotations

import time

from gpumesh.worker.bench import machine_turn


def test_a_second_benchmark_waits_for_the_first_and_measures_anyway_past_its_wait(tmp_path):
    first = machine_turn(0, str(tmp_path))
    assert first is not None
    t0 = time.monotonic()
    assert machine_turn(0.3, str(tmp_path)) is None  # (taken: waited, then gave up)
    assert 0.3 <= time.monotonic() - t0 < 5
    first.release()
    again = machine_turn(0, str(tmp_path))
    assert again is not None
    again.release()


def test_a_turn_that_cannot_be_made_is_none(tmp_path):
    assert machine_turn(0, str(tmp_path / "missing" / "dir")) is None
