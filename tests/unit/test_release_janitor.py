"""The caller's release queue (client/native.py's Janitor): a release that fails is sent
again, and closing the mesh sends what is pending before the connections close."""
from __future__ import annotations

import threading

from gpumesh import protocol
from gpumesh.client.native import Janitor
from gpumesh.limits import RELEASE_ATTEMPTS
from tests.conftest import wait_for


class FlakyHttp:
    """Answers release requests, failing the first ``failures`` of them."""

    def __init__(self, failures: int):
        self.failures = failures
        self.sent: list[list[str]] = []
        self.lock = threading.Lock()

    def request(self, method, path, json=None, timeout=None):
        assert (method, path) == ("POST", protocol.JOBS_RELEASE)
        with self.lock:
            self.sent.append(list(json["jobs"]))
            if self.failures:
                self.failures -= 1
                raise ConnectionError("coordinator busy")


class Owner:
    def __init__(self, http):
        self.http = http


def test_a_failed_release_is_sent_again():
    http = FlakyHttp(failures=1)
    janitor = Janitor(Owner(http))
    janitor.release("aa")
    janitor.release("bb")
    wait_for(lambda: len(http.sent) == 2, 10, lambda: http.sent)
    assert http.sent == [["aa", "bb"], ["aa", "bb"]]


def test_a_release_that_keeps_failing_is_given_up_after_its_attempts():
    http = FlakyHttp(failures=10**6)
    janitor = Janitor(Owner(http))
    janitor.release("cc")
    wait_for(lambda: len(http.sent) == RELEASE_ATTEMPTS, 20, lambda: http.sent)
    janitor.flush(timeout=1)  # nothing left to send: the queue gave up on "cc"
    assert http.sent == [["cc"]] * RELEASE_ATTEMPTS


def test_flush_sends_what_is_pending_and_retries_a_failure():
    http = FlakyHttp(failures=1)
    janitor = Janitor(Owner(http))
    janitor.release("dd")
    janitor.flush(timeout=5)  # before the thread's batching pause has ended
    assert http.sent[-1] == ["dd"] and http.failures == 0


def test_closing_a_mesh_sends_its_pending_releases_first(monkeypatch):
    from gpumesh import GPUMesh
    mesh = GPUMesh("http://127.0.0.1:9", token="t", output=False)
    http = FlakyHttp(failures=0)
    monkeypatch.setattr(type(mesh), "http", property(lambda self: http))
    mesh._janitor.release("ee")
    mesh.close()
    assert http.sent == [["ee"]]


def test_a_release_at_once_does_not_wait_for_the_batch(monkeypatch):
    # A job whose payloads went as files is released at once (its files go back to the
    # handoff pool for the next call), taking what waits for the batch along with it.
    import gpumesh.client.native as native
    monkeypatch.setattr(native, "RELEASE_BATCH_S", 600.0)
    http = FlakyHttp(failures=0)
    janitor = Janitor(Owner(http))
    janitor.release("ee")
    janitor.release("ff", at_once=True)
    wait_for(lambda: http.sent, 10, "the release to be sent")
    assert http.sent == [["ee", "ff"]]
