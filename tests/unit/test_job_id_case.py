"""Job ids typed in capitals are the same job: the CLI and the Python API lowercase them
before any request (the coordinator spells ids in lower case), and still refuse what is
not hex digits, with the same words as before."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from gpumesh import GPUMesh, errors
from gpumesh.cli import main
from gpumesh.client.paths import check_id, check_job_id, job_path
from gpumesh.transport import Transport

UPPER, LOWER = "9FB8419827B0", "9fb8419827b0"
URL = "http://127.0.0.1:18571"  # nothing listens: every request is caught below
TOKEN = "t" * 40


@pytest.fixture
def sent(monkeypatch):
    """The (method, path, params) of every request, each answered 404 without a network."""
    got: list[tuple[str, str, dict | None]] = []

    def refuse(self, method, path, *, params=None, **kw):
        got.append((method, path, params))
        raise errors.RequestRejected(f"no such job {LOWER}", 404)

    monkeypatch.setattr(Transport, "request", refuse)
    monkeypatch.setattr(Transport, "stream_into", refuse)
    return got


def _env(tmp_path):
    return {"GPUMESH_URL": URL, "GPUMESH_TOKEN": TOKEN,
            "GPUMESH_CONFIG": str(tmp_path / "config.json"), "NO_COLOR": "1"}


def test_check_id_lowercases_hex_in_either_case_and_refuses_the_rest():
    assert check_job_id(UPPER) == LOWER and check_job_id(LOWER) == LOWER
    assert check_id("AbCd12", "task id", "`gpumesh status JOB`") == "abcd12"
    assert job_path(UPPER, "cancel") == f"/v1/jobs/{LOWER}/cancel"
    for bad in ("xyz", "ABCG", "", "12 34", "a" * 65, "ABCD\n"):
        with pytest.raises(ValueError, match=r"is not a job id \(ids are hex digits, as "
                                             r"`gpumesh jobs` lists them\)"):
            check_job_id(bad)


@pytest.mark.parametrize("command, method, path", [
    (["status"], "GET", f"/v1/jobs/{LOWER}"),
    (["cancel"], "POST", f"/v1/jobs/{LOWER}/cancel"),
    (["retry"], "POST", f"/v1/jobs/{LOWER}/retry"),
    (["logs"], "GET", f"/v1/jobs/{LOWER}/logs"),
])
def test_an_uppercase_job_id_reaches_the_request_lowercased(sent, tmp_path, command, method, path):
    r = CliRunner().invoke(main, [*command, UPPER], env=_env(tmp_path))
    assert r.exit_code == 1, r.output  # the (faked) coordinator's 404, not a usage error
    assert f"no such job {LOWER}" in r.output
    assert [(m, p) for m, p, _ in sent] == [(method, path)]


def test_logs_task_and_jobs_before_are_lowercased_too(sent, tmp_path):
    r = CliRunner().invoke(main, ["logs", UPPER, "--task", "ABCDEF01"], env=_env(tmp_path))
    assert r.exit_code == 1, r.output
    assert sent == [("GET", f"/v1/jobs/{LOWER}/logs", {"task": "abcdef01"})]
    sent.clear()
    r = CliRunner().invoke(main, ["jobs", "--before", UPPER], env=_env(tmp_path))
    assert r.exit_code == 1, r.output
    assert sent == [("GET", "/v1/jobs", {"limit": 20, "before": LOWER})]


@pytest.mark.parametrize("command", [["status"], ["cancel"], ["retry"], ["logs"]])
def test_what_is_not_hex_is_still_a_usage_error_before_any_request(sent, tmp_path, command):
    r = CliRunner().invoke(main, [*command, "xyz"], env=_env(tmp_path))
    assert r.exit_code == 2
    assert r.output == ("Error: Invalid value for 'JOB_ID': 'xyz' is not a job id (ids are "
                        "hex digits, as `gpumesh jobs` lists them)\n")
    assert sent == []


def test_the_python_api_lowercases_job_ids_as_the_cli_does(sent, tmp_path, monkeypatch):
    monkeypatch.setenv("GPUMESH_CONFIG", str(tmp_path / "config.json"))
    mesh = GPUMesh(URL, token=TOKEN)
    calls = [(mesh.status, "GET", f"/v1/jobs/{LOWER}"),
             (mesh.cancel, "POST", f"/v1/jobs/{LOWER}/cancel"),
             (mesh.retry, "POST", f"/v1/jobs/{LOWER}/retry"),
             (mesh.logs, "GET", f"/v1/jobs/{LOWER}/logs"),
             (mesh.wait, "GET", f"/v1/jobs/{LOWER}/results")]
    for fn, method, path in calls:
        sent.clear()
        with pytest.raises(errors.RequestRejected):
            fn(UPPER)
        assert [(m, p) for m, p, _ in sent] == [(method, path)], fn.__name__
    sent.clear()
    with pytest.raises(errors.RequestRejected):
        mesh.jobs(before=UPPER)
    assert sent == [("GET", "/v1/jobs", {"limit": 20, "before": LOWER})]
    for fn in (mesh.status, mesh.cancel, mesh.retry, mesh.logs, mesh.wait):
        with pytest.raises(ValueError, match="'xyz' is not a job id"):
            fn("xyz")
    assert sent[1:] == []
