"""Fixtures of the unit tests that drive a Coordinator over a real SQLite store with a
fake clock."""

from __future__ import annotations

import pytest

from gpumesh.coordinator.core import Coordinator
from gpumesh.coordinator.store import Store

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
