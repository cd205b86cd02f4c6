"""Helpers for the security tests: coordinators started with extra ``serve`` flags,
workers joined with a chosen token, raw HTTP with a chosen token."""

from __future__ import annotations

import os
import re
import time
import warnings

import httpx
import pytest

from tests.conftest import START_TIMEOUT_S, TOKEN, Mesh, Proc

WORKER_TOKEN = "worker-token-abcdefghijklmnopqrstuvwxyz012345"
#: The main token of the in-process apps ``app_factory`` makes.
APP_MAIN = "main-token-0123456789abcdefghij"


@pytest.fixture
def app_factory(tmp_path):
    """``make(client=(host, port), **create_app_kwargs)``: a coordinator app with its own
    store, answered in process by Starlette's TestClient as if ``client`` had connected."""
    from gpumesh.coordinator.app import create_app
    from gpumesh.coordinator.core import Coordinator
    from gpumesh.coordinator.store import Store
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from starlette.testclient import TestClient
    made = []

    def make(client=("127.0.0.1", 40000), **kw):
        store = Store(tmp_path / f"data{len(made)}")
        app = create_app(Coordinator(store), APP_MAIN, **kw)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            c = TestClient(app, client=client)
        made.append((c, store))
        return c

    yield make
    for c, store in made:
        c.close()
        store.close()


class SecureMesh(Mesh):
    """A :class:`Mesh` whose ``serve`` gets extra flags and may serve TLS."""

    def __init__(self, root, token: str = TOKEN, tls: bool = False, env: dict | None = None):
        super().__init__(root, token)
        self.env.update(env or {})
        self.tls = tls
        self.fingerprint: str | None = None
        if tls:
            self.url = self.url.replace("http://", "https://")

    def wait_health(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.coordinator.p.poll() is not None:
                raise RuntimeError("coordinator exited:\n" + self.coordinator.output())
            try:
                if httpx.get(f"{self.url}/v1/health", timeout=1, verify=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        else:
            raise RuntimeError("coordinator did not start:\n" + self.coordinator.output())
        if self.tls:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and "Ctrl+C" not in self.coordinator.output():
                time.sleep(0.05)
            self.fingerprint = re.search(r"fingerprint: (SHA256:[0-9a-f]{64})",
                                         self.coordinator.output()).group(1)

    def request(self, method: str, path: str, token: str | None = None, **kw) -> httpx.Response:
        headers = dict(kw.pop("headers", {}) or {})
        tok = self.token if token is None else token
        if tok:
            headers["authorization"] = f"Bearer {tok}"
        return httpx.request(method, f"{self.url}{path}", headers=headers, timeout=kw.pop("timeout", 10),
                             verify=False, **kw)

    def workers(self) -> list[dict]:
        r = self.request("GET", "/v1/workers")
        r.raise_for_status()
        return r.json()

    def join(self, token: str | None = None, extra: list[str] = (), wait: bool = True) -> Proc:
        env = dict(self.env)
        if token is not None:
            env["GPUMESH_TOKEN"] = token
        if self.fingerprint:
            extra = ["--fingerprint", self.fingerprint, *extra]
        before = self.alive() if wait else 0
        proc = Proc(["join", self.url, *extra], env, self.root / f"worker{len(self.procs)}.log")
        self.procs.append(proc)
        if wait:
            self.wait_alive(before + 1, proc)
        return proc

    def client(self, **kw):
        from gpumesh import GPUMesh
        kw.setdefault("output", False)
        if self.fingerprint:
            kw.setdefault("fingerprint", self.fingerprint)
        return GPUMesh(self.url, token=kw.pop("token", self.token), **kw)


@pytest.fixture
def secure_mesh(tmp_path):
    """Factory: ``secure_mesh(extra=[...], tls=False, env={})`` -> a started SecureMesh
    (no workers; add them with ``.join()``)."""
    made: list[SecureMesh] = []

    def make(extra: list[str] = (), tls: bool = False, env: dict | None = None,
             token: str = TOKEN, self_worker: bool = False) -> SecureMesh:
        m = SecureMesh(tmp_path / f"smesh{len(made)}", token, tls=tls or "--tls-cert" in extra, env=env)
        made.append(m)
        m.start(self_worker=self_worker, extra=[*(["--tls"] if tls else []), *extra])
        return m

    yield make
    for m in made:
        m.stop()


@pytest.fixture
def no_local_fallback(monkeypatch):
    """Fail loudly if a call falls back to running in this process."""
    from gpumesh.client import pipeline

    def refuse(backend, job):
        raise AssertionError(f"{job.fn!r} ran locally although the mesh is up")
    monkeypatch.setattr(pipeline.InlineBackend, "run", refuse)
    monkeypatch.delenv("GPUMESH_LOCAL", raising=False)


def proc_memory_texts(pid: int) -> bytes:
    """What other local users can read of a process: its command line and environment."""
    out = b""
    for name in ("cmdline", "environ"):
        try:
            with open(f"/proc/{pid}/{name}", "rb") as fh:
                out += fh.read()
        except OSError:
            pass
    return out


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                stat = fh.read()
            ppid = int(stat[stat.rindex(b")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out
