"""Roles, lockout, safe mode, strict results and the task's environment, on live meshes."""

from __future__ import annotations

import os
import sys

import cloudpickle
import numpy as np
import pytest

from gpumesh import AuthError, RemoteError, RequestRejected, TaskFailed
from gpumesh.limits import AUTH_FAIL_MAX
from tests.security.conftest import WORKER_TOKEN, SecureMesh, proc_memory_texts

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def double(x):
    return 2 * x


def environment():
    with open("/proc/self/environ", "rb") as fh:
        raw = fh.read()
    return dict(os.environ), raw, os.getpid(), os.getppid()


class Boom(Exception):
    pass


def boom():
    raise Boom("from the task")


# ---------------------------------------------------------------- roles -------------

@pytest.fixture(scope="module")
def role_mesh(tmp_path_factory):
    m = SecureMesh(tmp_path_factory.mktemp("roles"))
    m.start(extra=["--worker-token", WORKER_TOKEN])
    m.join(token=WORKER_TOKEN)
    yield m
    m.stop()


def test_worker_joined_with_the_worker_token_serves_the_main_token(role_mesh, no_local_fallback):
    c = role_mesh.client()
    assert c.run_calls(double, [((i,), {}) for i in range(6)]) == [0, 2, 4, 6, 8, 10]
    c.close()


def test_worker_token_cannot_submit_list_or_cancel(role_mesh, no_local_fallback):
    w = role_mesh.client(token=WORKER_TOKEN)
    with pytest.raises(AuthError) as info:
        w.run_calls(double, [((1,), {})])
    assert "the worker token cannot" in str(info.value)
    for call in (w.jobs, w.workers, lambda: w.cancel("abcdef"), lambda: w.logs("abcdef")):
        with pytest.raises(AuthError) as info:
            call()
        assert "403" in str(info.value) and "main token" in str(info.value)
    w.close()


def test_task_environment_has_no_credentials_and_the_agent_never_unpickles(role_mesh, no_local_fallback):
    c = role_mesh.client()
    env, raw, pid, host_pid = c.run_calls(environment, [((), {})])[0]
    c.close()
    for name in ("GPUMESH_TOKEN", "GPUMESH_WORKER_TOKEN", "GPUMESH_CONFIG", "GPUMESH_URL",
                 "GPUMESH_FINGERPRINT"):
        assert name not in env
        assert name.encode() + b"=" not in raw
    for secret in (role_mesh.token, WORKER_TOKEN):
        assert secret not in repr(env) and secret.encode() not in raw
    assert env.get("GPUMESH_IN_TASK") == "1"
    # the function was unpickled in its host process (the task's parent), which is not the
    # worker agent (the `gpumesh join` process) and holds no credentials either
    agent_pid = role_mesh.procs[-1].p.pid
    assert host_pid != agent_pid and pid != agent_pid
    assert WORKER_TOKEN.encode() not in proc_memory_texts(host_pid)


# ---------------------------------------------------------------- lockout -----------

def test_loopback_typos_never_lock_the_user_out(role_mesh):
    for _ in range(AUTH_FAIL_MAX + 5):
        assert role_mesh.request("GET", "/v1/jobs", token=role_mesh.token + "-typo").status_code == 401
    assert role_mesh.request("GET", "/v1/jobs").status_code == 200


def test_proxied_guesses_are_locked_out_and_say_so(secure_mesh):
    m = secure_mesh()
    proxy = {"x-forwarded-for": "203.0.113.10"}
    codes = [m.request("GET", "/v1/jobs", token="guess-guess-guess-guess", headers=proxy).status_code
             for _ in range(AUTH_FAIL_MAX)]
    assert codes == [401] * (AUTH_FAIL_MAX - 1) + [429]
    r = m.request("GET", "/v1/jobs", headers=proxy)  # the right token, through the proxy
    assert r.status_code == 429 and int(r.headers["retry-after"]) > 0
    assert m.request("GET", "/v1/jobs").status_code == 200  # a local user, no proxy: served


def test_without_the_loopback_exemption_a_local_guesser_is_locked_out(secure_mesh, no_local_fallback):
    m = secure_mesh(env={"GPUMESH_LOOPBACK_EXEMPT": "0"})
    for _ in range(AUTH_FAIL_MAX - 1):
        assert m.request("GET", "/v1/jobs", token="guess-guess-guess-guess").status_code == 401
    with pytest.raises(AuthError) as info:
        m.client(token="guess-guess-guess-guess").workers()
    assert "locked out" in str(info.value) and "token" in str(info.value)
    assert m.request("GET", "/v1/jobs").status_code == 429


# ---------------------------------------------------------------- safe mode ---------

def test_safe_mode_refuses_function_calls_with_a_clear_error(secure_mesh, no_local_fallback):
    m = secure_mesh(extra=["--safe-mode"])
    m.join()
    assert "Safe mode: function (pickle) jobs are refused" in m.coordinator.output()
    c = m.client()
    with pytest.raises(RequestRejected) as info:
        c.run_calls(double, [((1,), {})])
    assert info.value.status == 403
    assert "safe mode" in str(info.value) and "function jobs" in str(info.value)
    assert c.jobs() == []
    c.close()


# ---------------------------------------------------------------- strict results ----

@pytest.fixture(scope="module")
def strict_mesh(tmp_path_factory):
    m = SecureMesh(tmp_path_factory.mktemp("strict"))
    m.start()
    m.join()
    yield m
    m.stop()


def plain():
    return {"acc": 0.93, "runs": [1, 2, 3], "name": "ok", "nan": float("nan"), "none": None,
            "nested": {"flag": True}}


def a_tuple():
    return (1, 2)


def numpy_scalar():
    return np.float64(0.5)


def int_keys():
    return {1: "one"}


def test_strict_results_round_trip_plain_json(strict_mesh, no_local_fallback):
    c = strict_mesh.client(strict=True)
    got = c.run_calls(plain, [((), {})])[0]
    assert got["acc"] == 0.93 and got["runs"] == [1, 2, 3] and got["nested"] == {"flag": True}
    assert got["nan"] != got["nan"]
    assert c.run_calls(double, [((21,), {})]) == [42]
    c.close()


@pytest.mark.parametrize("fn, words", [
    (a_tuple, "the result is a tuple"),
    (numpy_scalar, "numpy.float64"),
    (int_keys, "key of type int"),
])
def test_strict_results_refuse_values_json_would_change(strict_mesh, no_local_fallback, fn, words):
    c = strict_mesh.client(strict=True)
    with pytest.raises(RemoteError) as info:
        c.run_calls(fn, [((), {})])
    assert words in str(info.value) and "JSON" in str(info.value)
    assert info.value.remote_type == "NotJSON"
    c.close()


def test_strict_mode_never_unpickles_a_raised_exception(strict_mesh, no_local_fallback, monkeypatch):
    monkeypatch.setenv("GPUMESH_STRICT_RESULTS", "1")
    c = strict_mesh.client()
    assert c.strict
    with pytest.raises(RemoteError) as info:  # not Boom itself: that would need unpickling
        c.run_calls(boom, [((), {})])
    assert info.value.remote_type.endswith("Boom") and "from the task" in str(info.value)
    c.close()
    normal = strict_mesh.client(strict=False)
    with pytest.raises(Boom):
        normal.run_calls(boom, [((), {})])
    normal.close()


def test_strict_caller_refuses_a_pickle_from_a_worker(tmp_path):
    """What a hostile or outdated worker sends as a 'JSON' result is never unpickled."""
    from gpumesh import wire
    from gpumesh.client.calls import decode_result
    from gpumesh.protocol import ResultItem

    marker = tmp_path / "unpickled"

    class Evil:
        def __reduce__(self):
            return (os.mkdir, (str(marker),))

    payload = memoryview(bytearray(b"".join(bytes(c) for c in wire.dumps(Evil()).chunks)))
    item = ResultItem(index=0, task_id="t1", state="done", seq=0, worker="w1", has_payload=True)
    with pytest.raises(TaskFailed) as info:
        decode_result(item, payload, strict=True)
    assert "a pickle" in str(info.value) and "not decoded" in str(info.value)
    assert not marker.exists()
    err = ResultItem(index=0, task_id="t1", state="failed", seq=1,
                     error={"kind": "raised", "type": "Evil", "message": "m"})
    exc = None
    try:
        decode_result(err, payload, strict=True)
    except BaseException as e:  # noqa: BLE001
        exc = e
    assert isinstance(exc, RemoteError) and not marker.exists()
    decode_result(item, payload, strict=False)  # the default path does unpickle
    assert marker.exists()
