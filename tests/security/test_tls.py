"""``serve --tls``: a self-signed certificate, its fingerprint, pinning by join and GPUMesh."""

from __future__ import annotations

import hashlib
import ipaddress
import json
import re
import socket
import ssl
import subprocess
import sys
import time

import cloudpickle
import httpx
import pytest
from cryptography import x509

from gpumesh import AuthError, GPUMesh
from gpumesh.tls import fingerprint_pem, normalise_fingerprint, self_signed
from tests.conftest import free_port

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def triple(x):
    return 3 * x


def test_self_signed_certificate_names_the_bound_address_and_loopback(tmp_path):
    cert, key, created = self_signed(tmp_path, "127.0.0.1")
    assert created and oct(key.stat().st_mode & 0o777) == "0o600"
    c = x509.load_pem_x509_certificate(cert.read_bytes())
    san = c.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    ips = {str(a) for a in san.get_values_for_type(x509.IPAddress)}
    assert {"127.0.0.1", "::1"} <= ips
    assert "localhost" in san.get_values_for_type(x509.DNSName)
    assert fingerprint_pem(cert.read_text()) == "SHA256:" + hashlib.sha256(
        ssl.PEM_cert_to_DER_cert(cert.read_text())).hexdigest()
    # reused across restarts: pins stay valid, also when the machine's addresses change
    # (a new network, a container's new IP): a pin identifies the server, not the names
    again = self_signed(tmp_path, "127.0.0.1")
    assert again == (cert, key, False)
    assert self_signed(tmp_path, "192.0.2.45") == (cert, key, False)
    # a wildcard bind names this machine's own addresses too
    cert2, _, created2 = self_signed(tmp_path / "any", "0.0.0.0")
    san2 = x509.load_pem_x509_certificate(cert2.read_bytes()).extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value
    assert created2 and len(san2.get_values_for_type(x509.IPAddress)) >= 2
    # a specific other address is added when asked for
    cert3, _, _ = self_signed(tmp_path / "x", "192.0.2.44")
    san3 = x509.load_pem_x509_certificate(cert3.read_bytes()).extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value
    assert ipaddress.ip_address("192.0.2.44") in san3.get_values_for_type(x509.IPAddress)


def test_fingerprint_spellings():
    hexd = "ab" * 32
    want = "SHA256:" + hexd
    assert normalise_fingerprint(want) == want
    assert normalise_fingerprint(hexd.upper()) == want
    assert normalise_fingerprint("sha256:" + ":".join(hexd[i:i + 2] for i in range(0, 64, 2))) == want
    for bad in ("", "SHA256:abc", "MD5:" + hexd, "SHA256:" + "zz" * 32):
        with pytest.raises(ValueError):
            normalise_fingerprint(bad)


@pytest.fixture
def tls_mesh(secure_mesh):
    m = secure_mesh(tls=True)
    m.join()
    return m


def test_serve_tls_prints_the_fingerprint_of_the_certificate_it_serves(tls_mesh):
    m = tls_mesh
    assert re.fullmatch(r"SHA256:[0-9a-f]{64}", m.fingerprint)
    der = ssl.get_server_certificate(("127.0.0.1", m.port))
    assert fingerprint_pem(der) == m.fingerprint
    assert (m.root / "data" / "tls" / "cert.pem").exists()
    out = m.coordinator.output()
    assert f"gpumesh join https://127.0.0.1:{m.port} --fingerprint {m.fingerprint}" in out
    # plain http on the TLS port gets nowhere
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{m.port}/v1/health", timeout=3)


def test_pinned_join_and_call_run_over_tls(tls_mesh, no_local_fallback):
    c = tls_mesh.client()
    assert c.url.startswith("https://")
    assert c.run_calls(triple, [((i,), {}) for i in range(5)]) == [0, 3, 6, 9, 12]
    c.close()


def test_wrong_or_missing_pin_is_an_auth_error_never_a_local_run(tls_mesh, no_local_fallback):
    m = tls_mesh
    wrong = "SHA256:" + "0" * 64
    with pytest.raises(AuthError) as info:
        GPUMesh(m.url, token=m.token, fingerprint=wrong, output=False).run_calls(triple, [((1,), {})])
    assert m.fingerprint in str(info.value) and wrong in str(info.value)
    with pytest.raises(AuthError) as info:
        GPUMesh(m.url, token=m.token, output=False).workers()
    assert "fingerprint" in str(info.value)
    with pytest.raises(ValueError):
        GPUMesh(f"http://127.0.0.1:{m.port}", token=m.token, fingerprint=m.fingerprint)


def test_join_with_a_wrong_fingerprint_exits_with_one_line(tls_mesh):
    m = tls_mesh
    r = subprocess.run([sys.executable, "-m", "gpumesh", "join", m.url, "--fingerprint",
                        "SHA256:" + "1" * 64], env=m.env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1].startswith("Error: the coordinator at")
    assert m.fingerprint in r.stderr
    r = subprocess.run([sys.executable, "-m", "gpumesh", "join", m.url, "--fingerprint", "nope"],
                       env=m.env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "SHA256:<64 hex digits>" in r.stderr  # a malformed flag value


def test_every_client_command_takes_the_pin_as_a_flag(tls_mesh):
    # The error without a pin tells the user to pass --fingerprint: `workers` (as every
    # command with --url) takes it. No saved config and no $GPUMESH_FINGERPRINT here,
    # so only the flag can pin.
    m = tls_mesh
    env = dict(m.env, GPUMESH_CONFIG=str(m.root / "absent.json"))
    env.pop("GPUMESH_FINGERPRINT", None)

    def workers(*extra):
        return subprocess.run([sys.executable, "-m", "gpumesh", "workers", "--url", m.url, "--json",
                               *extra], env=env, capture_output=True, text=True, timeout=60)
    r = workers()
    assert r.returncode == 1 and "--fingerprint" in r.stderr
    r = workers("--fingerprint", m.fingerprint)
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)) == 1
    wrong = "SHA256:" + "1" * 64
    r = workers("--fingerprint", wrong)
    assert r.returncode == 1
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith(f"Error: the coordinator at {m.url} presents")
    assert m.fingerprint in line and wrong in line
    r = workers("--fingerprint", "SHA256:abc")
    assert r.returncode == 2
    assert r.stderr.strip() == ("Error: --fingerprint: fingerprint 'SHA256:abc' is not "
                                "SHA256:<64 hex digits> (gpumesh serve --tls prints it)")


def test_saved_config_pins_for_the_saved_url(tls_mesh, monkeypatch):
    m = tls_mesh
    monkeypatch.setenv("GPUMESH_CONFIG", str(m.root / "config.json"))
    for k in ("GPUMESH_URL", "GPUMESH_TOKEN", "GPUMESH_FINGERPRINT"):
        monkeypatch.delenv(k, raising=False)
    c = GPUMesh(output=False)
    assert c.url == m.url and c.fingerprint == m.fingerprint
    assert len(c.workers()) == 1


def test_restart_keeps_the_certificate_and_its_fingerprint(tls_mesh):
    m = tls_mesh
    before = m.fingerprint
    m.restart()
    assert m.fingerprint == before
    assert "new self-signed TLS certificate" not in m.coordinator.output().split("coordinator stopped")[-1]


def test_own_certificate_and_key(secure_mesh, tmp_path, no_local_fallback):
    cert, key, _ = self_signed(tmp_path / "mine", "127.0.0.1")
    m = secure_mesh(extra=["--tls-cert", str(cert), "--tls-key", str(key)])
    assert m.url.startswith("https://")
    assert m.fingerprint == fingerprint_pem(cert.read_text())
    m.join()
    c = m.client()
    assert c.run_calls(triple, [((2,), {})]) == [6]
    c.close()


def test_mismatched_own_pair_is_refused_in_one_line(tmp_path):
    import os
    cert, _, _ = self_signed(tmp_path / "a", "127.0.0.1")
    _, key, _ = self_signed(tmp_path / "b", "127.0.0.1")
    env = dict(os.environ, HOME=str(tmp_path), GPUMESH_CONFIG=str(tmp_path / "c.json"))
    r = subprocess.run([sys.executable, "-m", "gpumesh", "serve", "--no-self-worker", "--port", str(free_port()),
                        "--data-dir", str(tmp_path / "d"), "--tls-cert", str(cert), "--tls-key", str(key)],
                       env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and r.stderr.startswith("Error: cannot use") and r.stderr.count("\n") == 1
    # one of the pair without the other is a usage error: one line naming both, exit 2
    for given, path, missing in (("--tls-cert", cert, "--tls-key"), ("--tls-key", key, "--tls-cert")):
        r = subprocess.run([sys.executable, "-m", "gpumesh", "serve", "--no-self-worker", "--port",
                            str(free_port()), "--data-dir", str(tmp_path / "e"), given, str(path)],
                           env=env, capture_output=True, text=True, timeout=30)
        assert r.returncode == 2, r.stderr
        assert r.stderr.count("\n") == 1 and r.stderr.startswith(f"Error: {given} needs {missing} too")
        assert not (tmp_path / "e").exists()                    # refused before anything is written
    # a file that is not there is named (ssl's own error names none)
    for pair, absent in (((tmp_path / "nope.pem", key), tmp_path / "nope.pem"),
                         ((cert, tmp_path / "nokey.pem"), tmp_path / "nokey.pem")):
        r = subprocess.run([sys.executable, "-m", "gpumesh", "serve", "--no-self-worker", "--port",
                            str(free_port()), "--data-dir", str(tmp_path / "f"), "--tls-cert",
                            str(pair[0]), "--tls-key", str(pair[1])],
                           env=env, capture_output=True, text=True, timeout=30)
        assert (r.returncode, r.stderr) == (1, f"Error: TLS file not found: {absent}\n")


def test_a_handshake_that_never_happens_blocks_nobody(tls_mesh):
    """Idle sockets on the TLS port (connected, nothing sent; or a ClientHello cut short)
    must not delay anyone else: every normal request is answered within 100 ms."""
    m = tls_mesh
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    idle = [socket.create_connection(("127.0.0.1", m.port)) for _ in range(10)]
    half = []
    for _ in range(10):
        s = socket.create_connection(("127.0.0.1", m.port))
        s.sendall(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03")  # the start of a ClientHello
        half.append(s)
    try:
        with httpx.Client(verify=ctx, timeout=5) as client:
            client.get(f"{m.url}/v1/health")  # warm: the handshake of this client is done
            worst = 0.0
            for _ in range(20):
                t0 = time.perf_counter()
                assert client.get(f"{m.url}/v1/health").status_code == 200
                worst = max(worst, time.perf_counter() - t0)
        # a brand-new connection (with its own handshake) gets through as well
        t0 = time.perf_counter()
        with httpx.Client(verify=ctx, timeout=5) as fresh:
            assert fresh.get(f"{m.url}/v1/health").status_code == 200
        fresh_s = time.perf_counter() - t0
    finally:
        for s in idle + half:
            s.close()
    print(f"\n[tls] 20 idle handshakes open: worst request {worst * 1000:.1f} ms, "
          f"fresh TLS connection {fresh_s * 1000:.1f} ms")
    assert worst < 0.1
    assert fresh_s < 0.5


def _expired_pair(tmp_path):
    """A self-signed certificate valid only in 2020, and its key (PEM files)."""
    import datetime

    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "expired")])
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(datetime.datetime(2020, 1, 1, tzinfo=datetime.timezone.utc))
            .not_valid_after(datetime.datetime(2020, 1, 2, tzinfo=datetime.timezone.utc))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(
                ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = tmp_path / "old.pem", tmp_path / "old.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def test_an_expired_certificate_is_refused_by_serve_and_named_by_a_pinned_client(tmp_path):
    import os
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from gpumesh.transport import Transport
    cert, key = _expired_pair(tmp_path)
    env = dict(os.environ, HOME=str(tmp_path), GPUMESH_CONFIG=str(tmp_path / "c.json"))
    r = subprocess.run([sys.executable, "-m", "gpumesh", "serve", "--no-self-worker", "--port",
                        str(free_port()), "--data-dir", str(tmp_path / "d"), "--tls-cert", str(cert),
                        "--tls-key", str(key)], env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 1, r.stderr
    assert "expired on 2020-01-02 00:00 UTC: workers and callers would refuse it" in r.stderr
    # A server that presents it anyway: a pinned client says it expired, not "intercepting".

    class Ok(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()

        def log_message(self, *a):
            pass
    server = HTTPServer(("127.0.0.1", 0), Ok)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(str(cert), str(key))
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    th = threading.Thread(target=server.serve_forever, daemon=True)
    th.start()
    try:
        t = Transport(f"https://127.0.0.1:{server.server_address[1]}", "t" * 32,
                      fingerprint=fingerprint_pem(cert.read_text()))
        with pytest.raises(AuthError) as e:
            t.request("GET", "/v1/health", timeout=10)
        t.close()
        assert "presents a certificate that has expired" in str(e.value), e.value
        assert "intercepting" not in str(e.value)
    finally:
        server.shutdown()
        server.server_close()
