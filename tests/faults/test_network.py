"""A worker behind a network link that goes down for 30 s and comes back.

The worker runs in its own Linux network namespace joined to this one by a veth pair
(addresses 10.213.7.1 here, 10.213.7.2 there: private to the pair, nothing else is ever
contacted). Needs root and iproute2; skipped with the reason otherwise.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from ..conftest import Mesh, free_port
from ..netns import netns_unavailable
from ..conftest import wait_for
from .conftest import TEST_TTL_S

HOST_IP, NS_IP = "10.213.7.1", "10.213.7.2"
DOWN_S = 30


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", *args] if ns is None else ["ip", "netns", "exec", ns, "ip", *args]
    subprocess.run(cmd, check=True, capture_output=True, timeout=10)


@pytest.fixture
def netns():
    reason = netns_unavailable(f"gmprobe{os.getpid()}")
    if reason:
        pytest.skip(reason)
    ns = f"gmt{os.getpid() % 100000}"
    vh, vn = f"gmh{os.getpid() % 100000}", f"gmn{os.getpid() % 100000}"
    try:
        _ip("netns", "add", ns)
        _ip("link", "add", vh, "type", "veth", "peer", "name", vn)
        _ip("link", "set", vn, "netns", ns)
        _ip("addr", "add", f"{HOST_IP}/30", "dev", vh)
        _ip("link", "set", vh, "up")
        _ip("addr", "add", f"{NS_IP}/30", "dev", vn, ns=ns)
        _ip("link", "set", vn, "up", ns=ns)
        _ip("link", "set", "lo", "up", ns=ns)
        yield ns, vh
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", vh], capture_output=True)


def test_worker_reconnects_within_5s_after_a_30s_link_drop(netns, tmp_path):
    ns, vh = netns
    m = Mesh(tmp_path / "mesh")
    m.env["GPUMESH_WORKER_TTL"] = str(TEST_TTL_S)
    m.port = free_port()
    m.url = f"http://{HOST_IP}:{m.port}"
    m.start(extra=["--host", HOST_IP])
    log = open(tmp_path / "ns-worker.log", "wb")
    worker = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "gpumesh", "join",
                               m.url], env=m.env, stdout=log, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for(lambda: m.alive() == 1, 30, lambda: (tmp_path / "ns-worker.log").read_text())
        wid = m.workers()[0]["id"]
        _ip("link", "set", vh, "down")
        try:
            wait_for(lambda: m.alive() == 0, TEST_TTL_S + 3, "the silent worker to be declared dead")
            time.sleep(DOWN_S - TEST_TTL_S)
        finally:
            _ip("link", "set", vh, "up")
        up_at = time.monotonic()
        wait_for(lambda: m.alive() == 1, 10, "the worker to come back")
        took = time.monotonic() - up_at
        assert took < 5, f"worker reconnected {took:.1f}s after the link returned"
        assert m.workers()[0]["id"] == wid, "the worker should come back under the same id"
        from gpumesh import accelerate
        assert accelerate(m.client(output=False))(lambda: "through the veth")() == "through the veth"
    finally:
        worker.terminate()
        try:
            worker.wait(10)
        except subprocess.TimeoutExpired:
            worker.kill()
        log.close()
        m.stop()
