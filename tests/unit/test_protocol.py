"""gpumesh.protocol: the routes, codes, failure kinds and messages the coordinator, worker
and caller share — checked against what the coordinator really registers and answers,
and against the dicts that travel today."""

from __future__ import annotations

import ast
import hashlib
import json
import os
import socket
import time
import warnings
from pathlib import Path

import pytest

import gpumesh
from gpumesh import GPUMesh, errors, hardware, protocol, transport, wire
from gpumesh.client import calls, scripts
from gpumesh.client.paths import job_path
from gpumesh.coordinator.app import create_app
from gpumesh.coordinator.core import Coordinator
from gpumesh.coordinator.store import Store
from gpumesh.limits import LONG_POLL_S
from gpumesh.protocol import (ErrorCode, FailureKind, JobSubmit, LeaseRequest, ResultItem,
                              ResultPage, ResultPost, TaskGrant)

SRC = Path(gpumesh.__file__).parent
MAIN = "main-token-0123456789abcdefghij"
WORKER = "worker-token-0123456789abcdefgh"


def _modules(under: Path = SRC):
    for path in sorted(under.rglob("*.py")):
        yield path, ast.parse(path.read_text(encoding="utf-8"), str(path))


@pytest.fixture
def coordinator(tmp_path):
    """``(TestClient, app)`` of an in-process coordinator with a worker token."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from starlette.testclient import TestClient
        store = Store(tmp_path / "data")
        app = create_app(Coordinator(store), MAIN, worker_token=WORKER)
        c = TestClient(app, client=("192.0.2.7", 40000))
    yield c, app
    c.close()
    store.close()


def _auth(tok: str = MAIN) -> dict:
    return {"authorization": f"Bearer {tok}"}


def _frames(body: bytes) -> list:
    return wire.unpack_frames(bytearray(body))


# ------------------------------------------------------------------ routes ---------

def test_every_route_the_coordinator_registers_is_a_protocol_template_and_no_other(coordinator):
    _, app = coordinator
    registered = {r.path for r in app.routes}
    assert registered == set(protocol.TEMPLATES)


@pytest.mark.parametrize("build, expected", [
    (lambda: protocol.worker("ab12"), "/v1/workers/ab12"),
    (lambda: protocol.worker_heartbeat("ab12"), "/v1/workers/ab12/heartbeat"),
    (lambda: protocol.worker_session("ab12"), "/v1/workers/ab12/session"),
    (lambda: protocol.worker_lease("ab12"), "/v1/workers/ab12/lease"),
    (lambda: protocol.task_result("cd34"), "/v1/tasks/cd34/result"),
    (lambda: protocol.task_release("cd34"), "/v1/tasks/cd34/release"),
    (lambda: protocol.task_output("cd34"), "/v1/tasks/cd34/output"),
    (lambda: protocol.blob("e" * 64), "/v1/blobs/" + "e" * 64),
    (lambda: protocol.job("ff01"), "/v1/jobs/ff01"),
    (lambda: protocol.job_results("ff01"), "/v1/jobs/ff01/results"),
    (lambda: protocol.job_logs("ff01"), "/v1/jobs/ff01/logs"),
    (lambda: protocol.job_release("ff01"), "/v1/jobs/ff01/release"),
    (lambda: protocol.job_cancel("ff01"), "/v1/jobs/ff01/cancel"),
    (lambda: protocol.job_retry("ff01"), "/v1/jobs/ff01/retry"),
    (lambda: protocol.token("ann lee/x"), "/v1/tokens/ann%20lee%2Fx"),
    (lambda: protocol.dist_file("gpumesh-1.0-py3-none-any.whl"),
     "/v1/dist/gpumesh-1.0-py3-none-any.whl"),
])
def test_each_path_function_builds_a_path_one_registered_route_matches(coordinator, build, expected):
    from starlette.routing import Match
    _, app = coordinator
    path = build()
    assert path == expected
    scope = {"type": "http", "path": path, "method": "GET", "root_path": ""}
    matched = [r.path for r in app.routes if r.matches(scope)[0] != Match.NONE]
    assert set(matched) == {matched[0]} and len(matched) >= 1, matched


def test_a_path_parameter_can_never_add_a_segment_or_a_query():
    assert protocol.job_results("../x?y=1") == "/v1/jobs/..%2Fx%3Fy%3D1/results"


def test_job_path_uses_the_protocol_routes_and_refuses_unknown_actions_and_ids():
    assert job_path("abcd") == protocol.job("abcd")
    assert job_path("abcd", "results") == protocol.job_results("abcd")
    assert job_path("abcd", "cancel") == protocol.job_cancel("abcd")
    with pytest.raises(ValueError, match="no job route"):
        job_path("abcd", "explode")
    with pytest.raises(ValueError, match="not a job id"):
        job_path("../etc")


def test_the_docstring_lists_every_api_route():
    doc = protocol.__doc__
    for template in protocol.TEMPLATES:
        if not template.startswith(protocol.UI):
            assert template in doc, template


def _doc_rows(title: str) -> dict[str, str]:
    """The rows of the module docstring's table after ``title``: first word -> the line."""
    doc = protocol.__doc__
    block = doc[doc.index(title):].split("::\n\n", 1)[1].split("\n\n", 1)[0]
    rows = {}
    for line in block.splitlines():
        words = line.split()
        if words and not words[0].startswith("("):
            key = words[1] if words[0].isdigit() else words[0]
            rows[key] = line
    return rows


def test_the_docstring_has_one_line_for_every_error_code_and_failure_kind():
    codes = _doc_rows("Error codes:")
    assert set(codes) == {c.value for c in ErrorCode}
    kinds = _doc_rows("Failure kinds:")
    assert set(kinds) == {k.value for k in FailureKind}
    messages = _doc_rows("Messages (")
    assert set(messages) == {"JobSubmit", "LeaseRequest", "TaskGrant", "ResultPost", "ResultBatch",
                             "ResultPage"}
    for kind, line in kinds.items():  # "-> X" agrees with the table
        if "->" in line and kind != "raised":
            assert protocol.FAILURE_EXCEPTIONS[FailureKind(kind)].__name__ == line.split("->")[1].strip()


@pytest.mark.parametrize("code", [c.value for c in ErrorCode])
def test_what_the_docstring_says_the_caller_raises_for_each_code_is_what_it_raises(code):
    from gpumesh.transport import check
    line = _doc_rows("Error codes:")[code]
    status = int(line.split()[0])
    body = json.dumps({"error": code, "message": "m"}).encode()

    class Resp:
        status_code, text = status, body.decode()

        def json(self):
            return json.loads(body)

    with pytest.raises(errors.MeshError) as got:
        check(Resp(), "http://test")
    said = line.split("->")[1].split()[0] if "->" in line else "RequestRejected"
    if "from RequestRejected" in line:  # the client turns it into `said` (test_routing)
        said = "RequestRejected"
    assert type(got.value).__name__ == said


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = getattr(node, "body", [])
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


def test_no_code_outside_protocol_spells_a_v1_path():
    # coordinator/ registers the routes and moves to the protocol's templates with its own
    # rework (issue 15 item 2); everything that *calls* the API is checked here.
    spelled = []
    for path, tree in _modules():
        rel = path.relative_to(SRC).as_posix()
        if rel == "protocol.py" or rel.startswith("coordinator/"):
            continue
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and "/v1/" in node.value and id(node) not in docs):
                spelled.append(f"{rel}:{node.lineno}: {node.value!r}")
    assert spelled == []


# ------------------------------------------------------------------- codes ---------

#: What the coordinator's modules call to refuse a request: (status, code, message).
_REFUSALS = {"HTTPError", "_err", "AuthRefused", "_refuse", "error"}


def _code_values(node: ast.AST | None) -> set[str]:
    """The codes an expression can be: a string literal, ``ErrorCode.X``, or either
    branch of ``a if cond else b``."""
    if isinstance(node, ast.IfExp):
        return _code_values(node.body) | _code_values(node.orelse)
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id == "ErrorCode"):
        return {ErrorCode[node.attr].value}
    return set()


def _answered_codes() -> set[str]:
    """Every code the coordinator's modules answer: each ``ErrorCode.X`` they name, and
    the code argument of every refusal they construct (a literal, or a local name and
    what is assigned to it)."""
    found: set[str] = set()
    for _, tree in _modules(SRC / "coordinator"):
        assigned: dict[str, set[str]] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    if isinstance(t, ast.Name):
                        assigned.setdefault(t.id, set()).update(_code_values(node.value))
            elif isinstance(node, ast.Attribute):
                found |= _code_values(node)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or len(node.args) < 2:
                continue
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if name not in _REFUSALS or (name == "error" and not isinstance(f, ast.Name)):
                continue
            code = node.args[1]
            found |= _code_values(code)
            if isinstance(code, ast.Name):
                found |= assigned.get(code.id, set())
    return found


def test_every_error_code_the_coordinator_answers_is_an_ErrorCode_and_each_is_answered():
    answered = _answered_codes()
    assert {"bad_request", "stale_lease", "unknown_worker", "exists", "locked_out", "csrf"} <= answered
    assert answered == {c.value for c in ErrorCode}


def test_codes_and_kinds_are_their_values_in_json_and_text():
    assert json.dumps({"error": ErrorCode.STALE_LEASE}) == '{"error": "stale_lease"}'
    assert f"{ErrorCode.NO_WORKERS}" == "no_workers" and str(FailureKind.CRASHED) == "crashed"
    assert ErrorCode("unknown_worker") is ErrorCode.UNKNOWN_WORKER
    assert FailureKind.TIMEOUT == "timeout"


def test_a_refusal_the_caller_reads_compares_equal_to_its_code(coordinator):
    from gpumesh.transport import check
    c, _ = coordinator
    resp = c.post(protocol.task_result("ab12"), params={"lease": "cd34"},
                  content=b"".join(bytes(x) for x in wire.pack_frames([b'{"status": "ok"}', b"x"])[0]),
                  headers=_auth(WORKER))
    with pytest.raises(errors.RequestRejected) as got:
        check(resp, "http://test")
    assert got.value.code == ErrorCode.STALE_LEASE


# ------------------------------------------------------------------- kinds ---------

def _failure_kinds_in_src() -> set[str]:
    """Every failure kind src spells: the ``kind`` of a dict literal that has a
    ``message`` (a task error), ``kind=`` of ``dict(error, ...)``, the kind argument of
    ``describe_exception``/``_error``/``_kill``, and each ``FailureKind.X`` used."""
    found = set()
    for _, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.Dict):
                keys = [k.value for k in node.keys if isinstance(k, ast.Constant)]
                if "kind" in keys and "message" in keys:
                    v = node.values[keys.index("kind")] if None not in node.keys else None
                    if isinstance(v, ast.Constant) and isinstance(v.value, str):
                        found.add(v.value)
            elif isinstance(node, ast.Call):
                name = getattr(node.func, "id", getattr(node.func, "attr", None))
                if name == "dict":
                    found |= {k.value.value for k in node.keywords if k.arg == "kind"
                              and isinstance(k.value, ast.Constant)}
                if name in ("describe_exception", "_kill") and len(node.args) >= 2:
                    a = node.args[1]
                    if isinstance(a, ast.Constant) and isinstance(a.value, str):
                        found.add(a.value)
                if name == "_error" and node.args and isinstance(node.args[0], ast.Constant):
                    found.add(node.args[0].value)
            elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                  and node.value.id == "FailureKind" and node.attr.isupper()):
                found.add(FailureKind[node.attr].value)
    return found


def test_every_failure_kind_src_spells_is_a_FailureKind():
    spelled = _failure_kinds_in_src()
    assert {"raised", "crashed", "host_died", "lost", "cancelled", "missing_module"} <= spelled
    assert spelled <= {k.value for k in FailureKind}
    # and the enum names none that nothing produces (retry kinds included)
    assert {k.value for k in FailureKind} <= spelled


def test_the_failure_table_covers_every_kind_with_an_exception():
    assert set(protocol.FAILURE_EXCEPTIONS) == set(FailureKind)
    for kind, cls in protocol.FAILURE_EXCEPTIONS.items():
        exc = protocol.failure_exception(kind, "it went wrong", task_id="t1", worker="w1")
        assert type(exc) is cls and issubclass(cls, BaseException)
        assert "it went wrong" in str(exc)
    assert protocol.FAILURE_EXCEPTIONS[FailureKind.CRASHED] is errors.TaskCrashed
    assert protocol.FAILURE_EXCEPTIONS[FailureKind.LOST] is errors.WorkerLost
    assert protocol.FAILURE_EXCEPTIONS[FailureKind.TIMEOUT] is errors.TaskTimeout
    assert protocol.FAILURE_EXCEPTIONS[FailureKind.CANCELLED] is errors.Cancelled


def test_failure_exception_fills_each_class_as_the_caller_needs():
    e = protocol.failure_exception("raised", "boom (task 1)", remote_type="mod.Oops",
                                   remote_message="boom", traceback="tb", task_id="t", worker="w")
    assert isinstance(e, errors.RemoteError)
    assert (e.remote_type, e.remote_message, e.remote_traceback, e.task_id, e.worker) == \
        ("mod.Oops", "boom", "tb", "t", "w")
    m = protocol.failure_exception("missing_module", "no numpy", module="numpy")
    assert isinstance(m, ModuleNotFoundError) and m.name == "numpy"
    c = protocol.failure_exception("crashed", "SIGKILL", task_id="t", worker="w")
    assert (c.task_id, c.worker) == ("t", "w")
    for unknown in ("from_a_newer_worker", "", None):
        u = protocol.failure_exception(unknown, "?")
        assert type(u) is errors.TaskFailed


@pytest.mark.parametrize("kind", [k.value for k in FailureKind])
def test_the_caller_decodes_each_kind_through_the_table(kind):
    item = ResultItem(index=0, task_id="t1", state="failed", seq=0, worker="w1",
                      error={"kind": kind, "type": "ValueError", "message": "it went wrong"})
    exc = calls.failure(item, None)
    assert type(exc) is protocol.FAILURE_EXCEPTIONS[FailureKind(kind)]
    assert "it went wrong" in str(exc)


# ---------------------------------------------------------------- messages ---------

#: A submit as GPUMesh._submit builds it today.
CALLER_SUBMIT = {"job_id": "0a1b2c3d4e5f", "kind": "function", "fn": "a" * 64, "fn_inline": True,
                 "n_tasks": 2, "timeout": None, "require_worker": True, "name": "square",
                 "costs": [1.0, 1.0], "wait": 5.0, "output": False,
                 "caller": {"host": "box", "pid": 123}, "result_format": "json",
                 "isolation": "job", "require": {"gpu": "gpu"}, "retries": 2,
                 "retry_on": ["builtins.OSError"], "gpu_memory_mb": [100, None], "handoff": True}
#: A submit as client/scripts.py builds it today.
SCRIPT_SUBMIT = {"job_id": "0a1b2c3d4e5f", "kind": "script", "fn": "b" * 64, "fn_inline": False,
                 "n_tasks": 1, "timeout": 30, "name": "train.py", "result_format": "json",
                 "costs": [1.0]}


@pytest.mark.parametrize("d", [CALLER_SUBMIT, SCRIPT_SUBMIT])
def test_a_job_submit_round_trips_todays_dicts(d):
    m = JobSubmit.from_dict(d)
    assert m.as_dict() == d
    assert JobSubmit.from_dict(json.loads(json.dumps(m.as_dict()))) == m


class _Caller:
    """A caller's transport whose requests the in-process coordinator ``c`` answers (as
    :class:`~gpumesh.transport.Transport` would raise its refusals); it keeps each
    submit's JSON head and each answer's status."""

    def __init__(self, c):
        self.c, self.heads, self.answers = c, [], []

    def request(self, method, path, *, params=None, content=None, headers=None, timeout=None,
                **body):
        if content is not None and not isinstance(content, bytes):
            content = b"".join(bytes(x) for x in content)
        if path == protocol.JOBS and method == "POST":
            self.heads.append(json.loads(bytes(_frames(content)[0])))
        r = self.c.request(method, path, params=params, content=content,
                           headers={**_auth(), **(headers or {})}, **body)
        self.answers.append((method, path, r.status_code))
        transport.check(r, "http://testserver")
        return r

    def stream_into(self, method, path, **kw):
        kw.pop("buffer_for", None)
        r = self.request(method, path, **kw)
        return None if r.status_code == 204 else bytearray(r.content)

    def close(self):
        pass


def _mesh_on(fake, strict=False):
    """A GPUMesh whose requests go to ``fake`` (its health probe and hand-off probe
    skipped: the coordinator is up, and not on this machine)."""
    m = GPUMesh("http://testserver", MAIN, output=False, strict=strict)
    m._http, m._handoff, m._probe_ok_until = fake, None, time.monotonic() + 3600
    return m


def test_the_callers_submit_head_is_its_JobSubmit_as_dict(coordinator):
    """The head GPUMesh sends for a function job with hints, requirements, retries,
    strict results and job isolation is exactly ``JobSubmit(...).as_dict()`` of what the
    call asked for, and the coordinator's schema takes it (its refusal is no_workers,
    not a malformed field)."""
    c, _ = coordinator
    fake = _Caller(c)
    m = _mesh_on(fake, strict=True)
    need = hardware.Requirements(gpu="nvidia", cores=2)
    with pytest.raises(errors.Unsatisfiable):  # no worker: it would run here, which cannot
        m.run_calls(abs, [((-1,), {}), ((2,), {})], timeout=5.0, name="hinted", require=need,
                    hints=[{"cost": 2.0, "gpu_memory_mb": 1e8}, {}], retry=(2, (ValueError, KeyError)),
                    isolation="job")
    [head] = fake.heads
    assert fake.answers == [("POST", protocol.JOBS, 409)]
    fn = wire.dumps(abs, code=True)
    assert head == JobSubmit(
        job_id=head["job_id"], kind="function", fn=fn.sha256(), fn_inline=True, n_tasks=2,
        timeout=5.0, name="hinted", costs=[2.0, 1.0], result_format="json", isolation="job",
        require=need.to_meta(), gpu_memory_mb=[1e8, None], retries=2,
        # a mesh's first job: no wait for results, its "connected" line comes at acceptance
        retry_on=["ValueError", "KeyError"], require_worker=True, wait=0, output=False,
        caller={"host": socket.gethostname(), "pid": os.getpid()}).as_dict()
    announced = _mesh_on(fake)
    announced._announced = True  # (a mesh that took a job before: its submits wait)
    assert announced.run_calls(abs, [((-3,), {})]) == [3]  # a plain call (run here)
    plain = fake.heads[-1]
    assert plain == JobSubmit(job_id=plain["job_id"], kind="function", fn=fn.sha256(),
                              fn_inline=True, n_tasks=1, timeout=None, name="abs", costs=[1.0],
                              require_worker=True, wait=LONG_POLL_S, output=False,
                              caller={"host": socket.gethostname(), "pid": os.getpid()}).as_dict()
    assert "timeout" in plain and plain["timeout"] is None  # always sent, as before


def test_a_script_submit_is_its_JobSubmit_and_its_results_are_read_as_a_ResultPage(coordinator):
    """gpumesh submit's head is ``JobSubmit(...).as_dict()``; the coordinator stores the
    job, and scripts.wait reads the pages a worker's results make (a value, a failure)."""
    c, _ = coordinator
    fake = _Caller(c)
    m = _mesh_on(fake)
    source = b"import json, sys; print(json.dumps(json.load(sys.stdin)))\n"
    jid = scripts.submit(m, source, [{"a": 1, "gpu_memory_mb": 10}, 2], name="echo", timeout=3.0)
    [head] = fake.heads
    assert head == JobSubmit(job_id=jid, kind="script", fn=hashlib.sha256(source).hexdigest(),
                             fn_inline=True, n_tasks=2, timeout=3.0, name="echo",
                             result_format="json", costs=[1.0, 1.0],
                             gpu_memory_mb=[10.0, None]).as_dict()
    assert fake.answers == [("POST", protocol.JOBS, 200)]  # stored, though no worker is alive

    r = c.post(protocol.WORKERS, json={"slots": 1, "hostname": "box", "gpus": [
        {"index": 0, "name": "NVIDIA T4", "memory_total_mb": 15360, "memory_free_mb": 15000}],
        "slot_list": [{"id": 0, "kind": "cuda", "gpu": 0}]}, headers=_auth(WORKER))
    assert r.status_code == 200, r.text
    wid = r.json()["id"]
    posts = {0: (ResultPost("ok"), b'{"a": 1}'),
             1: (ResultPost("error", {"kind": FailureKind.SCRIPT, "type": "TaskFailed",
                                      "message": "exit status 3"}), None)}
    for _ in range(2):
        r = c.post(protocol.worker_lease(wid), json=LeaseRequest(slots=1, free=[0]).as_dict(),
                   headers=_auth(WORKER))
        g = TaskGrant.list_from_dict(json.loads(bytes(_frames(r.content)[0])))[0]
        post, payload = posts[g.index]
        chunks, _ = wire.pack_frames([json.dumps(post.as_dict()).encode()]
                                     + ([payload] if payload is not None else []))
        r = c.post(protocol.task_result(g.task_id), params={"lease": g.lease_id},
                   content=b"".join(bytes(x) for x in chunks), headers=_auth(WORKER))
        assert r.status_code == 200, r.text
    progress = []
    got = scripts.wait(m, jid, lambda *a: progress.append(a), timeout=30)
    by_index = {v["index"]: v for v in got.values()}
    assert by_index[0]["state"] == "done" and by_index[0]["result"] == {"a": 1}
    assert by_index[0]["worker"] == wid and by_index[0]["error"] is None
    assert by_index[1]["state"] == "failed" and by_index[1]["result"] is None
    assert by_index[1]["error"]["kind"] == "script" and by_index[1]["error"]["message"] == "exit status 3"
    assert progress[-1] == (2, 2, {"done": 1, "failed": 1})


class _Malformed:
    """A coordinator whose every results page lacks ``n_tasks``."""

    page = {"results": [], "n_final": 0, "state": "running", "workers_alive": 1,
            "workers_able": 1}

    def __init__(self):
        self.calls = []

    def stream_into(self, method, path, **kw):
        self.calls.append((method, path))
        chunks, _ = wire.pack_frames([json.dumps(self.page).encode()])
        return bytearray(b"".join(bytes(x) for x in chunks))

    def request(self, method, path, **kw):
        self.calls.append((method, path))

    def close(self):
        pass


def test_a_malformed_results_page_is_a_wire_error_naming_the_field_not_a_retry():
    fake = _Malformed()
    m = _mesh_on(fake)
    m._announced = True  # (it took a job before: its submit waits, the answer is the page)
    with pytest.raises(errors.WireError) as info:
        m.run_calls(abs, [((-1,), {})])
    text = str(info.value)
    assert "the coordinator at http://testserver (job " in text
    assert "malformed results page" in text and "'n_tasks' is required" in text
    jid = text.split("(job ", 1)[1].split(")", 1)[0]
    # One submit (its answer was the page), then the job is cancelled: never asked again.
    assert fake.calls[:2] == [("POST", protocol.JOBS), ("POST", protocol.job_cancel(jid))]
    fake.calls.clear()
    with pytest.raises(errors.WireError, match=r"\(job 00aa11bb22cc\).*'n_tasks' is required"):
        scripts.wait(m, "00aa11bb22cc", timeout=30)
    assert fake.calls == [("GET", protocol.job_results("00aa11bb22cc"))]


def test_result_posts_and_lease_requests_round_trip_what_the_worker_sent():
    for d in ({"status": "ok"},
              {"status": "error", "error": {"kind": "raised", "type": "ValueError", "message": "x",
                                            "traceback": "tb", "stderr_tail": "t"}},
              {"status": "ok", "handoff_files": {"0": "r-1234"}},
              {"status": "retry", "error": {"kind": "handoff", "message": "gone"}}):
        assert ResultPost.from_dict(d).as_dict() == d
    lease = {"slots": 2, "free": [0, 1], "wait": 30.0, "handoff": False}
    assert LeaseRequest.from_dict(lease).as_dict() == lease
    assert LeaseRequest(slots=2, free=[0, 1], wait=30.0).as_dict() == lease


def test_the_coordinators_own_grant_and_result_page_dicts_round_trip(coordinator):
    """A real exchange with an in-process coordinator: submit (a JobSubmit), lease (a
    LeaseRequest; the answer's tasks are TaskGrants), post (a ResultPost), read (a
    ResultPage): each dict the coordinator answers is reproduced exactly."""
    c, _ = coordinator
    r = c.post(protocol.WORKERS, json={"slots": 1, "hostname": "box"}, headers=_auth(WORKER))
    assert r.status_code == 200, r.text
    wid = r.json()["id"]
    blob = b"not really a function"
    submit = JobSubmit(job_id="00aa11bb22cc", fn=hashlib.sha256(blob).hexdigest(), n_tasks=2,
                       fn_inline=True, timeout=12.5, name="sq", require_worker=True,
                       isolation="job", result_format="json")
    chunks, _ = wire.pack_frames([json.dumps(submit.as_dict()).encode(), blob, b"a0", b"a1"])
    r = c.post(protocol.JOBS, content=b"".join(bytes(x) for x in chunks), headers=_auth())
    assert r.status_code == 200, r.text
    assert r.json() == {"job_id": "00aa11bb22cc", "n_tasks": 2, "created": True}

    r = c.post(protocol.worker_lease(wid), json=LeaseRequest(slots=1, free=[0]).as_dict(),
               headers=_auth(WORKER))
    assert r.status_code == 200, r.text
    frames = _frames(r.content)
    answer = json.loads(bytes(frames[0]))
    grants = TaskGrant.list_from_dict(answer)
    assert [g.as_dict() for g in grants] == answer["tasks"] and len(grants) == 1
    g = grants[0]
    assert (g.job_id, g.timeout, g.name, g.isolation, g.result_format, g.slot, g.attempt) == \
        ("00aa11bb22cc", 12.5, "sq", "job", "json", 0, 1)
    assert bytes(frames[1]) in (b"a0", b"a1")

    post = ResultPost("ok")
    chunks, _ = wire.pack_frames([json.dumps(post.as_dict()).encode(), b"[4]"])
    r = c.post(protocol.task_result(g.task_id), params={"lease": g.lease_id},
               content=b"".join(bytes(x) for x in chunks), headers=_auth(WORKER))
    assert r.status_code == 200, r.text
    failed = ResultPost("error", {"kind": FailureKind.CRASHED, "type": "TaskCrashed",
                                  "message": "killed by SIGKILL", "code": -9})
    for attempt in (1, 2, 3):  # a crash runs again, up to MAX_ATTEMPTS (3) attempts in all
        r = c.post(protocol.worker_lease(wid), json=LeaseRequest(slots=1, free=[0]).as_dict(),
                   headers=_auth(WORKER))
        g2 = TaskGrant.list_from_dict(json.loads(bytes(_frames(r.content)[0])))[0]
        assert g2.attempt == attempt
        chunks, _ = wire.pack_frames([json.dumps(failed.as_dict()).encode()])
        r = c.post(protocol.task_result(g2.task_id), params={"lease": g2.lease_id},
                   content=b"".join(bytes(x) for x in chunks), headers=_auth(WORKER))
        assert r.status_code == 200, r.text

    r = c.get(protocol.job_results("00aa11bb22cc"), params={"after": -1, "out_after": -1},
              headers=_auth())
    frames = _frames(r.content)
    raw = json.loads(bytes(frames[0]))
    page = ResultPage.from_dict(raw)
    assert page.as_dict() == raw
    assert (page.n_tasks, page.n_final, page.state, page.output) == (2, 2, "finished", [])
    by_task = {i.task_id: i for i in page.results}
    assert by_task[g.task_id].state == "done" and by_task[g.task_id].has_payload
    assert by_task[g2.task_id].error["kind"] == "crashed"
    assert type(calls.failure(by_task[g2.task_id], None)) is errors.TaskCrashed


def test_a_page_says_which_closed_workers_a_job_waits_for_and_old_pages_read_as_before(coordinator):
    """A job that only a paused worker could run: the submit that waits answers at once
    (it cannot start soon) with ``workers_closed``; the worker reopens and the next page
    no longer carries the key, so an open pool's page is what it was before the field."""
    c, _ = coordinator
    paused = {"state": "paused", "label": "paused: owner"}
    r = c.post(protocol.WORKERS, json={"slots": 1, "hostname": "box", "owner": paused},
               headers=_auth(WORKER))
    wid = r.json()["id"]
    blob = b"not really a function"
    submit = JobSubmit(job_id="00aa11bb22dd", fn=hashlib.sha256(blob).hexdigest(), n_tasks=1,
                       fn_inline=True, require_worker=True, wait=LONG_POLL_S)
    chunks, _ = wire.pack_frames([json.dumps(submit.as_dict()).encode(), blob, b"a0"])
    t = time.monotonic()
    r = c.post(protocol.JOBS, content=b"".join(bytes(x) for x in chunks), headers=_auth())
    assert r.status_code == 200, r.text
    assert time.monotonic() - t < LONG_POLL_S / 2  # not the whole long-poll
    raw = json.loads(bytes(_frames(r.content)[0]))
    page = ResultPage.from_dict(raw)
    assert page.as_dict() == raw
    assert (page.workers_alive, page.workers_able, page.workers_closed) == (1, 1, {"paused": 1})
    r = c.post(protocol.worker_heartbeat(wid), json={"running": [], "owner": None},
               headers=_auth(WORKER))
    assert r.status_code == 200, r.text
    raw = json.loads(bytes(_frames(c.get(protocol.job_results("00aa11bb22dd"), params={"after": -1},
                                         headers=_auth()).content)[0]))
    assert "workers_closed" not in raw and ResultPage.from_dict(raw).workers_closed is None
    # a reader from before the field ignores it: ResultPage reads only the keys it knows
    assert ResultPage.from_dict({**raw, "workers_closed": {"paused": 1}, "later_key": [1]}).n_tasks == 1


def test_a_grant_from_an_older_coordinator_takes_the_defaults_the_agent_assumed():
    g = TaskGrant.from_dict({"task_id": "t1", "lease_id": "l1", "fn": "f" * 64, "later_key": 1})
    assert (g.slot, g.timeout, g.kind, g.result_format, g.isolation, g.requires, g.args_file) == \
        (None, None, "function", "pickle", "task", None, None)


@pytest.mark.parametrize("cls, d, field", [
    (TaskGrant, {"lease_id": "l", "fn": "f"}, "'task_id' is required"),
    (TaskGrant, {"task_id": 7, "lease_id": "l", "fn": "f"}, "'task_id' must be str, got int"),
    (TaskGrant, {"task_id": "t", "lease_id": "l", "fn": "f", "index": True}, "'index' must be int"),
    (TaskGrant, {"task_id": "t", "lease_id": "l", "fn": "f", "requires": ["a", 1]}, "'requires'"),
    (TaskGrant, {"task_id": "t", "lease_id": "l", "fn": "f", "timeout": "5"}, "'timeout' must be int or float"),
    (ResultPost, {"status": "maybe"}, "'status' must be ok, error or retry"),
    (ResultPost, {"status": "error", "error": "text"}, "'error' must be dict"),
    (JobSubmit, {"job_id": "j", "fn": "f"}, "'n_tasks' is required"),
    (ResultPage, {"results": [{"index": 0}], "n_tasks": 1, "n_final": 1}, "'task_id' is required"),
    (ResultItem, ["not", "an", "object"], "must be a JSON object, got list"),
    (ResultPage, {"results": [], "n_tasks": 1, "n_final": 0, "workers_closed": {"paused": -1}},
     "workers_closed.paused must be a count"),
    (ResultPage, {"results": [], "n_tasks": 1, "n_final": 0, "workers_closed": {"hot": True}},
     "workers_closed.hot must be a count"),
    (ResultPage, {"results": [], "n_tasks": 1, "n_final": 0, "workers_closed": [1]},
     "'workers_closed' must be dict"),
])
def test_a_malformed_message_is_a_wire_error_naming_the_field(cls, d, field):
    with pytest.raises(errors.WireError, match=field.replace("(", r"\(")):
        cls.from_dict(d)


_NAME = "0123456789abcdef01234567.part"


def test_payload_references_round_trip_under_the_one_key():
    """Each message that names a payload elsewhere carries it under ``refs`` (and, for a
    peer from before refs, under its old key)."""
    submit = dict(CALLER_SUBMIT, refs={"1": {"kind": "handoff", "name": _NAME, "size": 9}},
                  handoff_files={"1": _NAME})
    assert JobSubmit.from_dict(submit).as_dict() == submit
    post = {"status": "ok", "handoff_files": {"0": _NAME},
            "refs": {"0": {"kind": "handoff", "name": _NAME}}}
    assert ResultPost.from_dict(json.loads(json.dumps(post))).as_dict() == post
    grant = {"task_id": "t", "job_id": "j", "index": 0, "lease_id": "l", "attempt": 1,
             "kind": "function", "fn": "f", "timeout": None, "name": "", "slot": 0,
             "result_format": "pickle", "isolation": "task",
             "refs": {"args": {"kind": "store", "path": "args/j/t"}}, "args_file": "args/j/t"}
    g = TaskGrant.from_dict(grant)
    assert g.as_dict() == grant and g.refs == {"args": {"kind": "store", "path": "args/j/t"}}
    item = {"index": 0, "task_id": "t", "state": "done", "seq": 1, "worker": "w", "error": None,
            "has_payload": False,
            "refs": {"result": {"kind": "store", "path": "results/j/t", "size": 4096}},
            "file": "results/j/t"}
    assert ResultItem.from_dict(item).as_dict() == item


_GRANT = {"task_id": "t", "lease_id": "l", "fn": "f"}


@pytest.mark.parametrize("cls, d, field", [
    (ResultPost, {"status": "ok", "refs": ["x"]}, r"field 'refs' must be dict, got list"),
    (ResultPost, {"status": "ok", "refs": {"zero": {}}}, r"field refs: 'zero' is not a frame"),
    (ResultPost, {"status": "ok", "refs": {"0": {"kind": "handoff", "name": "../../etc/passwd"}}},
     r"field refs\.0: 'name' must be a handoff file name"),
    (JobSubmit, dict(CALLER_SUBMIT, refs={"0": {"kind": "inline"}}),
     r"field refs\.0: 'kind' must be handoff or store"),
    (TaskGrant, dict(_GRANT, refs={"args": {"kind": "store", "path": "../../../etc/passwd"}}),
     r"field refs\.args: 'path' must be a payload path inside the store"),
    (TaskGrant, dict(_GRANT, refs={"args": {"kind": "store", "path": "/etc/passwd"}}),
     r"field refs\.args: 'path'"),
    (TaskGrant, dict(_GRANT, refs={"result": {"kind": "store", "path": "a"}}),
     r"field refs: 'result' is not one of args"),
    (ResultItem, {"index": 0, "task_id": "t", "state": "done", "seq": 1,
                  "refs": {"result": {"kind": "store", "path": "r", "size": 1.5}}},
     r"field refs\.result: 'size' must be a whole number"),
])
def test_a_bad_payload_reference_is_a_wire_error_naming_the_field(cls, d, field):
    with pytest.raises(errors.WireError, match=field):
        cls.from_dict(d)


def test_a_lease_answer_without_tasks_is_a_wire_error():
    with pytest.raises(errors.WireError, match="'tasks' is required"):
        TaskGrant.list_from_dict({"jobs": []})
    with pytest.raises(errors.WireError, match="lease answer must be a JSON object"):
        TaskGrant.list_from_dict([])


def test_the_agent_skips_a_lease_answer_that_is_not_one_and_frees_the_slots(caplog):
    from gpumesh.worker.agent import WorkerAgent
    from gpumesh.worker.executor import Executor
    released: list = []
    started: list = []

    class Agent:  # the members _start touches besides starting task threads
        _busy = {0: 1, 1: 1}
        _held: set = set()
        executor = Executor  # its .bodies: memory files, as on Linux's fork runtime

        def _release(self, slots):
            released.extend(slots)

        def _run_task(self, *a):
            started.append(a)

    chunks, _ = wire.pack_frames([json.dumps({"tasks": [{"task_id": 5, "lease_id": "l"}]}).encode(),
                                  b"args"])
    body = bytearray(b"".join(bytes(c) for c in chunks))
    with caplog.at_level("ERROR", logger="gpumesh.worker"):
        WorkerAgent._start(Agent(), body, [0, 1])
    assert released == [0, 1] and started == []
    assert "field 'task_id' must be str, got int" in caplog.text
