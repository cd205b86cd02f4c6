"""How long a submit waits for a job's first results in the same round trip."""

from __future__ import annotations

from gpumesh.client.native import NativeBackend
from gpumesh.client.pipeline import Job
from gpumesh.client.progress import DELAY_S
from gpumesh.limits import LONG_POLL_S


def _job(n: int) -> Job:
    return Job(fn=abs, calls=[((i,), {}) for i in range(n)], hints=[{}] * n)


def test_a_batch_waits_no_longer_than_its_progress_bars_delay():
    # The bar is drawn once the submit returns: a 20 s wait hid it for 20 s.
    assert NativeBackend._first_wait(_job(2)) == min(LONG_POLL_S, DELAY_S) == 1.0
    assert NativeBackend._first_wait(_job(1000)) == 1.0


def test_a_single_call_waits_the_whole_long_poll():
    assert NativeBackend._first_wait(_job(1)) == LONG_POLL_S == 20.0
