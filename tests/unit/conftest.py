"""Fixtures of the unit tests that drive a Coordinator over a real SQLite store with a
fake clock."""

from __future__ import annotations

import pytest

from gpumesh.coordinator.core import Coordinator
from gpumesh.coordinator.store import Store
from gpumesh.worker.agent import WorkerAgent
from gpumesh.worker.poster import ResultPoster

from ..conftest import FakeClock


@pytest.fixture(autouse=True)
def _cheap_kdf(cheap_kdf):
    """Every unit test's in-process coordinator hashes tokens cheaply (../conftest.py)."""


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "data")
    yield s
    s.close()


@pytest.fixture
def coord(store, clock) -> Coordinator:
    return Coordinator(store, clock=clock)


def stub_agent(tmp_path, http) -> WorkerAgent:
    """A two-slot worker agent that talks to ``http`` (a stand-in for its transport:
    ``stream_into`` answers each result post) instead of a coordinator; close its
    executor when done."""
    a = WorkerAgent("http://127.0.0.1:9", "t" * 32, slots=2, info={"gpus": [], "hostname": "h"},
                    cache_dir=tmp_path, bench=False)
    a.http.close()
    a.http = http
    a.poster = ResultPoster(a)
    return a
