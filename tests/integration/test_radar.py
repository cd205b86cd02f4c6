"""LAN discovery across two network namespaces joined by a bridge.

The test creates three namespaces of its own: gmA (the coordinator, 10.214.8.1), gmB
(radar and a worker, 10.214.8.2) and gmBr, which holds only the bridge joining their veth
peers. Nothing touches the root namespace's interfaces, so no multicast leaves this
machine. Only the processes started inside gmA/gmB have GPUMESH_DISCOVERY unset (the
session fixture sets it to 0 for everything else). Needs root and iproute2.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest

from ..conftest import TOKEN, default_signals
from ..netns import netns_unavailable

A_IP, B_IP = "10.214.8.1", "10.214.8.2"


def _run(*cmd: str, ns: str | None = None) -> None:
    full = list(cmd) if ns is None else ["ip", "netns", "exec", ns, *cmd]
    subprocess.run(full, check=True, capture_output=True, timeout=10)


@pytest.fixture
def bridged():
    """(nsA, nsB): two namespaces on one bridge, which lives in a third."""
    reason = netns_unavailable(f"gmrp{os.getpid() % 100000}")
    if reason:
        pytest.skip(reason)
    tag = os.getpid() % 100000
    a, b, br = f"gmA{tag}", f"gmB{tag}", f"gmBr{tag}"
    made: list[str] = []
    try:
        for ns in (a, b, br):
            _run("ip", "netns", "add", ns)
            made.append(ns)
        _run("ip", "link", "add", "br0", "type", "bridge", ns=br)
        _run("ip", "link", "set", "br0", "type", "bridge", "mcast_snooping", "0", ns=br)
        _run("ip", "link", "set", "br0", "up", ns=br)
        for ns, addr, port in ((a, A_IP, "pa"), (b, B_IP, "pb")):
            # created inside ns, its peer moved straight into the bridge's namespace
            _run("ip", "link", "add", "veth0", "type", "veth", "peer", "name", port, "netns", br, ns=ns)
            _run("ip", "link", "set", port, "master", "br0", ns=br)
            _run("ip", "link", "set", port, "up", ns=br)
            _run("ip", "addr", "add", f"{addr}/24", "dev", "veth0", ns=ns)
            _run("ip", "link", "set", "veth0", "up", ns=ns)
            _run("ip", "link", "set", "lo", "up", ns=ns)
            _run("ip", "route", "add", "224.0.0.0/4", "dev", "veth0", ns=ns)
        yield a, b
    finally:
        for ns in reversed(made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


class NsProc:
    def __init__(self, ns: str, args: list[str], env: dict, log):
        self.log = log
        self.fh = open(log, "wb")
        self.p = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "gpumesh", *args],
                                  env=env, stdout=self.fh, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, start_new_session=True,
                                  preexec_fn=default_signals)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        self.fh.close()


def _env(tmp_path, name: str, discovery: bool) -> dict:
    home = tmp_path / name
    home.mkdir(exist_ok=True)
    env = dict(os.environ, HOME=str(home), GPUMESH_TOKEN=TOKEN,
               GPUMESH_CONFIG=str(home / "config.json"))
    env.pop("GPUMESH_URL", None)
    if discovery:
        env.pop("GPUMESH_DISCOVERY", None)  # only ever inside the test's own namespaces
    return env


def _in_ns(ns: str, args: list[str], env: dict, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-m", "gpumesh", *args],
                          env=env, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def _get(ns: str, url: str) -> dict | list:
    """GET a coordinator endpoint from inside ``ns`` (the root namespace cannot reach it)."""
    code = ("import httpx,json,sys; r=httpx.get(sys.argv[1], headers={'authorization': "
            "'Bearer ' + sys.argv[2]}, timeout=3); print(r.text)")
    out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", code, url, TOKEN],
                         capture_output=True, text=True, timeout=15)
    return json.loads(out.stdout)


def _wait_health(ns: str, url: str, proc: NsProc, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.p.poll() is None, proc.output()
        try:
            if _get(ns, f"{url}/v1/health").get("ok"):
                return
        except (ValueError, subprocess.SubprocessError):
            pass
        time.sleep(0.2)
    raise AssertionError("coordinator did not start:\n" + proc.output())


def test_radar_and_join_find_a_lan_coordinator_across_namespaces(bridged, tmp_path):
    ns_a, ns_b = bridged
    port, local_port = 18000, 18001
    url = f"http://{A_IP}:{port}"
    procs: list[NsProc] = []
    try:
        lan = NsProc(ns_a, ["serve", "--host", A_IP, "--port", str(port), "--no-self-worker",
                            "--data-dir", str(tmp_path / "data-lan")],
                     _env(tmp_path, "a", discovery=True), tmp_path / "lan.log")
        procs.append(lan)
        loop = NsProc(ns_a, ["serve", "--host", "127.0.0.1", "--port", str(local_port),
                             "--no-self-worker", "--data-dir", str(tmp_path / "data-loop")],
                      _env(tmp_path, "a2", discovery=True), tmp_path / "loop.log")
        procs.append(loop)
        _wait_health(ns_a, url, lan)
        _wait_health(ns_a, f"http://127.0.0.1:{local_port}", loop)
        assert "Announced on the LAN" in lan.output()
        assert "Announced on the LAN" not in loop.output()

        r = _in_ns(ns_b, ["radar", "--once", "--json", "--timeout", "5"],
                   _env(tmp_path, "b", discovery=True))
        assert r.returncode == 0, r.stderr
        assert TOKEN not in r.stdout + r.stderr
        found = json.loads(r.stdout)
        coords = [e for e in found if e["role"] == "coordinator"]
        assert len(coords) == 1, found  # the loopback-bound one is not advertised
        c = coords[0]
        assert c["addresses"] == [A_IP] and c["port"] == port and c["url"] == url, c
        assert set(c["properties"]) <= {"role", "version", "device", "device_name", "score",
                                        "hostname", "coordinator", "scheme"}
        assert c["version"] and c["device"] in ("CPU", "GPU") and c["host"]
        assert str(local_port) not in r.stdout

        # the table form works too
        t = _in_ns(ns_b, ["radar", "--once", "--timeout", "3"], _env(tmp_path, "b", discovery=True))
        assert t.returncode == 0 and "coordinator" in t.stdout and A_IP in t.stdout, t.stdout + t.stderr

        # join with no URL finds the one coordinator and joins it
        worker = NsProc(ns_b, ["join"], _env(tmp_path, "b", discovery=True), tmp_path / "worker.log")
        procs.append(worker)
        deadline = time.monotonic() + 25
        alive = []
        while time.monotonic() < deadline and not alive:
            assert worker.p.poll() is None, worker.output()
            alive = [w for w in _get(ns_a, f"{url}/v1/workers") if w["alive"]]
            time.sleep(0.3)
        assert alive, worker.output()
        assert f"found coordinator {url}" in worker.output()

        # the worker announces itself too (its coordinator is not on loopback)
        deadline = time.monotonic() + 10
        workers = []
        while time.monotonic() < deadline and not workers:
            r = _in_ns(ns_a, ["radar", "--json", "--timeout", "3"], _env(tmp_path, "a", discovery=True))
            workers = [e for e in json.loads(r.stdout) if e["role"] == "worker"]
        assert workers and workers[0]["coordinator"] == url and workers[0]["addresses"] == [B_IP], workers
        assert TOKEN not in r.stdout
    finally:
        for p in reversed(procs):
            p.stop()


def test_discovery_off_opens_no_socket_and_says_so(tmp_path):
    """GPUMESH_DISCOVERY=0 (as the whole suite runs): radar and join-without-URL refuse in one
    line; nothing is browsed (this runs in the root namespace, so it must not)."""
    env = dict(os.environ, GPUMESH_DISCOVERY="0", HOME=str(tmp_path))
    for args in (["radar", "--once"], ["join"]):
        r = subprocess.run([sys.executable, "-m", "gpumesh", *args], env=env, capture_output=True,
                           text=True, timeout=30, stdin=subprocess.DEVNULL)
        assert r.returncode == 1
        assert r.stderr.strip().count("\n") == 0 and "GPUMESH_DISCOVERY=0" in r.stderr, r.stderr


def test_piped_radar_runs_until_ctrl_c_and_prints_a_line_per_service(bridged, tmp_path):
    """Like avahi-browse or dns-sd -B: with stdout a pipe, radar keeps browsing and writes
    one tab-separated line as each service appears (+) or goes away (-)."""
    ns_a, ns_b = bridged
    port = 18010
    url = f"http://{A_IP}:{port}"
    procs: list[NsProc] = []
    radar = subprocess.Popen(["ip", "netns", "exec", ns_b, sys.executable, "-m", "gpumesh", "radar"],
                             env=_env(tmp_path, "r", discovery=True), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                             start_new_session=True, preexec_fn=default_signals)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(ln.rstrip("\n")) for ln in radar.stdout],
                     daemon=True).start()

    def next_line(timeout: float) -> str:
        try:
            return lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no line from radar within {timeout}s; "
                                 f"running={radar.poll() is None}") from None

    try:
        lan = NsProc(ns_a, ["serve", "--host", A_IP, "--port", str(port), "--no-self-worker",
                            "--data-dir", str(tmp_path / "data")],
                     _env(tmp_path, "a", discovery=True), tmp_path / "lan.log")
        procs.append(lan)
        _wait_health(ns_a, url, lan)
        started = time.monotonic()
        first = next_line(20).split("\t")
        assert first[:2] == ["+", "coordinator"] and first[3] == url, first
        assert len(first) == 7 and first[2] and first[4].split()[0] in ("CPU", "GPU"), first
        # a snapshot would have ended by now (it listens 3 s): this one keeps browsing
        time.sleep(max(0.0, 4.0 - (time.monotonic() - started)))
        assert radar.poll() is None, "piped radar exited by itself"

        worker = NsProc(ns_b, ["join", url], _env(tmp_path, "b", discovery=True),
                        tmp_path / "worker.log")
        procs.append(worker)
        joined = next_line(25).split("\t")
        assert joined[:2] == ["+", "worker"] and joined[3] == f"{B_IP} -> {url}", joined
        worker.stop()  # leaves cleanly: its goodbye packet withdraws the service
        gone = next_line(15).split("\t")
        assert gone[:2] == ["-", "worker"] and gone[3] == f"{B_IP} -> {url}", gone

        # `gpumesh radar | head -1`: once the reader has its line and exits, radar ends
        head = subprocess.Popen(["ip", "netns", "exec", ns_b, sys.executable, "-m", "gpumesh",
                                 "radar"], env=_env(tmp_path, "h", discovery=True),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            assert head.stdout.readline().startswith("+\tcoordinator\t")
            head.stdout.close()
            assert head.wait(10) == 0
            assert "Traceback" not in head.stderr.read()
        finally:
            if head.poll() is None:
                os.killpg(head.pid, signal.SIGKILL)
                head.wait()

        os.killpg(radar.pid, signal.SIGINT)  # Ctrl+C: ends quietly
        assert radar.wait(10) == 0
        err = radar.stderr.read()
        assert "Traceback" not in err and "Ctrl+C to stop" in err, err
        assert TOKEN not in err
        assert lines.empty()
    finally:
        if radar.poll() is None:
            os.killpg(radar.pid, signal.SIGKILL)
            radar.wait()
        for p in reversed(procs):
            p.stop()


def test_radar_without_a_network_interface_says_so_in_one_line(tmp_path):
    """A fresh namespace, no interface up: nothing to listen on, so one line and exit 1
    (not zeroconf's traceback), piped or not."""
    ns = f"gmLo{os.getpid() % 100000}"
    reason = netns_unavailable(ns)
    if reason:
        pytest.skip(reason)
    _run("ip", "netns", "add", ns)
    try:
        for args in (["radar", "--once"], ["radar"]):
            r = _in_ns(ns, args, _env(tmp_path, "lo", discovery=True))
            assert r.returncode == 1, (r.stdout, r.stderr)
            assert "Traceback" not in r.stderr and r.stderr.strip().count("\n") == 0, r.stderr
            assert "cannot listen for mDNS on this network" in r.stderr, r.stderr
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


ADVERTISE_THEN_UPDATE = """
import sys, time
from gpumesh import discovery
ad = discovery.advertise("worker", [sys.argv[1]], 18020, hostname="box-b", score="pending",
                         coordinator="http://10.214.8.1:18000")
ad.update(score="12.5")  # at once: while the name is still being probed
print("advertised", flush=True)
time.sleep(30)
"""


def test_a_score_update_during_registration_is_one_service(bridged, tmp_path):
    """A worker whose score arrives while its mDNS name is still being probed stays one
    service (with the new score), not two (the old record renamed "... -2")."""
    ns_a, ns_b = bridged
    env = _env(tmp_path, "b", discovery=True)
    ad = subprocess.Popen(["ip", "netns", "exec", ns_b, sys.executable, "-c", ADVERTISE_THEN_UPDATE,
                           B_IP], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        assert ad.stdout.readline().strip() == "advertised", ad.stderr.read()
        time.sleep(3)  # probing and announcing are over
        r = _in_ns(ns_a, ["radar", "--json", "--timeout", "4"], _env(tmp_path, "a", discovery=True))
        workers = [e for e in json.loads(r.stdout) if e["role"] == "worker"]
        assert [(w["host"], w["score"]) for w in workers] == [("box-b", "12.5")], workers
    finally:
        ad.kill()
        ad.wait()
