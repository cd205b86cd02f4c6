"""``gpumesh doctor URL`` as a worker machine runs it: name resolution, TCP reach, TLS, the
token, clock skew and version skew against that coordinator, each failure with its fix.

Real coordinators on 127.0.0.1 (plain and ``--tls``); the few things loopback cannot show
(a name that does not resolve, another machine's clock or version) are replaced at the
narrowest seam: ``socket.getaddrinfo``, the wall clock doctor reads, its own version.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from click.testing import CliRunner

from gpumesh.cli import doctor as doctor_mod
from gpumesh.cli import main

from ..conftest import free_port
from ..security.conftest import SecureMesh


def doctor(*args, **env):
    base = {"GPUMESH_URL": None, "GPUMESH_FINGERPRINT": None, "NO_COLOR": None}
    base.update(env)
    r = CliRunner().invoke(main, ["doctor", *args, "--json"], env=base, catch_exceptions=False)
    data = json.loads(r.output)
    return r.exit_code, {c["name"]: c for c in data["checks"]}


def test_a_good_coordinator_passes_every_network_check(shared_mesh, tmp_path):
    code, checks = doctor(shared_mesh.url, GPUMESH_TOKEN=shared_mesh.token,
                          GPUMESH_CONFIG=str(tmp_path / "none.json"))
    assert code == 0, checks
    for name in ("resolve", "tcp", "coordinator", "version", "clock", "token"):
        assert checks[name]["status"] == "ok", checks[name]
    assert checks["tls"]["status"] == "skip" and "loopback" in checks["tls"]["detail"]
    assert checks["tcp"]["detail"] == f"127.0.0.1:{shared_mesh.port} accepts connections"
    assert checks["coordinator"]["detail"].startswith(f"{shared_mesh.url} (as given) answers")


def test_a_name_that_does_not_resolve_says_what_to_use(monkeypatch, tmp_path):
    real = socket.getaddrinfo

    def resolver(host, *a, **kw):  # the names a user's DNS does not know
        if host.endswith((".example", ".ts.net")):
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return real(host, *a, **kw)
    monkeypatch.setattr(socket, "getaddrinfo", resolver)
    env = dict(GPUMESH_TOKEN="t" * 40, GPUMESH_CONFIG=str(tmp_path / "none.json"))
    code, checks = doctor("http://coordinator.example:8000", **env)
    assert code == 1
    assert checks["resolve"] == {"name": "resolve", "status": "fail",
                                 "detail": "cannot resolve coordinator.example (Name or service not known)",
                                 "fix": "check the spelling, or use the coordinator's IP address (the "
                                        "`Join from ANOTHER machine` line `gpumesh serve` printed)"}
    assert "tcp" not in checks and checks["token"]["status"] == "skip"
    code, checks = doctor("http://gpu-box.tail1234.ts.net:8000", **env)
    assert code == 1 and "sudo tailscale up" in checks["resolve"]["fix"]


def test_refused_and_silent_ports_get_different_fixes(tmp_path):
    env = dict(GPUMESH_TOKEN="t" * 40, GPUMESH_CONFIG=str(tmp_path / "none.json"))
    port = free_port()
    code, checks = doctor(f"http://127.0.0.1:{port}", **env)
    assert code == 1
    assert checks["tcp"]["detail"] == f"127.0.0.1:{port} refused the connection: nothing listens there"
    assert "start `gpumesh serve` here" in checks["tcp"]["fix"]
    # it stops at the first failed step: one FAIL, one fix, the rest not tried
    assert [c["name"] for c in checks.values() if c["status"] == "fail"] == ["tcp"]
    assert checks["coordinator"]["status"] == "skip" and checks["token"]["status"] == "skip"
    # A listener that never accepts, its queue full: new connections get no answer at all,
    # as behind a firewall that drops packets.
    silent = socket.create_server(("127.0.0.1", 0), backlog=0)
    held = []
    try:
        for _ in range(4):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(silent.getsockname())
            held.append(s)
        time.sleep(0.2)
        code, checks = doctor(f"http://127.0.0.1:{silent.getsockname()[1]}", **env)
    finally:
        for s in held:
            s.close()
        silent.close()
    assert code == 1
    assert checks["tcp"]["detail"].startswith("no answer from 127.0.0.1:")
    assert "firewall" in checks["tcp"]["fix"] and "--tailscale" in checks["tcp"]["fix"]


@pytest.fixture
def tls_mesh(tmp_path):
    m = SecureMesh(tmp_path / "tls", tls=True)
    m.start(extra=["--tls"])
    yield m
    m.stop()


def test_tls_is_checked_against_the_cas_or_the_pin(tls_mesh, shared_mesh, tmp_path):
    env = dict(GPUMESH_TOKEN=tls_mesh.token, GPUMESH_CONFIG=str(tmp_path / "none.json"))
    code, checks = doctor(tls_mesh.url, **env)
    assert code == 1 and checks["tls"]["status"] == "fail"
    assert "is not trusted here" in checks["tls"]["detail"]
    assert "--fingerprint" in checks["tls"]["fix"]
    code, checks = doctor(tls_mesh.url, GPUMESH_FINGERPRINT=tls_mesh.fingerprint, **env)
    assert code == 0, checks
    assert doctor(tls_mesh.url, "--fingerprint", tls_mesh.fingerprint, **env)[0] == 0
    assert checks["tls"]["status"] == "ok" and checks["token"]["status"] == "ok"
    wrong = "SHA256:" + "0" * 64
    code, checks = doctor(tls_mesh.url, GPUMESH_FINGERPRINT=wrong, **env)
    assert code == 1 and f"not the pinned {wrong}" in checks["tls"]["detail"]
    # https:// to a coordinator that speaks plain HTTP
    code, checks = doctor(shared_mesh.url.replace("http://", "https://"), **env)
    assert code == 1 and checks["tls"]["status"] == "fail"
    assert checks["tls"]["fix"].startswith("the coordinator serves plain HTTP: use http://")


def test_clock_and_version_skew_are_named_with_their_fix(shared_mesh, monkeypatch, tmp_path):
    env = dict(GPUMESH_TOKEN=shared_mesh.token, GPUMESH_CONFIG=str(tmp_path / "none.json"))
    monkeypatch.setattr(doctor_mod, "wall_clock", lambda: time.time() - 3600)
    code, checks = doctor(shared_mesh.url, **env)
    assert code == 1 and checks["clock"]["status"] == "fail"
    assert "ahead of this machine" in checks["clock"]["detail"]
    assert "timedatectl set-ntp true" in checks["clock"]["fix"]
    monkeypatch.setattr(doctor_mod, "wall_clock", lambda: time.time() + 60)
    code, checks = doctor(shared_mesh.url, **env)
    assert checks["clock"]["status"] == "warn" and "behind this machine" in checks["clock"]["detail"]
    monkeypatch.setattr(doctor_mod, "wall_clock", time.time)
    real = doctor_mod.__version__
    monkeypatch.setattr(doctor_mod, "__version__", "9.9.0")
    code, checks = doctor(shared_mesh.url, **env)
    assert code == 1 and checks["version"]["status"] == "fail"
    assert checks["version"]["fix"] == ("install the coordinator's here: pip install "
                                        f"{shared_mesh.url}/v1/dist/gpumesh-{real}-py3-none-any.whl")


def test_url_and_a_different_url_flag_is_a_usage_error():
    r = CliRunner().invoke(main, ["doctor", "http://a:1", "--url", "http://b:2"])
    assert r.exit_code == 2 and "two different URLs" in r.output


def test_safe_mode_with_no_worker_says_function_calls_are_refused(tmp_path, shared_mesh):
    """A safe-mode coordinator refuses every function job, workers or not: doctor must not
    say that calls run locally there (a call gets RequestRejected, 403)."""
    m = SecureMesh(tmp_path / "safe")
    m.start(extra=["--safe-mode"])
    try:
        assert m.request("GET", "/v1/health").json()["safe_mode"] is True
        env = dict(GPUMESH_TOKEN=m.token, GPUMESH_CONFIG=str(tmp_path / "none.json"))
        code, checks = doctor(m.url, **env)
    finally:
        m.stop()
    assert code == 0, checks  # warnings only: the coordinator is as its operator chose
    assert checks["safe mode"]["status"] == "warn"
    assert checks["safe mode"]["detail"] == (
        "the coordinator runs with --safe-mode: it refuses function calls (@mesh, GPUMesh.map) "
        "with RequestRejected (HTTP 403), whether or not workers are connected; script jobs "
        "(gpumesh submit) run")
    assert checks["workers"]["detail"] == ("no worker is connected: script jobs wait for one "
                                           "(function calls are refused: safe mode)")
    # Without --safe-mode there is no such check, and health says so.
    assert httpx.get(f"{shared_mesh.url}/v1/health", timeout=10).json()["safe_mode"] is False
    code, checks = doctor(shared_mesh.url, GPUMESH_TOKEN=shared_mesh.token,
                          GPUMESH_CONFIG=str(tmp_path / "none.json"))
    assert "safe mode" not in checks
