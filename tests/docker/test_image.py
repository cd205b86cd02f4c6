"""The Dockerfile and docker-compose.yaml, built and run for real with podman (no Docker Hub
here): a Debian base image made from Debian packages (debootstrap + ``podman import``) with
Python, the image built on it (``--build-arg PYTHON_IMAGE=...``), a coordinator and a worker
in one pod, then the compose file with two workers and a coordinator restart.

Opt-in: ``make test-docker`` (``GPUMESH_TEST_DOCKER=1``; needs root, podman, podman-compose,
debootstrap, runc). Every port is published on 127.0.0.1 only; containers and the pod are
named per run and removed at the end, as is the compose project's volume. The base image is
kept (``localhost/gpumesh-debian-base:bookworm``) so later runs skip debootstrap.

What this machine needs of podman, and why: ``runtime = "runc"`` and ``cgroup_manager =
"cgroupfs"`` (no systemd here), ``default_ulimits`` (podman may not raise limits here, and a
pod's infra container needs them too), ``podman build --network=host --format docker``
(``--format docker`` keeps the HEALTHCHECK, which OCI images drop) with the host's CA bundle
mounted read-only into the build so pip trusts what the host trusts; the image keeps none
of it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import cloudpickle
import httpx
import pytest

from ..conftest import TOKEN, free_port, wait_for

cloudpickle.register_pickle_by_value(sys.modules[__name__])

ROOT = Path(__file__).resolve().parents[2]
BASE = "localhost/gpumesh-debian-base:bookworm"
IMAGE = "localhost/gpumesh:test"
CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
MIRROR = os.environ.get("GPUMESH_DEBIAN_MIRROR", "http://deb.debian.org/debian")
CONTAINERS_CONF = """\
[containers]
default_ulimits = ["nofile=4096:4096", "nproc=4096:4096"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
"""

pytestmark = [
    pytest.mark.skipif(os.environ.get("GPUMESH_TEST_DOCKER") != "1",
                       reason="container tests run with make test-docker"),
    pytest.mark.timeout(1800),
]


def square(x):
    return x * x


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    for tool in ("podman", "podman-compose", "debootstrap"):
        if shutil.which(tool) is None and not os.path.exists(f"/usr/sbin/{tool}"):
            pytest.fail(f"{tool} is not installed (make test-docker installs it)")
    conf = tmp_path_factory.mktemp("podman") / "containers.conf"
    conf.write_text(CONTAINERS_CONF)
    return dict(os.environ, CONTAINERS_CONF=str(conf))


def podman(env, *args, check=True, timeout=900, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(["podman", *args], env=env, capture_output=True, text=True, timeout=timeout, **kw)
    if check and r.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} -> {r.returncode}\n{r.stdout}\n{r.stderr}")
    return r


@pytest.fixture(scope="module")
def image(env, tmp_path_factory):
    if podman(env, "image", "exists", BASE, check=False).returncode != 0:
        rootfs = tmp_path_factory.mktemp("rootfs")
        subprocess.run(["debootstrap", "--variant=minbase",
                        "--include=python3,python3-venv,ca-certificates", "bookworm", str(rootfs),
                        MIRROR], check=True, capture_output=True, timeout=1200)
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        podman(env, "import", "--change", "CMD=/bin/bash", "-", BASE, stdin=tar.stdout)
        assert tar.wait() == 0
        shutil.rmtree(rootfs, ignore_errors=True)
    build = ["build", "--network=host", "--format", "docker", "--build-arg", f"PYTHON_IMAGE={BASE}",
             "-t", IMAGE]
    if os.path.exists(CA_BUNDLE):  # pip in the build trusts what this host trusts
        build += ["-v", f"{CA_BUNDLE}:{CA_BUNDLE}:ro", "--build-arg", f"PIP_CERT={CA_BUNDLE}"]
    podman(env, *build, str(ROOT), timeout=1500)
    return IMAGE


def healthy(env, container: str) -> bool:
    return podman(env, "healthcheck", "run", container, check=False, timeout=60).returncode == 0


def client(port: int):
    from gpumesh import GPUMesh
    return GPUMesh(f"http://127.0.0.1:{port}", token=TOKEN, output=False)


def alive(port: int) -> list[dict]:
    try:
        r = httpx.get(f"http://127.0.0.1:{port}/v1/workers",
                      headers={"authorization": f"Bearer {TOKEN}"}, timeout=5)
    except httpx.HTTPError:
        return []
    return [w for w in r.json() if w["alive"]] if r.status_code == 200 else []


def test_the_image_is_what_the_readme_says(env, image):
    info = json.loads(podman(env, "image", "inspect", image).stdout)[0]
    cfg = info["Config"]
    assert cfg["User"] == "gpumesh"
    assert cfg["Entrypoint"] == ["gpumesh"]
    assert "8732/tcp" in cfg["ExposedPorts"]
    assert "HOME=/data" in cfg["Env"] and "GPUMESH_HOST=0.0.0.0" in cfg["Env"]
    check = cfg.get("Healthcheck") or info["Healthcheck"]  # where docker / podman put it
    assert check["Test"] == ["CMD", "/opt/gpumesh/bin/python", "/usr/local/bin/gpumesh-healthcheck"]
    assert not any("CERT" in e for e in cfg["Env"])  # the build's CA bundle stayed out
    r = podman(env, "run", "--rm", "--network=none", image, "--version")
    assert r.stdout.startswith("gpumesh 0.1.0 (3.11")
    r = podman(env, "run", "--rm", "--network=none", "--entrypoint", "id", image)
    assert r.stdout.startswith("uid=10001(gpumesh)")


def test_a_coordinator_and_a_worker_in_one_pod_run_a_map_from_the_host(env, image):
    name = f"gmtest-{uuid.uuid4().hex[:8]}"
    port = free_port()
    podman(env, "pod", "create", "--name", name, "-p", f"127.0.0.1:{port}:8732")
    try:
        run_env = dict(env, GPUMESH_TOKEN=TOKEN)
        podman(run_env, "run", "-d", "--pod", name, "--name", f"{name}-coordinator", "-e", "GPUMESH_TOKEN",
               image, "serve", "--host", "0.0.0.0", "--port", "8732", "--no-self-worker")
        wait_for(lambda: healthy(env, f"{name}-coordinator"), 90, "the coordinator's healthcheck")
        podman(run_env, "run", "-d", "--pod", name, "--name", f"{name}-worker", "-e", "GPUMESH_TOKEN",
               image, "join", "http://127.0.0.1:8732")
        workers = wait_for(lambda: alive(port), 120, "the container worker")
        assert workers[0]["hostname"] != os.uname().nodename  # it runs in the container
        assert healthy(env, f"{name}-worker")
        from gpumesh import accelerate
        mesh = client(port)
        try:
            assert accelerate(mesh)(square).map(range(8)) == [i * i for i in range(8)]
        finally:
            mesh.close()
    finally:
        podman(env, "pod", "rm", "-f", "-t", "2", name, check=False)


def compose(env, project, *args, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run(["podman-compose", "-p", project, "-f", str(ROOT / "docker-compose.yaml"),
                           *args], env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_compose_runs_two_workers_and_keeps_results_across_a_coordinator_restart(env, image, tmp_path):
    project = f"gmtest{uuid.uuid4().hex[:6]}"
    port = free_port()
    base = {k: v for k, v in env.items() if k != "GPUMESH_TOKEN"}
    r = compose(base, project, "up", "-d")
    assert r.returncode != 0
    assert "GPUMESH_TOKEN is not set" in r.stdout + r.stderr
    cenv = dict(base, GPUMESH_TOKEN=TOKEN, GPUMESH_IMAGE=image, GPUMESH_PORT=str(port),
                WORKER_REPLICAS="2")
    try:
        r = compose(cenv, project, "up", "-d")
        assert r.returncode == 0, r.stdout + r.stderr
        coordinator = f"{project}_coordinator_1"
        wait_for(lambda: healthy(env, coordinator), 120, "the coordinator's healthcheck")
        workers = wait_for(lambda: len(alive(port)) == 2 and alive(port), 180, "two container workers")
        assert len({w["hostname"] for w in workers}) == 2
        script = tmp_path / "sq.py"
        script.write_text("import json, sys\nx = json.load(sys.stdin)['x']\nprint(json.dumps(x * x))\n")
        from gpumesh import accelerate
        mesh = client(port)
        try:
            assert accelerate(mesh)(square).map(range(10)) == [i * i for i in range(10)]
            # a script job's results stay in the store until purged (a .map's are released
            # once its caller has them): this is what must survive the restart
            job = mesh.submit(name="squares", script=script, payloads=[{"x": i} for i in range(6)])
            got = mesh.wait(job, timeout=120)
            assert [t["result"] for t in got] == [i * i for i in range(6)]
        finally:
            mesh.close()
        podman(env, "restart", "-t", "5", coordinator)
        wait_for(lambda: healthy(env, coordinator), 120, "the restarted coordinator")
        mesh = client(port)
        try:  # the job store lives in the gpumesh-data volume: the results are still there
            assert [t["result"] for t in mesh.wait(job, timeout=30)] == [i * i for i in range(6)]
            assert mesh.status(job)["counts"] == {"done": 6}
        finally:
            mesh.close()
        wait_for(lambda: len(alive(port)) == 2, 120, "the workers to come back")
    finally:
        compose(cenv, project, "down", "-v", "-t", "2")
        podman(env, "network", "rm", "-f", f"{project}_default", check=False)  # compose leaves it
