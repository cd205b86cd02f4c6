"""The gpumesh command line: version, serve, join, workers, and their bad-input errors."""

from __future__ import annotations

import getpass
import json
import os
import re
import secrets
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from gpumesh import accelerate

from ..conftest import TOKEN, Proc, alive, children, free_port, wait_for

VERSION_RE = r"^gpumesh \d+\.\d+\.\d+ \(3\.\d+\.\d+, Linux\)$"


@pytest.fixture
def cli_env(tmp_path):
    """An environment with no gpumesh settings, its own HOME and config path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUMESH_")}
    (tmp_path / "home").mkdir()
    env.update(HOME=str(tmp_path / "home"), GPUMESH_CONFIG=str(tmp_path / "config.json"))
    return env


@pytest.fixture
def procs():
    """Processes a test starts itself; stopped at the end."""
    started: list[Proc] = []
    yield started
    for p in reversed(started):
        p.stop()


def run_cli(args, env, timeout=30, exe=None):
    cmd = [exe] if exe else [sys.executable, "-m", "gpumesh"]
    return subprocess.run(cmd + list(args), env=env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def assert_one_line_error(r, *words, code=1):
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("Error: "), lines[0]
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


def healthy(url):
    try:
        return httpx.get(f"{url}/v1/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def start_serve(tmp_path, env, args, name="serve"):
    port = free_port()
    proc = Proc(["serve", "--port", str(port), "--data-dir", str(tmp_path / f"{name}-data"), *args],
                env, tmp_path / f"{name}.log")
    url = f"http://127.0.0.1:{port}"

    def up():
        if proc.p.poll() is not None:
            raise AssertionError("serve exited:\n" + proc.output())
        return healthy(url)
    wait_for(up, 30, "the coordinator to answer")
    return proc, port, url


def auth(token):
    return {"authorization": f"Bearer {token}"}


# ---------------------------------------------------------------- version ------------

def test_version_console_script(cli_env):
    exe = Path(sys.executable).parent / "gpumesh"
    assert exe.exists()
    r = run_cli(["--version"], cli_env, exe=str(exe))
    assert r.returncode == 0, r.stderr
    assert re.match(VERSION_RE, r.stdout.strip()), r.stdout
    import platform

    import gpumesh
    assert r.stdout.strip() == f"gpumesh {gpumesh.__version__} ({platform.python_version()}, Linux)"


def test_version_python_m(cli_env):
    r = run_cli(["--version"], cli_env)
    assert r.returncode == 0, r.stderr
    assert re.match(VERSION_RE, r.stdout.strip()), r.stdout


def test_help_lists_commands(cli_env):
    r = run_cli(["--help"], cli_env)
    assert r.returncode == 0
    for cmd in ("serve", "join", "workers"):
        assert cmd in r.stdout


# ---------------------------------------------------------------- join: bad input ----

@pytest.mark.parametrize("url", ["ftp://x", "127.0.0.1:8000", "localhost"])
def test_join_url_without_http_scheme(cli_env, url):
    r = run_cli(["join", url, "--token", "x" * 43], cli_env, timeout=20)
    line = assert_one_line_error(r, "http://", code=2)  # a usage error
    assert url in line


def test_join_fingerprint_with_an_http_url_is_a_usage_error(cli_env):
    r = run_cli(["join", "http://127.0.0.1:9", "--token", "x" * 43, "--fingerprint",
                 "SHA256:" + "1" * 64], cli_env, timeout=20)
    assert_one_line_error(r, "--fingerprint pins a TLS certificate", "not an https:// URL", code=2)


@pytest.mark.parametrize("flags, words", [
    (["--tls-cert", "c.pem"], ["--tls-cert needs --tls-key too"]),
    (["--tls-key", "k.pem"], ["--tls-key needs --tls-cert too"]),
    (["--tailscale", "--public"], ["--tailscale and --public"]),
    (["--public", "--tls"], ["--public", "drop --tls"]),
])
def test_serve_flags_that_do_not_go_together_are_usage_errors(cli_env, tmp_path, flags, words):
    # refused first (before a token too short, say), naming the flags, leaving nothing behind
    data = tmp_path / "data"
    r = run_cli(["serve", "--no-self-worker", "--port", str(free_port()), "--data-dir", str(data),
                 *flags], dict(cli_env, GPUMESH_TOKEN="short"), timeout=20)
    assert_one_line_error(r, *words, code=2)
    assert not data.exists() and not (tmp_path / "config.json").exists()


def test_join_without_token(cli_env, shared_mesh):
    r = run_cli(["join", shared_mesh.url], cli_env, timeout=20)
    assert_one_line_error(r, "token")


def test_no_token_configured_says_so(cli_env, shared_mesh, monkeypatch):
    """No --token, $GPUMESH_TOKEN or saved config: the error says no token is configured
    and how to give one, not that a token was refused (CLI and Python alike)."""
    r = run_cli(["workers", "--url", shared_mesh.url], cli_env)
    line = assert_one_line_error(r, f"no token is configured for the coordinator at {shared_mesh.url}",
                                 "--token", "$GPUMESH_TOKEN", "gpumesh setup")
    assert "refused" not in line
    monkeypatch.delenv("GPUMESH_TOKEN", raising=False)
    monkeypatch.setenv("GPUMESH_CONFIG", cli_env["GPUMESH_CONFIG"])
    from gpumesh import GPUMesh
    from gpumesh.errors import AuthError
    with pytest.raises(AuthError, match="no token is configured") as info:
        GPUMesh(shared_mesh.url, token=None).workers()
    assert "refused" not in str(info.value)


def test_join_wrong_token(cli_env, shared_mesh):
    t0 = time.monotonic()
    r = run_cli(["join", shared_mesh.url, "--token=wrong-token"], cli_env, timeout=30)
    assert time.monotonic() - t0 < 15
    line = assert_one_line_error(r, "token")
    assert "refused" in line
    assert shared_mesh.alive() == 2  # nothing joined


# ---------------------------------------------------------------- serve: bad input ---

def test_serve_port_in_use(cli_env, tmp_path):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    port = s.getsockname()[1]
    try:
        r = run_cli(["serve", "--port", str(port), "--data-dir", str(tmp_path / "d"),
                     "--no-self-worker", "--token", TOKEN], cli_env, timeout=30)
    finally:
        s.close()
    line = assert_one_line_error(r, "already in use", str(port))
    assert "--port" in line
    assert not (tmp_path / "d").exists()  # refused before anything was created


def test_serve_host_not_on_this_machine(cli_env, tmp_path):
    r = run_cli(["serve", "--host", "192.0.2.1", "--port", str(free_port()),
                 "--data-dir", str(tmp_path / "d"), "--no-self-worker", "--token", TOKEN],
                cli_env, timeout=30)
    assert_one_line_error(r, "192.0.2.1", "--host")
    assert not (tmp_path / "d").exists()


def test_serve_unwritable_data_dir(cli_env, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    r = run_cli(["serve", "--port", str(free_port()), "--data-dir", str(blocker / "sub"),
                 "--no-self-worker", "--token", TOKEN], cli_env, timeout=30)
    assert_one_line_error(r, "data directory", "--data-dir")


@pytest.mark.skipif(not Path("/etc/hostname").is_file(), reason="needs /etc/hostname to be a file")
def test_serve_data_dir_under_a_system_file(cli_env):
    r = run_cli(["serve", "--port", str(free_port()), "--data-dir", "/etc/hostname/sub",
                 "--no-self-worker", "--token", TOKEN], cli_env, timeout=30)
    assert_one_line_error(r, "/etc/hostname/sub")


def test_serve_empty_token(cli_env, tmp_path):
    r = run_cli(["serve", "--port", str(free_port()), "--data-dir", str(tmp_path / "d"),
                 "--no-self-worker", "--token", "   "], cli_env, timeout=30)
    assert_one_line_error(r, "token", code=2)  # a bad flag value: a usage error


# ---------------------------------------------------------------- serve: tokens ------

def test_token_beginning_with_dash_works_as_flag_value(cli_env, tmp_path, procs):
    tok = "-" + secrets.token_urlsafe(32)
    coord, port, url = start_serve(tmp_path, cli_env, ["--no-self-worker", f"--token={tok}"])
    procs.append(coord)
    assert httpx.get(f"{url}/v1/workers", headers=auth(tok), timeout=5).json() == []
    assert httpx.get(f"{url}/v1/workers", headers=auth(tok[1:]), timeout=5).status_code == 401
    worker = Proc(["join", url, f"--token={tok}"], cli_env, tmp_path / "worker.log")
    procs.append(worker)

    def joined():
        if worker.p.poll() is not None:
            raise AssertionError("worker exited:\n" + worker.output())
        return [w for w in httpx.get(f"{url}/v1/workers", headers=auth(tok), timeout=5).json() if w["alive"]]
    (w,) = wait_for(joined, 30, "the worker to join")
    assert f"joined mesh as {w['id']}" in wait_for(
        lambda: "joined mesh as" in worker.output() and worker.output(), 10, "the join line")
    r = run_cli(["workers", "--url", url, f"--token={tok}"], cli_env)
    assert r.returncode == 0, r.stderr
    assert "[alive]" in r.stdout and w["id"][:8] in r.stdout
    # the token was given, so it is never printed
    assert tok not in coord.output()


def test_serve_without_token_generates_and_saves_one(cli_env, tmp_path, procs):
    coord, port, url = start_serve(tmp_path, cli_env, ["--no-self-worker"])
    procs.append(coord)
    out = wait_for(lambda: "Ctrl+C" in coord.output() and coord.output(), 10, "the banner")
    token_lines = [ln for ln in out.splitlines() if ln.strip().startswith("Token:")]
    assert len(token_lines) == 1, out
    tok = token_lines[0].split("Token:", 1)[1].strip()
    assert len(tok) >= 43 and not tok.startswith("-")
    assert re.fullmatch(r"[A-Za-z0-9_-]+", tok)
    cfg = Path(cli_env["GPUMESH_CONFIG"])
    assert stat.S_IMODE(cfg.stat().st_mode) == 0o600
    assert json.loads(cfg.read_text()) == {"url": url, "token": tok}
    assert f"config saved to {cfg}" in out
    assert f"[OK] Coordinator listening on 127.0.0.1:{port}" in out
    assert "Join from THIS machine:" in out
    assert f"gpumesh join {url} --token={tok}" in out
    assert "CANNOT reach" in out
    assert "NETWORK-EXPOSED" not in out and "Reachability" not in out
    # the printed token is the one the coordinator wants
    assert httpx.get(f"{url}/v1/workers", headers=auth(tok), timeout=5).status_code == 200
    assert httpx.get(f"{url}/v1/workers", headers=auth(tok + "x"), timeout=5).status_code == 401
    assert httpx.get(f"{url}/v1/workers", timeout=5).status_code == 401
    # a caller with nothing but the saved config finds it
    r = run_cli(["workers"], cli_env)
    assert r.returncode == 0, r.stderr
    assert "no workers connected" in r.stdout


def test_given_token_is_never_printed(shared_mesh):
    out = shared_mesh.coordinator.output()
    assert "[OK] Coordinator listening on 127.0.0.1:" in out
    assert shared_mesh.token not in out
    assert "--token=<your token>" in out


@pytest.mark.parametrize("how", ["flag", "env"])
def test_serve_on_all_interfaces_warns(cli_env, tmp_path, procs, how):
    env = dict(cli_env, GPUMESH_TOKEN=TOKEN)
    args = ["--no-self-worker"]
    if how == "flag":
        args += ["--host", "0.0.0.0"]
    else:
        env["GPUMESH_HOST"] = "0.0.0.0"
    coord, port, url = start_serve(tmp_path, env, args)
    procs.append(coord)
    out = wait_for(lambda: "Ctrl+C" in coord.output() and coord.output(), 10, "the banner")
    assert f"[OK] Coordinator listening on 0.0.0.0:{port}" in out
    assert "NETWORK-EXPOSED COORDINATOR" in out
    # the self-check only tries loopback, and the banner says so for the LAN address
    from gpumesh.cli.serve import _lan_ip
    where = f"http://{_lan_ip()}:{port}" if _lan_ip() else f"port {port}"
    assert (f"   Reachability of {where} from other machines is not tested here — a worker "
            "joining confirms it.") in out.splitlines()
    assert getpass.getuser() in out
    assert "Join from THIS machine:" in out
    assert TOKEN not in out


# ---------------------------------------------------------------- workers ------------

def test_workers_table(cli_env, shared_mesh):
    env = dict(cli_env, GPUMESH_URL=shared_mesh.url, GPUMESH_TOKEN=shared_mesh.token)
    r = run_cli(["workers"], env)
    assert r.returncode == 0, r.stderr
    assert "WORKERS" in r.stdout
    rows = [ln for ln in r.stdout.splitlines() if "[alive]" in ln]
    assert len(rows) == 2, r.stdout
    ids = {w["id"][:8] for w in shared_mesh.workers()}
    for row in rows:
        assert "score=" in row
        assert row.split()[0] in ("CPU", "GPU")
        assert row.split()[1] in ids
    r = run_cli(["workers", "--json"], env)
    assert r.returncode == 0
    data = json.loads(r.stdout)
    assert {w["id"] for w in data} == {w["id"] for w in shared_mesh.workers()}


def test_workers_none_connected(cli_env, start_empty_coordinator):
    url, token = start_empty_coordinator()
    r = run_cli(["workers", "--url", url, "--token", token], cli_env)
    assert r.returncode == 0, r.stderr
    assert "WORKERS" in r.stdout
    assert "no workers connected" in r.stdout
    assert "[alive]" not in r.stdout


def test_workers_wrong_token_and_down(cli_env, shared_mesh):
    wrong = "nope" * 8
    r = run_cli(["workers", "--url", shared_mesh.url, "--token", wrong], cli_env)
    assert_one_line_error(r, "token")
    r = run_cli(["workers", "--url", f"http://127.0.0.1:{free_port()}", "--token", wrong], cli_env)
    assert_one_line_error(r, "cannot reach")
    r = run_cli(["workers", "--url", "ftp://x", "--token", wrong], cli_env)
    assert_one_line_error(r, "--url: ", "http://", code=2)
    # a token no coordinator issues (docs/cli.md: under 16 characters) is a usage error
    r = run_cli(["workers", "--url", shared_mesh.url, "--token", "nope"], cli_env)
    assert r.returncode == 2, r.stderr
    assert "'--token': the token is 4 characters; a coordinator's tokens have at least 16" in r.stderr


# ---------------------------------------------------------------- workers' lives -----

def test_self_worker_joins(make_mesh):
    mesh = make_mesh(self_worker=True)
    mesh.wait_alive(1, timeout=30)
    out = wait_for(lambda: "[worker] joined mesh as" in mesh.coordinator.output()
                   and mesh.coordinator.output(), 15, "the self-worker's join line")
    (w,) = mesh.workers()
    assert f"[worker] joined mesh as {w['id']}" in out
    assert "[OK] Self-worker started" in out
    assert "[OK] Self-check: server is up" in out
    # README's Quickstart shows serve's banner: the self-worker's lines are as printed
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text().splitlines()
    lines = out.splitlines()
    for line in ("[OK] Self-worker started — this machine's CPU/GPU is part of the pool",
                 "   (disable with --no-self-worker)"):
        assert line in lines and line in readme, line
    runtime = wait_for(lambda: next((x for x in mesh.coordinator.output().splitlines()
                                     if x.startswith("[worker] runtime: ")), None), 15,
                       "the self-worker's runtime line")
    if runtime == "[worker] runtime: fork (default on Linux)":  # (README shows Linux's default)
        assert runtime in readme
    assert [x for x in readme if x.startswith("[worker] runtime: ")], "README lacks the runtime line"
    client = mesh.client()

    @accelerate(client)
    def f(x):
        return x + 1

    assert f.map([1, 2, 3]) == [2, 3, 4]
    client.close()
    # Ctrl+C on serve stops the coordinator and takes its self-worker with it
    kids = children(mesh.coordinator.p.pid)
    assert kids, "the self-worker should be a child of serve"
    mesh.coordinator.p.send_signal(signal.SIGINT)
    assert mesh.coordinator.p.wait(10) == 0
    assert "coordinator stopped" in mesh.coordinator.output()
    wait_for(lambda: not any(alive(k) for k in kids), 10,
             "the self-worker to exit")


def test_serve_stops_on_sigint_with_a_worker_connected(make_mesh):
    """Regression: uvicorn's graceful shutdown used to wait forever for the workers'
    never-ending session streams, so Ctrl+C did nothing while a worker was connected."""
    mesh = make_mesh(workers=1)
    t0 = time.monotonic()
    mesh.coordinator.p.send_signal(signal.SIGINT)
    try:
        code = mesh.coordinator.p.wait(5)
    except subprocess.TimeoutExpired:
        code = None
    assert code == 0, f"serve still running {time.monotonic() - t0:.0f}s after Ctrl+C"
    assert "coordinator stopped" in mesh.coordinator.output()


def test_sigint_worker_deregisters_and_task_reruns_elsewhere(make_mesh, tmp_path):
    mesh = make_mesh(workers=1)
    first = mesh.procs[-1]
    client = mesh.client()
    pids = tmp_path / "pids"
    pids.mkdir()

    @accelerate(client)
    def slow(x, where):
        import os as _os
        import time as _t
        open(_os.path.join(where, str(_os.getpid())), "w").close()
        _t.sleep(4)
        return x * 3

    box: dict = {}

    def call():
        try:
            box["v"] = slow(14, str(pids))
        except BaseException as e:  # noqa: BLE001
            box["e"] = e

    th = threading.Thread(target=call, daemon=True)
    th.start()
    (first_task,) = wait_for(lambda: [int(p.name) for p in pids.iterdir()], 10, "the task to start")
    mesh.add_worker()
    assert mesh.alive() == 2
    t0 = time.monotonic()
    first.p.send_signal(signal.SIGINT)
    wait_for(lambda: mesh.alive() == 1, 2, "the stopped worker to leave (within 2 s)")
    assert first.p.wait(10) == 0
    assert "[worker] stopped" in first.output()
    assert not alive(first_task), "the stopped worker left its task running"
    th.join(15)
    assert not th.is_alive(), "the re-queued task did not finish on the second worker"
    assert box == {"v": 42}, box
    assert time.monotonic() - t0 < 12
    assert len(list(pids.iterdir())) == 2  # run once on each worker
    client.close()


# ---------------------------------------------------------------- from Python ------

def test_start_coordinator_and_add_worker_from_python(tmp_path, monkeypatch):
    from gpumesh import GPUMesh
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("GPUMESH_CONFIG", str(tmp_path / "config.json"))
    for name in ("GPUMESH_URL", "GPUMESH_TOKEN", "GPUMESH_LOCAL", "GPUMESH_HOST"):
        monkeypatch.delenv(name, raising=False)
    port = free_port()
    handle = GPUMesh.start_coordinator(port=port, data_dir=str(tmp_path / "data"), self_worker=True)
    worker = None
    try:
        assert handle.url == f"http://127.0.0.1:{port}"
        assert len(handle.token) >= 43 and not handle.token.startswith("-")
        client = GPUMesh(handle.url, token=handle.token)
        wait_for(lambda: len(client.workers()) == 1, 30, "the self-worker")
        worker = GPUMesh.add_worker(handle.url, token=handle.token)
        assert isinstance(worker, dict) and worker["alive"] is True
        assert {"id", "device", "device_name", "hostname", "score", "alive"} <= set(worker)
        ids = {w["id"] for w in client.workers() if w["alive"]}
        assert worker["id"] in ids and len(ids) == 2

        @accelerate(client)
        def f(x):
            return -x

        assert f.map(range(4)) == [0, -1, -2, -3]
        worker.stop()
        assert worker.process.returncode == 0
        wait_for(lambda: sum(w["alive"] for w in client.workers()) == 1, 5, "the worker to leave")
        client.close()
        kids = children(handle.process.pid)
        t0 = time.monotonic()
        handle.stop()
        assert time.monotonic() - t0 < 10
        assert handle.process.returncode == 0, handle.log_tail()
        # the self-worker went with it: no orphan left behind
        wait_for(lambda: not any(alive(k) for k in kids), 10, "the self-worker to exit")
        # started again without a token, it keeps the one serve saved for this URL (as
        # `gpumesh serve` does): workers that joined it are not locked out
        again = GPUMesh.start_coordinator(port=port, data_dir=str(tmp_path / "data"), self_worker=False)
        again.stop()
        assert again.token == handle.token
    finally:
        if worker is not None:
            worker.stop()
        handle.stop()


# ---------------------------------------------------------------- pipes --------------

def test_a_reader_that_leaves_early_is_not_an_error(cli_env, shared_mesh):
    # `gpumesh workers | head -1`: the pipe closes before the command writes.
    env = dict(cli_env, GPUMESH_URL=shared_mesh.url, GPUMESH_TOKEN=shared_mesh.token)
    p = subprocess.Popen([sys.executable, "-m", "gpumesh", "workers"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()
    _, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert b"error" not in err and b"Traceback" not in err, err


def test_join_a_url_that_is_not_a_coordinator_says_so_in_one_line(cli_env):
    # e.g. a proxy's URL without its path prefix: nginx answers an HTML 404 page
    import http.server
    import threading

    class NotGpumesh(http.server.BaseHTTPRequestHandler):
        def _page(self):
            body = b"<html>\n<head><title>404 Not Found</title></head>\n<body>\n" \
                   b"<center><h1>404 Not Found</h1></center>\n<hr><center>nginx/1.22.1</center>\n</body>\n</html>\n"
            self.send_response(404)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        do_GET = do_POST = _page

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotGpumesh)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/"
    try:
        r = run_cli(["join", url, "--token=some-token-0123456789"], cli_env, timeout=30)
    finally:
        server.shutdown()
        server.server_close()
    line = assert_one_line_error(r, "HTTP 404", "nginx/1.22.1", "path prefix")
    assert "<" not in line
