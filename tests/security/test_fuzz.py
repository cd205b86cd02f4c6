"""Property-based fuzz of the live coordinator from its own OpenAPI description.

Schemathesis turns ``GET /v1/openapi.json`` (fetched from the running coordinator) into
Hypothesis strategies, valid ("positive") and invalid ("negative") requests for every
operation, sent with the main token over real HTTP while a real worker is connected.
The properties: no answer is a 5xx, and afterwards the coordinator still runs a real
function call on that worker. The budget is fixed (``FUZZ_EXAMPLES`` per operation and
mode, derandomised so CI runs the same requests every time); the request and 5xx
counts are printed (``-s`` shows them) and written to ``fuzz-report.json`` in the
test's tmp dir.

Frames bodies (``application/x-gpumesh-frames``) are built from the generated frame-0
metadata: a submit's ``n_tasks`` is taken modulo 9 (its ``costs`` list cut or repeated to
match) and it carries that many argument payloads and, when ``fn_inline`` is set, a real
function blob whose hash replaces ``fn``, so valid submits reach deep into the job path. Long-poll waits are clamped to 1 s to keep
the run short; nothing else is changed.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections import Counter

import cloudpickle
import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402

from gpumesh import wire  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])

#: Examples per operation and generation mode (positive, negative).
FUZZ_EXAMPLES = 100
FRAMES = "application/x-gpumesh-frames"


def noop(*args, **kwargs):
    return len(args) + len(kwargs)


_BLOB = b"".join(bytes(c) for c in wire.dumps(noop).chunks)
_BLOB_SHA = hashlib.sha256(_BLOB).hexdigest()
_ARGS = b"".join(bytes(c) for c in wire.dumps(((), {})).chunks)


def _frames_body(value) -> bytes:
    frames = []
    extra: list[bytes] = []
    if isinstance(value, dict):
        value = dict(value)
        if value.get("fn_inline") is True:
            value["fn"] = _BLOB_SHA
            extra.append(_BLOB)
        n = value.get("n_tasks")
        if isinstance(n, int) and not isinstance(n, bool) and n >= 0:
            n = value["n_tasks"] = n % 9
            extra += [_ARGS] * n
            costs = value.get("costs")
            if isinstance(costs, list) and costs:
                value["costs"] = (costs * n)[:n]
        if value.get("status") == "ok":
            extra.append(_ARGS)
        if "wait" in value and isinstance(value["wait"], (int, float)) and not isinstance(value["wait"], bool):
            value["wait"] = min(value["wait"], 1)
    try:
        frames.append(json.dumps(value).encode())
    except (TypeError, ValueError):
        frames.append(repr(value).encode())
    chunks, _ = wire.pack_frames(frames + extra)
    return b"".join(bytes(c) for c in chunks)


@schemathesis.serializer(FRAMES)
def _serialize_frames(ctx, value):
    return _frames_body(value)


@pytest.mark.timeout(300)
def test_fuzz_finds_no_5xx_and_a_real_worker_keeps_serving(secure_mesh, tmp_path, no_local_fallback):
    from schemathesis import GenerationMode

    m = secure_mesh()
    m.join()
    auth = {"authorization": f"Bearer {m.token}"}
    schema = schemathesis.openapi.from_url(f"{m.url}/v1/openapi.json")
    statuses: Counter = Counter()
    per_op: Counter = Counter()
    server_errors: list[str] = []
    t0 = time.monotonic()

    for result in schema.get_all_operations():
        op = result.ok()
        if op.path.endswith("/session"):
            continue  # a pulse is held open by design; its 404 path is covered below
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, derandomize=True,
                      phases=[Phase.explicit, Phase.generate],
                      suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case):
                if isinstance(case.query, dict) and "wait" in case.query:
                    case.query["wait"] = 0
                if isinstance(case.body, dict) and isinstance(case.body.get("wait"), (int, float)) \
                        and not isinstance(case.body.get("wait"), bool):
                    case.body["wait"] = min(case.body["wait"], 1)
                try:
                    resp = case.call(base_url=m.url, headers=auth, timeout=15)
                except Exception as e:  # noqa: BLE001 - a request the client library refuses
                    statuses[f"client:{type(e).__name__}"] += 1
                    return
                statuses[resp.status_code] += 1
                per_op[f"{op.method.upper()} {op.path} {resp.status_code}"] += 1
                if resp.status_code >= 500:
                    server_errors.append(f"{op.method.upper()} {op.path} -> {resp.status_code}: "
                                         f"{resp.text[:300]}\n{case.as_curl_command()[:1500]}")
            try:
                run()
            except Unsatisfiable:  # nothing invalid to send (e.g. GET /v1/health, negative)
                pass

    elapsed = time.monotonic() - t0
    sent = sum(n for k, n in statuses.items() if isinstance(k, int))
    fivexx = sum(n for k, n in statuses.items() if isinstance(k, int) and k >= 500)
    report = {"requests": sent, "5xx": fivexx, "seconds": round(elapsed, 1),
              "statuses": {str(k): n for k, n in sorted(statuses.items(), key=str)},
              "per_operation": dict(per_op)}
    (tmp_path / "fuzz-report.json").write_text(json.dumps(report, indent=2))
    print(f"\n[fuzz] {sent} requests in {elapsed:.1f}s, {fivexx} answered 5xx; statuses {report['statuses']}")
    assert not server_errors, "\n\n".join(server_errors[:10])
    assert sent >= 500, report
    assert len({k.rsplit(" ", 1)[0] for k in per_op}) >= 18, per_op

    # the coordinator is still whole: the pulse path, the pool, and a real call
    assert m.request("GET", "/v1/workers/ffffffffffff/session").status_code == 404
    assert m.request("GET", "/v1/health").json()["ok"] is True
    assert m.alive() >= 1
    c = m.client()
    try:
        assert c.run_calls(noop, [((1, 2), {}), ((), {"a": 1})]) == [2, 1]
    finally:
        c.close()
