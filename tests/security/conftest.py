"""Helpers for the security tests: coordinators started with extra ``serve`` flags,
workers joined with a chosen token, raw HTTP with a chosen token."""

from __future__ import annotations

import re
import warnings

import httpx
import pytest

from tests.conftest import TOKEN, Mesh, Proc, wait_for

WORKER_TOKEN = "worker-token-abcdefghijklmnopqrstuvwxyz012345"
#: The main token of the in-process apps ``app_factory`` makes.
APP_MAIN = "main-token-0123456789abcdefghij"


@pytest.fixture
def app_factory(tmp_path, cheap_kdf):
    """``make(client=(host, port), **create_app_kwargs)``: a coordinator app with its own
    store, answered in process by Starlette's TestClient as if ``client`` had connected
    (its token KDF cheap: ../conftest.py's ``cheap_kdf``)."""
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

    verify = False  # a --tls coordinator's certificate is self-signed

    def wait_health(self) -> None:
        super().wait_health()
        if self.tls:
            found = wait_for(lambda: re.search(r"fingerprint: (SHA256:[0-9a-f]{64})",
                                               self.coordinator.output()),
                             10, lambda: "the TLS fingerprint in:\n" + self.coordinator.output())
            self.fingerprint = found.group(1)

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
