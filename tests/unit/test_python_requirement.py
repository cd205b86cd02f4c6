"""Code shipped by value is pinned to the caller's Python minor version."""

from __future__ import annotations

import math

import pytest

from gpumesh import hardware, wire
from gpumesh.hardware import Requirements


def _slot(python: str) -> hardware.Slot:
    info = {"python": python, "cores": 4, "ram_mb": 1024}
    return hardware.slots_of("w1", info, [{"id": 0, "kind": "cpu"}])[0]


def test_payload_says_whether_bytecode_travels():
    def nested(x):
        return x
    assert wire.dumps(nested, code=True).by_value is True
    assert wire.dumps(lambda: 1, code=True).by_value is True
    assert wire.dumps(math.sqrt, code=True).by_value is False  # by reference
    assert wire.dumps(((1, "CodeType"), {"k": b"x"})).by_value is False  # plain data
    assert wire.dumps(((lambda: 2,), {})).by_value is True  # a lambda among the arguments


def test_python_requirement_round_trips_and_is_validated():
    req = Requirements.from_meta({"python": "3.11", "cores": 2})
    assert req.python == "3.11" and req.cores == 2
    assert Requirements.from_meta(req.to_meta()) == req
    assert "Python 3.11" in req.describe()
    for bad in ("3", "3.x", 3.11, "3.11; rm", ""):
        with pytest.raises(ValueError, match="python"):
            Requirements.from_meta({"python": bad})


def test_slot_of_another_python_refuses_by_value_code():
    req = Requirements(python="3.11")
    assert _slot("3.11.7").python == "3.11"
    assert hardware.refusal(req, _slot("3.11.2")) is None
    assert hardware.refusal(req, _slot("3.12.1")) == "runs Python 3.12, not 3.11"
    assert hardware.refusal(req, _slot("")) is None  # a worker that did not say: not ruled out
    assert hardware.refusal(Requirements(), _slot("3.12.1")) is None  # by reference: anywhere
    assert not hardware.satisfiable(req, [_slot("3.12.1"), _slot("3.13.0")])
    assert hardware.satisfiable(req, [_slot("3.12.1"), _slot("3.11.9")])
