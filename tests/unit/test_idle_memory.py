"""What keeps an idle mesh small (docs/performance.md, "Idle memory"): which modules the
long-lived processes import, the zygote started on demand, the stdlib self-check."""

from __future__ import annotations

import http.server
import json
import os
import ssl
import subprocess
import sys
import threading
import time

import pytest

from gpumesh import wire
from gpumesh.protocol import TaskGrant
from gpumesh.cli.serve import _self_check
from gpumesh.worker.executor import Executor


def _modules_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys, json; print(json.dumps(sorted(sys.modules)))"],
                         capture_output=True, text=True, check=True, timeout=60)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def _top(mods: set[str]) -> set[str]:
    return {m.split(".")[0] for m in mods}


def test_worker_agent_imports_nothing_it_does_not_use():
    # What `gpumesh join` imports: the CLI, the agent and its HTTP client.
    top = _top(_modules_after("import gpumesh.cli, gpumesh.cli.join, gpumesh.worker.agent, "
                              "gpumesh.worker.device; gpumesh.worker.device.detect()"))
    assert "urllib3" in top  # sanity: the probe did import the agent's client
    # cloudpickle: only for pickling code; psutil: RAM size comes from os.sysconf;
    # zeroconf: only with discovery on; httpx (and its anyio, h11): not the agent's client.
    assert not top & {"rich", "pygments", "cloudpickle", "psutil", "zeroconf", "numpy",
                      "httpx", "httpcore", "h11", "anyio"}


def test_coordinator_imports_no_http_client():
    top = _top(_modules_after("import gpumesh.cli, gpumesh.cli.serve, gpumesh.coordinator.server"))
    assert not top & {"httpx", "httpcore", "rich", "pygments", "cloudpickle", "psutil", "zeroconf"}


def test_zygote_imports_only_what_hosts_share():
    top = _top(_modules_after("import gpumesh.worker.runner, cloudpickle, gpumesh.wire"))
    assert not top & {"httpx", "click", "rich", "hashlib", "_hashlib", "ssl", "numpy"}


def _children() -> set[int]:
    try:
        with open(f"/proc/{os.getpid()}/task/{os.getpid()}/children") as fh:
            return {int(p) for p in fh.read().split()}
    except OSError:
        pytest.skip("no /proc children list here")


@pytest.mark.skipif(sys.platform != "linux", reason="Linux /proc")
def test_zygote_starts_with_the_first_function_task(tmp_path):
    before = _children()
    ex = Executor(tmp_path / "spool")
    try:
        assert _children() == before  # idle: no interpreter but ours
        blob = tmp_path / "fn"
        blob.write_bytes(wire.dumps(abs, code=True).to_bytes())
        args = wire.dumps(((-3,), {})).to_bytes()
        out = ex.run(TaskGrant("t1", "-", "h" * 64, timeout=30), str(blob), args)
        assert out.status == "ok", out.error
        assert wire.loads(bytearray(out.payload)) == 3
        started = _children() - before
        assert len(started) == 1  # the zygote (hosts are its children)
        out = ex.run(TaskGrant("t2", "-", "h" * 64, timeout=30), str(blob), wire.dumps(((-4,), {})).to_bytes())
        assert wire.loads(bytearray(out.payload)) == 4
        assert _children() - before == started  # the same zygote, not a new one
    finally:
        ex.close()
    assert _children() == before
    # Closed: no zygote is started any more, the task is handed back.
    out = ex.run(TaskGrant("t3", "-", "h" * 64, timeout=30), str(blob), args)
    assert out.status == "retry"
    assert _children() == before


@pytest.mark.skipif(sys.platform != "linux", reason="Linux /proc")
def test_a_dead_zygote_is_replaced(tmp_path):
    import signal
    before = _children()
    ex = Executor(tmp_path / "spool")
    try:
        blob = tmp_path / "fn"
        blob.write_bytes(wire.dumps(abs, code=True).to_bytes())
        assert ex.run(TaskGrant("t1", "-", "a" * 64, timeout=30), str(blob), wire.dumps(((-1,), {})).to_bytes()).status == "ok"
        (zygote,) = _children() - before
        os.kill(zygote, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while ex._zygote.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        out = ex.run(TaskGrant("t2", "-", "b" * 64, timeout=30), str(blob), wire.dumps(((-2,), {})).to_bytes())
        assert out.status == "ok", out.error
        assert wire.loads(bytearray(out.payload)) == 2
        assert len(_children() - before) == 1 and zygote not in _children()
    finally:
        ex.close()
    assert _children() == before


def test_an_executor_that_ran_nothing_closes_at_once(tmp_path):
    t0 = time.monotonic()
    Executor(tmp_path / "spool").close()
    assert time.monotonic() - t0 < 1


# ---------------------------------------------------------------- serve's self-check ---
class _Health(http.server.BaseHTTPRequestHandler):
    status = 200
    body = b'{"ok": true, "version": "0"}'

    def do_GET(self):  # noqa: N802 - http.server's naming
        self.send_response(self.status if self.path == "/v1/health" else 404)
        self.send_header("content-length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


class _Server(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        pass  # e.g. the self-check hung up after a wrong pin, before our answer


def _serve(handler, ctx: ssl.SSLContext | None = None):
    srv = _Server(("127.0.0.1", 0), handler)
    if ctx is not None:
        srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, srv.server_address[1]


def test_self_check_plain_http():
    srv, port = _serve(_Health)
    try:
        assert _self_check(f"http://127.0.0.1:{port}", None) is None
    finally:
        srv.shutdown()
        srv.server_close()

    class Broken(_Health):
        status = 503
    srv, port = _serve(Broken)
    try:
        assert "HTTP 503" in _self_check(f"http://127.0.0.1:{port}", None)
    finally:
        srv.shutdown()
        srv.server_close()
    # Nothing listens there any more.
    assert "did not answer" in _self_check(f"http://127.0.0.1:{port}", None, timeout=2)


def test_self_check_tls_checks_the_pin(tmp_path):
    pytest.importorskip("cryptography")
    from gpumesh.tls import check_pair, self_signed
    cert, key, _ = self_signed(tmp_path, "127.0.0.1")
    pin = check_pair(cert, key)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    srv, port = _serve(_Health, ctx)
    try:
        url = f"https://127.0.0.1:{port}"
        assert _self_check(url, pin) is None
        wrong = "SHA256:" + "0" * 64
        assert "presents certificate" in _self_check(url, wrong)
    finally:
        srv.shutdown()
        srv.server_close()
