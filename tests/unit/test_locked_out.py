"""An address the coordinator locks out (429 locked_out, after too many refused tokens
from it: maybe another program's at a shared NAT or proxy address) is waited out by a
worker with the right token, not a reason to leave (transport.py, worker/agent.py)."""

from __future__ import annotations

import json

import pytest

from gpumesh import protocol, wire
from gpumesh.errors import AuthError, LockedOut
from gpumesh.transport import check
from gpumesh.worker.agent import WorkerAgent
from gpumesh.worker.executor import Outcome
from gpumesh.worker.poster import ResultPoster


class _Resp:
    def __init__(self, status, body, headers=None):
        self.status_code, self._body, self.headers = status, body, headers or {}
        self.text = json.dumps(body)

    def json(self):
        return self._body


def test_a_lockout_is_a_locked_out_with_its_retry_after():
    body = {"error": "locked_out", "message": "too many refused tokens from 10.0.0.2: locked "
                                               "out for another 292s"}
    with pytest.raises(LockedOut) as e:
        check(_Resp(429, body, {"retry-after": "293"}), "http://c:1")
    assert isinstance(e.value, AuthError) and e.value.retry_after == 293.0
    assert "may be another program's at the same address" in str(e.value)
    with pytest.raises(LockedOut) as e:  # no header: a minute
        check(_Resp(429, body), "http://c:1")
    assert e.value.retry_after == 60.0


class _LockedThenOpen:
    """Refuses the first ``n`` requests with a lockout of ``wait`` s, then answers."""

    def __init__(self, n: int, wait: float = 0.05):
        self.n, self.wait, self.calls = n, wait, 0

    def _gate(self):
        self.calls += 1
        if self.calls <= self.n:
            raise LockedOut("locked out (test)", self.wait)

    def request(self, method, path, **_kw):
        self._gate()
        return _Resp(200, {"id": "w-1", "version": __import__("gpumesh").__version__,
                           "features": []})

    def stream_into(self, method, path, content=b"", **_kw):
        self._gate()
        return b"".join(wire.pack_frames([b'{"tasks": []}'])[0])


@pytest.fixture
def agent(tmp_path, monkeypatch):
    a = WorkerAgent("http://127.0.0.1:9", "t" * 32, slots=1, info={"gpus": [], "hostname": "h"},
                    cache_dir=tmp_path, bench=False)
    a.http.close()
    events: list[tuple[str, str]] = []
    a.on_event = lambda kind, text: events.append((kind, text))
    a.events = events  # type: ignore[attr-defined]
    monkeypatch.setattr("gpumesh.worker.agent.Handoff.probe", staticmethod(lambda http: None))
    yield a
    a.executor.close()


def test_a_worker_joins_after_waiting_out_a_lockout(agent):
    agent.http = _LockedThenOpen(3)  # type: ignore[assignment]
    agent._register(first=True)
    assert agent.id == "w-1" and agent.http.calls == 4
    waits = [t for k, t in agent.events if k == "waiting"]
    assert len(waits) == 1 and "locked out (test); waiting" in waits[0]  # said once a spell
    assert agent.events[-1] == ("joined", "joined mesh as w-1")


def test_a_result_is_posted_again_after_a_lockout(agent):
    agent.http = _LockedThenOpen(2)  # type: ignore[assignment]
    agent.poster = ResultPoster(agent)
    grant = protocol.TaskGrant("t1", "lease-t1", "f" * 64, slot=0)
    assert agent.poster.post(grant, Outcome("ok"), 0) == (None, None)
    assert agent.http.calls == 3  # refused twice, then posted: never dropped


def test_an_unreachable_coordinator_is_said_once_per_outage(agent):
    # The heartbeat meets a lost link first (a lease long-polls for 30 s): both paths say
    # it through one flag, once; a lease answered ends the outage.
    agent._unreachable(OSError("timed out"))
    agent._unreachable(OSError("timed out again"))
    assert agent.events == [("waiting", "coordinator unreachable (timed out), retrying")]
    agent._away = False  # (as a lease answered sets it)
    agent._unreachable(OSError("refused"))
    assert agent.events[-1] == ("waiting", "coordinator unreachable (refused), retrying")
    assert len(agent.events) == 2


def test_a_page_that_is_not_gpumeshs_says_each_of_its_texts_once():
    from gpumesh.errors import RequestRejected

    class Page(_Resp):
        def json(self):
            raise ValueError("not JSON")
    html = ("<html><head><title>404 Not Found</title></head><body><center><h1>404 Not Found"
            "</h1></center><hr><center>nginx/1.22.1</center></body></html>")
    resp = Page(404, None)
    resp.text = html
    with pytest.raises(RequestRejected) as e:
        check(resp, "http://c:1")
    assert ("answered with a page that is not gpumesh's (404 Not Found, nginx/1.22.1)"
            in str(e.value)), e.value
