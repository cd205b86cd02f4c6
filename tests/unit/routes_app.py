"""An in-process coordinator app for the route tests (tests/unit/test_routes_*.py):
Starlette's TestClient answers it with no server, no socket, no other process."""

from __future__ import annotations

import hashlib
import json
import warnings

import pytest

from gpumesh import wire

MAIN = "main-token-for-route-tests-0123456789"
WORKER = "worker-token-for-route-tests-012345"


def bearer(token: str) -> dict:
    return {"authorization": f"Bearer {token}"}


class Api:
    """A TestClient on a fresh coordinator (``coord``) with the main token sent."""

    def __init__(self, tmp_path, **kw):
        from gpumesh.coordinator.app import create_app
        from gpumesh.coordinator.core import Coordinator
        from gpumesh.coordinator.store import Store
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from starlette.testclient import TestClient
        self.store = Store(tmp_path / "data")
        self.coord = Coordinator(self.store)
        self.app = create_app(self.coord, MAIN, worker_token=WORKER, **kw)
        self.client = TestClient(self.app, client=("192.0.2.7", 40000),
                                 raise_server_exceptions=False)

    def call(self, method: str, path: str, token: str | None = MAIN, **kw):
        headers = dict(kw.pop("headers", {}))
        if token is not None:
            headers.update(bearer(token))
        return self.client.request(method, path, headers=headers, **kw)

    def refusal(self, method: str, path: str, status: int, code: str, **kw) -> str:
        """Call; assert the status and error code; return the message."""
        r = self.call(method, path, **kw)
        assert r.status_code == status, (r.status_code, r.text)
        body = r.json()
        assert body["error"] == code and set(body) == {"error", "message"}, body
        return body["message"]

    def worker(self, **info) -> str:
        r = self.call("POST", "/v1/workers", json={"hostname": "w", **info})
        assert r.status_code == 200, r.text
        return r.json()["id"]

    def fn_blob(self) -> tuple[bytes, str]:
        blob = b"".join(bytes(c) for c in wire.dumps(len).chunks)
        return blob, hashlib.sha256(blob).hexdigest()

    def submit(self, meta: dict | None = None, args: list | None = None, **fields):
        """POST /v1/jobs of a function job with an inline blob; ``fields`` update the meta."""
        blob, fn = self.fn_blob()
        args = [wire.dumps(((i,), {})) for i in range(2)] if args is None else args
        meta = meta if meta is not None else {"job_id": "abcdef01", "fn": fn, "fn_inline": True,
                                              "n_tasks": len(args), "require_worker": False}
        meta.update(fields)
        chunks, _ = wire.pack_frames([json.dumps(meta).encode(), blob, *args])
        return self.call("POST", "/v1/jobs", content=b"".join(bytes(c) for c in chunks))

    def close(self):
        self.client.close()
        self.store.close()


@pytest.fixture(name="api")
def api_fixture(tmp_path, cheap_kdf):
    """An :class:`Api` (the test modules bind it as ``api``), its token KDF cheap
    (../conftest.py's ``cheap_kdf``)."""
    made = Api(tmp_path)
    yield made
    made.close()
