"""One mesh per backend for the conformance suite: the native mesh (a coordinator and two
one-slot workers), a Dask ``LocalCluster`` (two one-thread worker processes) and a local
Ray instance (``ray start --head --block``, two CPUs, reached through Ray Client at
``ray://127.0.0.1:PORT``). The same tests run against each through ``GPUMesh(url)``.

The Dask and Ray variants are marked ``dask`` / ``ray`` and skipped, with the reason,
when the engine is not installed (``pip install -e '.[dask,ray]'``, or ``make test-engines``).
The native variant is marked ``native``, so a run that has just tested it (CI's
``make test-engines NATIVE=0`` after ``make test``) can leave it out with ``-m "not native"``.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import Mesh, free_port

BACKENDS = [
    pytest.param("native", marks=pytest.mark.native),
    pytest.param("dask", marks=[pytest.mark.dask, pytest.mark.skipif(
        importlib.util.find_spec("distributed") is None,
        reason="dask.distributed is not installed (pip install -e '.[dask]')")]),
    pytest.param("ray", marks=[pytest.mark.ray, pytest.mark.skipif(
        importlib.util.find_spec("ray") is None,
        reason="ray is not installed (pip install -e '.[ray]')")]),
]


def _start_ray(root) -> tuple[subprocess.Popen, str]:
    ray_bin = shutil.which("ray", path=os.path.dirname(sys.executable)) or "ray"
    gcs, client = free_port(), free_port()
    log = open(root / "ray.log", "wb")
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled")
    p = subprocess.Popen([ray_bin, "start", "--head", "--block", "--port", str(gcs),
                          "--ray-client-server-port", str(client), "--num-cpus", "2", "--num-gpus", "0",
                          "--include-dashboard", "false", "--disable-usage-stats",
                          "--node-ip-address", "127.0.0.1"],
                         stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                         env=env, start_new_session=True)
    from gpumesh.client.backends.base import tcp_reachable
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if p.poll() is not None:
            raise RuntimeError("ray start exited:\n" + (root / "ray.log").read_text(errors="replace"))
        if tcp_reachable("127.0.0.1", client, 0.5):
            return p, f"ray://127.0.0.1:{client}"
        time.sleep(0.2)
    raise RuntimeError("ray did not start:\n" + (root / "ray.log").read_text(errors="replace"))


def _stop_group(p: subprocess.Popen) -> None:
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    try:  # raylet and GCS share the group of `ray start`
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request, tmp_path_factory):
    """``(name, GPUMesh)`` for each backend, shared by the tests of a module."""
    from gpumesh import GPUMesh
    name = request.param
    root = tmp_path_factory.mktemp(name)
    if name == "native":
        m = Mesh(root)
        m.start()
        m.add_worker()
        m.add_worker()
        client = m.client()
        yield name, client
        client.close()
        m.stop()
    elif name == "dask":
        from distributed import LocalCluster
        cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                               dashboard_address=None, host="127.0.0.1")
        client = GPUMesh(cluster.scheduler_address.replace("tcp://", "dask://"))
        yield name, client
        client.close()
        cluster.close()
    else:
        os.environ["RAY_AUTH_MODE"] = "disabled"  # a throwaway loopback instance, for this process too
        proc, url = _start_ray(root)
        client = GPUMesh(url)
        try:
            yield name, client
        finally:
            import ray
            ray.shutdown()
            _stop_group(proc)
