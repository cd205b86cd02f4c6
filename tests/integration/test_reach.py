"""``serve --tailscale`` and ``serve --public`` with their outside worlds replaced at the
narrowest boundary: a fake ``tailscale`` executable on PATH (a loopback alias stands in
for the tailnet address, or it fails as a logged-out client does), and a test double of
the ngrok SDK (tests/fakes/ngrok.py) whose "edge" forwards a TLS endpoint to the
coordinator and adds ``X-Forwarded-For`` as ngrok's does."""

from __future__ import annotations

import json
import os
import re
import socket
import ssl
import subprocess
import sys
from pathlib import Path

import cloudpickle
import httpx
import pytest

from gpumesh import GPUMesh, accelerate
from gpumesh.limits import AUTH_FAIL_MAX

from ..conftest import Mesh, Proc, free_port, wait_for

cloudpickle.register_pickle_by_value(sys.modules[__name__])

FAKES = Path(__file__).resolve().parents[1] / "fakes"
TAILNET_IP = "127.0.0.2"  # a loopback alias standing in for 100.x.y.z
MAGICDNS = "gpu-box.tail1234.ts.net"

FAKE_TAILSCALE = r"""#!/bin/sh
# A stand-in for the tailscale CLI; FAKE_TS says which state it is in.
case "$FAKE_TS:$1" in
  up:ip) echo "{ip}" ;;
  up:status) echo '{{"BackendState": "Running", "TailscaleIPs": ["{ip}"],
    "Self": {{"HostName": "gpu-box", "DNSName": "{name}.", "TailscaleIPs": ["{ip}"]}}}}' ;;
  nodns:ip) echo "{ip}" ;;
  nodns:status) echo '{{"BackendState": "Running", "CurrentTailnet": {{"MagicDNSEnabled": false}},
    "Self": {{"DNSName": "{name}."}}}}' ;;
  loggedout:ip) echo "no current Tailscale IPs; state: NeedsLogin" >&2; exit 1 ;;
  loggedout:status) echo "Logged out." ; exit 1 ;;
  stopped:*) echo "failed to connect to local tailscaled; it doesn't appear to be running (sudo systemctl start tailscaled ?)" >&2; exit 1 ;;
  *) echo "unexpected: $*" >&2; exit 2 ;;
esac
"""


def square(x):
    return x * x


@pytest.fixture
def ts_bin(tmp_path):
    d = tmp_path / "bin"
    d.mkdir()
    exe = d / "tailscale"
    exe.write_text(FAKE_TAILSCALE.format(ip=TAILNET_IP, name=MAGICDNS))
    exe.chmod(0o755)
    return d


def serve_once(env: dict, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """``gpumesh serve ARGS`` expected to stop by itself (a failure path)."""
    return subprocess.run([sys.executable, "-m", "gpumesh", "serve", "--no-self-worker",
                           "--port", str(free_port()), *args], env=env, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def refused(port: int, host: str) -> bool:
    try:
        socket.create_connection((host, port), timeout=2).close()
        return False
    except ConnectionRefusedError:
        return True


# ---------------------------------------------------------------- Tailscale --------

def test_tailscale_binds_only_the_tailnet_address_and_prints_its_join_lines(tmp_path, ts_bin):
    mesh = Mesh(tmp_path / "mesh")
    mesh.env.update(PATH=f"{ts_bin}{os.pathsep}{os.environ['PATH']}", FAKE_TS="up")
    mesh.url = f"http://{TAILNET_IP}:{mesh.port}"
    try:
        # the spec's own command line: --host 0.0.0.0 gives way to the tailnet address
        mesh.start(extra=["--host", "0.0.0.0", "--tailscale"])
        out = wait_for(lambda: "Ctrl+C" in mesh.coordinator.output() and mesh.coordinator.output(),
                       10, "the banner")
        assert f"[OK] Coordinator listening on {TAILNET_IP}:{mesh.port}" in out
        assert f"gpumesh join http://{TAILNET_IP}:{mesh.port} --token=<your token>" in out
        assert f"gpumesh join http://{MAGICDNS}:{mesh.port} --token=<your token>" in out
        assert f"tailnet address {TAILNET_IP} only" in out
        assert f"Join from THIS machine:   gpumesh join http://{TAILNET_IP}:" in out
        wait_for(lambda: "Self-check" in mesh.coordinator.output(), 10, "the self-check")
        assert f"Self-check: server is up (tested on {TAILNET_IP} only)" in mesh.coordinator.output()
        assert "127.0.0.1" not in mesh.coordinator.output()  # nothing listens there: not named
        assert refused(mesh.port, "127.0.0.1")  # not 0.0.0.0: nothing else listens
        saved = json.loads((tmp_path / "mesh" / "config.json").read_text())
        assert saved["url"] == mesh.url
        mesh.add_worker()
        client = GPUMesh(mesh.url, token=mesh.token, output=False)
        try:
            assert accelerate(client)(square)(9) == 81
        finally:
            client.close()
        # the tailnet address is a loopback alias here, yet no one is exempt from the lockout
        # (a loopback guesser of its own: the worker's successes would forgive 127.0.0.1's)
        with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.7"), timeout=10) as c:
            codes = [c.get(f"{mesh.url}/v1/jobs", headers={"authorization": "Bearer guess-guess-1"}
                           ).status_code for _ in range(AUTH_FAIL_MAX)]
            r = c.get(f"{mesh.url}/v1/jobs", headers={"authorization": f"Bearer {mesh.token}"})
        assert codes == [401] * (AUTH_FAIL_MAX - 1) + [429]
        assert r.status_code == 429 and "127.0.0.7" in r.json()["message"]
    finally:
        mesh.stop()


def test_tailnet_reads_the_address_and_the_magicdns_name(ts_bin, monkeypatch):
    from gpumesh.cli import reach
    monkeypatch.setenv("PATH", str(ts_bin))
    monkeypatch.setenv("FAKE_TS", "up")
    assert reach.tailnet() == reach.Tailnet(TAILNET_IP, MAGICDNS)
    monkeypatch.setenv("FAKE_TS", "nodns")  # MagicDNS off: the name would resolve nowhere
    assert reach.tailnet() == reach.Tailnet(TAILNET_IP, None)


@pytest.mark.parametrize("state, said", [
    ("loggedout", "state: NeedsLogin"),
    ("stopped", "systemctl start tailscaled"),
    ("missing", "was not found on PATH"),
])
def test_tailscale_unusable_prints_one_line_saying_what_to_run(tmp_path, ts_bin, state, said):
    env = dict(os.environ, HOME=str(tmp_path), GPUMESH_CONFIG=str(tmp_path / "config.json"),
               FAKE_TS=state, PATH=str(tmp_path) if state == "missing" else str(ts_bin))
    r = serve_once(env, "--tailscale", "--data-dir", str(tmp_path / "data"))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1, r.stderr
    assert len(lines) == 1 and lines[0].startswith("Error: --tailscale: "), r.stderr
    assert said in lines[0] and "tailscale up" in lines[0]
    assert not (tmp_path / "data").exists()  # nothing was set up


# ---------------------------------------------------------------- ngrok ------------

@pytest.fixture
def edge_cert(tmp_path):
    """A certificate for "localhost" that the test's clients trust as they trust a CA."""
    from gpumesh.tls import self_signed
    cert, key, _ = self_signed(tmp_path / "edge", "127.0.0.1")
    return cert, key


def public_env(tmp_path, edge_cert, **extra) -> dict:
    cert, key = edge_cert
    return dict(os.environ, HOME=str(tmp_path), GPUMESH_CONFIG=str(tmp_path / "config.json"),
                PYTHONPATH=os.pathsep.join([str(FAKES), os.environ.get("PYTHONPATH", "")]),
                FAKE_NGROK_CERT=str(cert), FAKE_NGROK_KEY=str(key), SSL_CERT_FILE=str(cert),
                **extra)


def through(url: str, source: str, token: str, cert) -> httpx.Response:
    """GET /v1/jobs at the public URL, connecting from loopback address ``source``."""
    transport = httpx.HTTPTransport(local_address=source, verify=ssl.create_default_context(cafile=str(cert)))
    with httpx.Client(transport=transport, timeout=10) as c:
        return c.get(f"{url}/v1/jobs", headers={"authorization": f"Bearer {token}"})


def test_public_url_takes_a_worker_and_a_call_and_locks_out_guessers(tmp_path, edge_cert,
                                                                      monkeypatch):
    mesh = Mesh(tmp_path / "mesh")
    mesh.env.update(public_env(tmp_path, edge_cert, NGROK_AUTHTOKEN="fake-authtoken"))
    mesh.env["HOME"] = str(tmp_path / "mesh" / "home")
    mesh.env["GPUMESH_CONFIG"] = str(tmp_path / "mesh" / "config.json")
    try:
        mesh.start(extra=["--public"])
        out = wait_for(lambda: "Public URL" in mesh.coordinator.output() and mesh.coordinator.output(),
                       20, "the public URL")
        url = re.search(r"\[OK\] Public URL \(ngrok tunnel\): (https://localhost:\d+)\n", out).group(1)
        assert f"gpumesh join {url} --token=<your token>" in out
        assert '"Anywhere" includes people you did not invite' in out
        assert "only through the public URL" in out and "CANNOT reach" not in out
        # a worker joins through the public URL, with normal CA-verified TLS (no pin)
        worker = Proc(["join", url], mesh.env, mesh.root / "worker.log")
        mesh.procs.append(worker)
        mesh.wait_alive(1, worker)
        monkeypatch.setenv("SSL_CERT_FILE", mesh.env["SSL_CERT_FILE"])
        client = GPUMesh(url, token=mesh.token, output=False)
        try:
            assert accelerate(client)(square)(12) == 144
            assert client.status(client.jobs()[0]["id"])["counts"] == {"done": 1}
        finally:
            client.close()
        # wrong tokens through the tunnel arrive from 127.0.0.1, yet the sender is locked out
        cert = edge_cert[0]
        codes = [through(url, "127.0.0.5", "guess-guess-guess-2", cert).status_code
                 for _ in range(AUTH_FAIL_MAX)]
        assert codes == [401] * (AUTH_FAIL_MAX - 1) + [429]
        r = through(url, "127.0.0.5", mesh.token, cert)
        assert r.status_code == 429 and "127.0.0.5" in r.json()["message"]
        assert through(url, "127.0.0.6", mesh.token, cert).status_code == 200  # others are not
        assert wait_for(lambda: mesh.alive() == 1, 5, "the worker to stay joined")
    finally:
        mesh.stop()


def test_the_sdk_double_has_the_sdks_signatures():
    import importlib.util
    import inspect
    real = pytest.importorskip("ngrok", reason="the ngrok SDK (gpumesh[tunnel]) is not installed")
    spec = importlib.util.spec_from_file_location("ngrok_double", FAKES / "ngrok.py")
    double = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(double)
    for name in ("forward", "disconnect"):
        assert inspect.signature(getattr(double, name)) == inspect.signature(getattr(real, name)), name


def test_public_without_an_authtoken_names_NGROK_AUTHTOKEN(tmp_path, edge_cert):
    env = public_env(tmp_path, edge_cert)
    env.pop("NGROK_AUTHTOKEN", None)
    r = serve_once(env, "--public", "--data-dir", str(tmp_path / "data"))
    assert r.returncode == 1
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("Error: --public needs an ngrok authtoken")
    assert "$NGROK_AUTHTOKEN" in r.stderr and "dashboard.ngrok.com" in r.stderr
    assert not (tmp_path / "data").exists()


def test_public_with_a_refused_authtoken_or_no_sdk_says_so(tmp_path, edge_cert):
    r = serve_once(public_env(tmp_path, edge_cert, NGROK_AUTHTOKEN="refused"), "--public",
                   "--data-dir", str(tmp_path / "data"))
    assert r.returncode == 1
    assert "Error: --public: ngrok did not open a tunnel (failed to connect session" in r.stderr
    assert "ERR_NGROK_105" in r.stderr
    nosdk = tmp_path / "nosdk"
    nosdk.mkdir()
    (nosdk / "ngrok.py").write_text("raise ImportError('No module named ngrok')\n")
    env = public_env(tmp_path, edge_cert, NGROK_AUTHTOKEN="fake-authtoken")
    env["PYTHONPATH"] = str(nosdk)
    r = serve_once(env, "--public", "--data-dir", str(tmp_path / "data2"))
    assert r.returncode == 1
    assert r.stderr.strip() == "Error: --public needs the ngrok Agent SDK: pip install ngrok"
    # neither: both said at once (one try tells all there is to fix)
    env.pop("NGROK_AUTHTOKEN")
    r = serve_once(env, "--public", "--data-dir", str(tmp_path / "data3"))
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("Error: --public needs the ngrok Agent SDK: pip install ngrok; "
                               "and an ngrok authtoken in $NGROK_AUTHTOKEN"), r.stderr


def test_public_and_tailscale_refuse_what_cannot_work_together(tmp_path, edge_cert, ts_bin):
    env = public_env(tmp_path, edge_cert, NGROK_AUTHTOKEN="fake-authtoken")
    r = serve_once(env, "--public", "--tls", "--data-dir", str(tmp_path / "d1"))
    assert r.returncode == 2 and "drop --tls" in r.stderr
    env["PATH"] = f"{ts_bin}{os.pathsep}{env['PATH']}"
    r = serve_once(dict(env, FAKE_TS="up"), "--public", "--tailscale", "--data-dir", str(tmp_path / "d2"))
    assert r.returncode == 2 and "pick one" in r.stderr
    r = serve_once(env, "--trusted-proxy", "nginx-box", "--data-dir", str(tmp_path / "d3"))
    assert r.returncode == 2
    assert r.stderr.strip() == ("Error: --trusted-proxy: 'nginx-box' is not an IP address or CIDR "
                                "range (e.g. 10.0.0.0/8, 127.0.0.1/32, fd00::/8)")
    r = serve_once(dict(env, GPUMESH_TRUSTED_PROXIES="10.0.0.0/8, 300.0.0.1"),
                   "--data-dir", str(tmp_path / "d4"))
    assert r.returncode == 2 and "'300.0.0.1' is not an IP address" in r.stderr
    assert not any((tmp_path / d).exists() for d in ("d1", "d2", "d3", "d4"))


def test_a_serve_flag_the_others_make_do_nothing_is_a_usage_error(tmp_path, ts_bin):
    # Each was accepted and ignored: --slots with no self-worker to give them, --host with
    # --tailscale (which binds the tailnet address instead).
    env = dict(os.environ, HOME=str(tmp_path), GPUMESH_TOKEN="t" * 32,
               PATH=f"{ts_bin}{os.pathsep}{os.environ['PATH']}", FAKE_TS="up")
    r = serve_once(env, "--slots", "4", "--data-dir", str(tmp_path / "d1"))  # (--no-self-worker)
    assert r.returncode == 2
    assert r.stderr.strip() == ("Error: --slots sets how many tasks the self-worker runs, and "
                                "--no-self-worker starts none: drop one (a worker joined with "
                                "`gpumesh join` takes --cpu-slots)")
    r = serve_once(env, "--tailscale", "--host", "192.0.2.10", "--data-dir", str(tmp_path / "d2"))
    assert r.returncode == 2
    assert r.stderr.strip() == (f"Error: --tailscale binds to this machine's tailnet address "
                                f"{TAILNET_IP}, not 192.0.2.10 (from --host or $GPUMESH_HOST): "
                                "drop one of them")
    assert not any((tmp_path / d).exists() for d in ("d1", "d2"))
