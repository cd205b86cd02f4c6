"""gpumesh.worker.retire: a slot's previous job's process is closed a moment after its
next job's task started (off that task's path), or at once on a device's slot."""

from __future__ import annotations

import threading
import time

from gpumesh.worker.retire import Retirer, on_device


def test_a_close_runs_after_the_delay_in_order_and_flush_runs_the_rest_now():
    r = Retirer(delay=0.2)
    done: list = []
    both = threading.Event()

    def close(name):
        done.append((name, time.monotonic()))
        if len(done) == 2:
            both.set()
    t0 = time.monotonic()
    r.later(lambda: close("a"))
    r.later(lambda: close("b"))
    assert done == []  # not on the caller's path
    assert both.wait(10)
    assert [n for n, _ in done] == ["a", "b"] and all(at - t0 >= 0.2 for _, at in done)
    t1 = time.monotonic()
    r.later(lambda: close("c"))
    r.flush()  # the executor closing: now, not in 0.2 s
    assert [n for n, _ in done] == ["a", "b", "c"] and done[-1][1] - t1 < 0.2


def test_a_failed_close_does_not_stop_the_next():
    r = Retirer(delay=0.01)
    ran = threading.Event()
    r.later(lambda: 1 / 0)
    r.later(ran.set)
    assert ran.wait(10)


def test_only_a_slot_with_a_gpu_closes_at_once():
    assert on_device({"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "0"})
    assert not on_device({"CUDA_VISIBLE_DEVICES": ""})  # a CPU slot on a GPU machine
    assert not on_device(None)
