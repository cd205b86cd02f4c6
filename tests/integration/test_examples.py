"""The examples in examples/ run as a user runs them, against a real mesh, and print the
right values: torch_sweep.py, pandas_shards.py, primes_job.py (a script job through
``gpumesh submit``) and second_machine.py (its join line really joins a second machine,
played by a network namespace)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ..conftest import TOKEN, free_port, wait_for
from ..netns import netns_unavailable

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
RUN_TIMEOUT_S = 240


def run_example(name: str, env_extra: dict, tmp_path: Path, args: list[str] = (),
                stdin: str | None = None) -> subprocess.CompletedProcess:
    """``python examples/NAME`` in a clean environment (own HOME, no GPUMESH_* but env_extra)."""
    home = tmp_path / f"home-{len(list(tmp_path.glob('home-*')))}"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUMESH_")}
    env.update(HOME=str(home), GPUMESH_CONFIG=str(home / "config.json"), GPUMESH_DISCOVERY="0",
               PYTHONUNBUFFERED="1")
    env.update(env_extra)
    return subprocess.run([sys.executable, str(EXAMPLES / name), *args], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S, input=stdin,
                          stdin=None if stdin is not None else subprocess.DEVNULL)


def on_mesh(mesh) -> dict:
    return {"GPUMESH_URL": mesh.url, "GPUMESH_TOKEN": mesh.token}


def ran_on_the_mesh(r: subprocess.CompletedProcess) -> None:
    report = f"exit {r.returncode}\n--- stdout\n{r.stdout}\n--- stderr\n{r.stderr}"
    assert r.returncode == 0, report
    assert "connected to coordinator" in r.stderr, report
    assert "running locally" not in r.stderr, report


# --- torch_sweep.py ------------------------------------------------------------------

def test_torch_sweep_trains_on_the_mesh_and_matches_a_local_run(make_mesh, tmp_path):
    pytest.importorskip("torch", reason="examples/torch_sweep.py needs PyTorch: pip install torch")
    # a mesh of its own: its warm processes (torch loaded) end with this test
    remote = run_example("torch_sweep.py", on_mesh(make_mesh(workers=2)), tmp_path)
    ran_on_the_mesh(remote)
    local = run_example("torch_sweep.py", {"GPUMESH_LOCAL": "1"}, tmp_path)
    assert local.returncode == 0, local.stderr
    # seeded, single-threaded CPU training: the same numbers wherever it ran
    assert remote.stdout == local.stdout
    rows = [line.split() for line in remote.stdout.splitlines() if re.match(r"\s+\d+\s", line)]
    assert [int(r[0]) for r in rows] == [1, 2, 3, 4, 5, 6]
    assert sorted((float(r[1]), int(r[2])) for r in rows) == [
        (lr, h) for lr in (0.003, 0.01, 0.03) for h in (8, 32)]
    accuracies = [float(r[3]) for r in rows]
    assert accuracies == sorted(accuracies, reverse=True)
    best = json.loads(remote.stdout.split("best: ", 1)[1])
    assert best["val_accuracy"] == accuracies[0] >= 0.95   # the spirals are learnable
    assert accuracies[-1] < 0.9                            # and the sweep tells configs apart
    assert re.search(r"6 tasks on (cpu|cuda)", remote.stderr), remote.stderr


def test_torch_sweep_without_torch_says_what_to_install(tmp_path):
    # a directory on the path whose torch package fails to import, as a missing one does
    fake = tmp_path / "no-torch" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('No module named torch')\n")
    r = run_example("torch_sweep.py", {"PYTHONPATH": str(fake.parent), "GPUMESH_LOCAL": "1"},
                    tmp_path)
    assert r.returncode == 1
    assert r.stdout == ""
    assert "pip install torch" in r.stderr and "every worker" in r.stderr


# --- pandas_shards.py ----------------------------------------------------------------

def test_pandas_shards_merges_to_the_one_piece_totals(shared_mesh, tmp_path):
    pytest.importorskip("pandas")
    remote = run_example("pandas_shards.py", on_mesh(shared_mesh), tmp_path, ["--shards", "6"])
    ran_on_the_mesh(remote)
    local = run_example("pandas_shards.py", {"GPUMESH_LOCAL": "1"}, tmp_path, ["--shards", "6"])
    assert local.returncode == 0, local.stderr
    assert remote.stdout == local.stdout
    assert remote.stdout.startswith("200,000 sales rows in 6 shards\n")
    assert "check: the sharded result equals the one-piece aggregation" in remote.stdout

    # The same figures, computed here without the example's code: the generator is the
    # only thing shared (it is the data).
    sys.path.insert(0, str(EXAMPLES))
    try:
        from pandas_shards import make_sales
    finally:
        sys.path.remove(str(EXAMPLES))
    sales = make_sales()
    cents = int((sales["qty"] * sales["price_cents"]).sum())
    units = int(sales["qty"].sum())
    assert f"total revenue: {cents // 100:,}.{cents % 100:02d} over {units:,} units" in remote.stdout
    # the table: header, index header, then 4 regions x 3 products (region shown once)
    table = remote.stdout.splitlines()[3:15]
    found, region = {}, None
    for row in table:
        cells = row.split()
        if len(cells) == 6:  # region, product, rows, units, revenue, mean_price
            region = cells.pop(0)
        found[(region, cells[0])] = (int(cells[1]), int(cells[2]))
    expected = sales.groupby(["region", "product"])["qty"].agg(["size", "sum"])
    assert found == {key: (int(n), int(q)) for key, (n, q) in expected.iterrows()}


# --- primes_job.py (gpumesh submit) --------------------------------------------------

def _prime_count(start: int, stop: int) -> int:
    """Trial division, independent of the example's sieve."""
    def is_prime(n: int) -> bool:
        if n < 2:
            return False
        i = 2
        while i * i <= n:
            if n % i == 0:
                return False
            i += 1
        return True
    return sum(1 for n in range(start, stop) if is_prime(n))


def test_primes_script_job_through_gpumesh_submit(shared_mesh, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUMESH_")}
    env.update(HOME=str(tmp_path), GPUMESH_CONFIG=str(tmp_path / "config.json"),
               GPUMESH_DISCOVERY="0", **on_mesh(shared_mesh))
    r = subprocess.run([sys.executable, "-m", "gpumesh", "submit", str(EXAMPLES / "primes_job.py"),
                        "--payloads", str(EXAMPLES / "primes_payloads.json"), "--wait", "--json"],
                       env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stdout + r.stderr
    job = json.loads(r.stdout)
    assert job["n_tasks"] == 4 and job["counts"] == {"done": 4}
    payloads = json.loads((EXAMPLES / "primes_payloads.json").read_text())
    results = sorted((t["result"] for t in job["tasks"]), key=lambda res: res["start"])
    assert [(res["start"], res["stop"]) for res in results] == [(p["start"], p["stop"]) for p in payloads]
    assert [res["primes"] for res in results] == [_prime_count(p["start"], p["stop"]) for p in payloads]
    assert sum(res["primes"] for res in results) == 9592      # pi(100000)
    assert results[-1]["largest"] == 99991
    assert results[0]["largest"] == 24989


def test_primes_job_docstrings_python_snippet_prints_pi_of_100000(shared_mesh, tmp_path):
    doc = (EXAMPLES / "primes_job.py").read_text().split('"""')[1]
    snippet = textwrap.dedent(doc.split("The same from Python::", 1)[1].split("\n\n")[1])
    assert "m.submit(" in snippet and "m.wait(" in snippet
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUMESH_")}
    env.update(HOME=str(tmp_path), GPUMESH_CONFIG=str(tmp_path / "config.json"),
               GPUMESH_DISCOVERY="0", **on_mesh(shared_mesh))
    r = subprocess.run([sys.executable, "-c", "import json\n" + snippet], env=env,
                       cwd=EXAMPLES.parent, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "9592"


def test_primes_job_rejects_a_bad_payload_and_runs_one_by_hand(tmp_path):
    ok = run_example("primes_job.py", {}, tmp_path, stdin='{"start": 0, "stop": 100, "cost": 3}')
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout.splitlines()[-1]) == {"start": 0, "stop": 100, "primes": 25,
                                                      "largest": 97}
    bad = run_example("primes_job.py", {}, tmp_path, stdin='{"start": 10, "stop": 5}')
    assert bad.returncode == 2
    assert "need 0 <= start <= stop" in bad.stderr and bad.stdout == ""


# --- second_machine.py ---------------------------------------------------------------

def test_second_machine_on_a_loopback_coordinator_says_how_to_open_it(make_mesh, tmp_path):
    m = make_mesh(workers=1)
    # from the config `gpumesh serve` saved, as on the coordinator's machine
    r = run_example("second_machine.py", {"GPUMESH_CONFIG": str(m.root / "config.json")}, tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"Coordinator: {m.url} (1 worker(s) known)" in r.stdout
    assert "bound to loopback only" in r.stdout
    assert f"  export GPUMESH_TOKEN={TOKEN}\n  gpumesh serve --host 0.0.0.0 --port {m.port}\n" in r.stdout
    assert "gpumesh join" not in r.stdout


def test_second_machine_with_the_mesh_down_is_a_clear_error(tmp_path):
    r = run_example("second_machine.py", {"GPUMESH_URL": f"http://127.0.0.1:{free_port()}",
                                          "GPUMESH_TOKEN": TOKEN}, tmp_path)
    assert r.returncode == 1 and r.stdout == ""
    assert "cannot read the mesh at http://127.0.0.1:" in r.stderr
    assert "gpumesh serve" in r.stderr


A_IP, B_IP = "10.215.9.1", "10.215.9.2"


def _ip(*cmd: str, ns: str | None = None) -> None:
    full = ["ip", *cmd] if ns is None else ["ip", "netns", "exec", ns, "ip", *cmd]
    subprocess.run(full, check=True, capture_output=True, timeout=10)


@pytest.fixture
def two_machines():
    """(nsA, nsB): two network namespaces joined by one veth pair, A_IP and B_IP."""
    tag = os.getpid() % 100000
    reason = netns_unavailable(f"gmsp{tag}")
    if reason:
        pytest.skip(reason)
    a, b = f"gmSA{tag}", f"gmSB{tag}"
    made: list[str] = []
    try:
        for ns in (a, b):
            _ip("netns", "add", ns)
            made.append(ns)
        _ip("link", "add", "veth0", "type", "veth", "peer", "name", "veth1", "netns", b, ns=a)
        for ns, dev, addr in ((a, "veth0", A_IP), (b, "veth1", B_IP)):
            _ip("addr", "add", f"{addr}/24", "dev", dev, ns=ns)
            _ip("link", "set", dev, "up", ns=ns)
            _ip("link", "set", "lo", "up", ns=ns)
        yield a, b
    finally:
        for ns in reversed(made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.mark.parametrize("tls", [False, True], ids=["http", "tls"])
def test_second_machine_prints_a_join_line_that_joins(two_machines, tmp_path, tls):
    ns_a, ns_b = two_machines
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUMESH_")}
    env.update(HOME=str(tmp_path), GPUMESH_CONFIG=str(tmp_path / "a-config.json"),
               GPUMESH_TOKEN=TOKEN, GPUMESH_DISCOVERY="0")
    ns_exec = ["ip", "netns", "exec"]
    coordinator = subprocess.Popen(
        [*ns_exec, ns_a, sys.executable, "-m", "gpumesh", "serve", "--host", "0.0.0.0",
         "--port", str(port), "--data-dir", str(tmp_path / "data"), "--no-advertise",
         *(["--tls"] if tls else [])],
        env=env, stdout=open(tmp_path / "serve.log", "wb"), stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL, start_new_session=True)
    worker = None
    try:
        wait_for(lambda: "joined mesh as" in (tmp_path / "serve.log").read_text(), 60,
                 "the coordinator and its self-worker")
        env_a = {k: v for k, v in env.items() if k != "GPUMESH_TOKEN"}  # the saved config only
        r = subprocess.run([*ns_exec, ns_a, sys.executable, str(EXAMPLES / "second_machine.py")],
                           env=env_a, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        assert r.returncode == 0, r.stdout + r.stderr
        scheme = "https" if tls else "http"
        assert f"Coordinator: {scheme}://127.0.0.1:{port} (1 worker(s) known)" in r.stdout
        joins = [line.strip() for line in r.stdout.splitlines() if line.strip().startswith("gpumesh join")]
        pin = ""
        if tls:
            pin = re.search(r"TLS certificate fingerprint: (SHA256:\S+)",
                            (tmp_path / "serve.log").read_text()).group(1)
            pin = f" --fingerprint={pin}"
        assert joins == [f"gpumesh join {scheme}://{A_IP}:{port}{pin} --token={TOKEN}"], r.stdout
        assert f"allow TCP port {port}" in r.stdout

        # Machine B: a fresh home, nothing but the printed line.
        argv = shlex.split(joins[0])[1:]
        env_b = {k: v for k, v in env.items() if k != "GPUMESH_TOKEN"}
        env_b.update(HOME=str(tmp_path / "b"), GPUMESH_CONFIG=str(tmp_path / "b" / "config.json"))
        worker = subprocess.Popen([*ns_exec, ns_b, sys.executable, "-m", "gpumesh", *argv],
                                  env=env_b, stdout=open(tmp_path / "b.log", "wb"),
                                  stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  start_new_session=True)
        wait_for(lambda: "joined mesh as" in (tmp_path / "b.log").read_text(), 60, "B to join")
        log = (tmp_path / "serve.log").read_text()
        assert log.count("worker joined:") == 2, log   # the self-worker and machine B
    finally:
        for p in (worker, coordinator):
            if p is not None and p.poll() is None:
                p.send_signal(2)
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, 9)
                    p.wait()
