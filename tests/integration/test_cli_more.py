"""CLI conventions on real meshes: doctor, help texts, exit codes, --log-json, colours."""

from __future__ import annotations

import json
import sys
import time

import click
import pytest
from click.testing import CliRunner

from gpumesh.cli import main
from gpumesh.cli.views import color_enabled

from ..conftest import TOKEN, Proc, free_port


def run(args, env):
    return CliRunner().invoke(main, args, env=env, catch_exceptions=False)


def env_for(m, **kw):
    env = {"GPUMESH_URL": m.url, "GPUMESH_TOKEN": m.token, "GPUMESH_CONFIG": m.env["GPUMESH_CONFIG"],
           "NO_COLOR": None}
    env.update(kw)
    return env


def test_doctor_all_good_never_prints_the_token(shared_mesh):
    r = run(["doctor"], env_for(shared_mesh))
    assert r.exit_code == 0, r.output
    assert TOKEN not in r.output
    lines = r.output.splitlines()
    for name in ("install", "python", "cloudpickle", "torch", "gpus", "config", "coordinator", "token"):
        assert any(ln[7:].startswith(name) for ln in lines), name
    assert any(ln.startswith("[OK]   token") and "2 worker(s) alive" in ln for ln in lines)
    # (the shared mesh's pool checks may warn about what other tests' jobs imported)
    assert lines[-1].startswith("all checks passed"), r.output
    data = json.loads(run(["doctor", "--json"], env_for(shared_mesh)).output)
    assert data["ok"] is True and {c["name"] for c in data["checks"]} >= {"coordinator", "token"}
    assert TOKEN not in json.dumps(data)


def test_doctor_counts_its_warnings(make_mesh):
    # a coordinator with no worker is a warning, not a failure: the run passes, and says so
    empty = make_mesh(workers=0)
    r = run(["doctor"], env_for(empty))
    lines = r.output.splitlines()
    warned = [ln for ln in lines if ln.startswith("[WARN]")]
    assert r.exit_code == 0 and any(ln.startswith("[WARN] workers") for ln in warned), r.output
    n = len(warned)
    assert lines[-1] == f"all checks passed, {n} warning{'s' * (n != 1)}"


def test_doctor_says_what_to_do(shared_mesh):
    wrong = "wrong-token-" + "x" * 40
    r = run(["doctor"], env_for(shared_mesh, GPUMESH_TOKEN=wrong))
    assert r.exit_code == 1 and wrong not in r.output
    assert "[FAIL] token          refused by the coordinator" in r.output
    assert "-> use the token `gpumesh serve` printed" in r.output
    dead = f"http://127.0.0.1:{free_port()}"
    r = run(["doctor", "--json"], env_for(shared_mesh, GPUMESH_URL=dead))
    assert r.exit_code == 1
    checks = {c["name"]: c for c in json.loads(r.output)["checks"]}
    # the first failed step says what to do; the steps after it are not tried
    assert checks["tcp"]["status"] == "fail" and "gpumesh serve" in checks["tcp"]["fix"]
    assert checks["coordinator"]["status"] == "skip" and checks["token"]["status"] == "skip"


def test_every_flag_documents_its_default():
    for name, cmd in main.commands.items():
        text = cmd.get_help(click.Context(cmd, info_name=name))
        for p in cmd.params:
            if isinstance(p, click.Option) and p.name != "help":
                assert p.required or p.show_default or "default" in (p.help or ""), (name, p.opts)
                assert p.opts[-1] in text
    top = main.get_help(click.Context(main, info_name="gpumesh"))
    for flag in ("--verbose", "--log-json", "GPUMESH_LOG_JSON", "--no-color", "NO_COLOR", "Exit codes"):
        assert flag in top
    for command in ("submit", "retry", "doctor", "status", "jobs", "cancel", "logs"):
        assert command in top


def test_exit_codes_and_one_line_errors(shared_mesh):
    env = env_for(shared_mesh)
    r = CliRunner().invoke(main, ["status", "0123456789ab"], env=env)
    assert r.exit_code == 1 and "no such job" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(main, ["status"], env=env)
    assert r.exit_code == 2  # usage
    r = CliRunner().invoke(main, ["no-such-command"], env=env)
    assert r.exit_code == 2
    r = CliRunner().invoke(main, ["cancel", "0123456789ab", "--url", f"http://127.0.0.1:{free_port()}"],
                           env=env)
    assert r.exit_code == 1 and len(r.output.strip().splitlines()) == 1
    assert r.output.startswith("Error: cannot reach the coordinator")


def test_no_color(monkeypatch):
    class Tty:
        def isatty(self):
            return True
    monkeypatch.setattr(sys, "stdout", Tty())
    monkeypatch.delenv("NO_COLOR", raising=False)
    assert color_enabled()
    monkeypatch.setenv("NO_COLOR", "1")
    assert not color_enabled()
    monkeypatch.undo()
    seen = {}

    @main.command("probe-colour", hidden=True)
    def probe():
        import os
        seen["no_color"] = os.environ.get("NO_COLOR")
    try:
        assert run(["--no-color", "probe-colour"], {"NO_COLOR": None}).exit_code == 0
        assert seen["no_color"] == "1"
    finally:
        del main.commands["probe-colour"]


def test_log_json_and_verbose_change_the_coordinators_log(tmp_path, make_mesh):
    m = make_mesh(workers=0)
    port = free_port()
    log = tmp_path / "json.log"
    p = Proc(["--log-json", "-vv", "serve", "--port", str(port), "--data-dir", str(tmp_path / "d"),
              "--no-self-worker"], m.env, log)
    try:
        deadline = time.monotonic() + 30
        import httpx
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v1/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        w = Proc(["join", f"http://127.0.0.1:{port}", "--slots", "1"], m.env, tmp_path / "w.log")
        try:
            while time.monotonic() < deadline and "worker joined" not in log.read_text():
                time.sleep(0.1)
        finally:
            w.stop()
        records = [json.loads(ln) for ln in log.read_text().splitlines() if ln.startswith("{")]
        joined = [r for r in records if r["message"].startswith("worker joined")]
        assert joined and joined[0]["level"] == "info" and joined[0]["logger"] == "gpumesh.coordinator"
    finally:
        p.stop()


MAP_SCRIPT = """
import time
from gpumesh import GPUMesh
mesh = GPUMesh()
def slow(x):
    import time
    time.sleep(0.3)
    return x
print(mesh.run_calls(slow, [((i,), {}) for i in range(6)]))
"""


def test_map_draws_no_bar_in_a_pipe_and_one_when_asked(shared_mesh, monkeypatch):
    import subprocess
    env = dict(shared_mesh.env, GPUMESH_URL=shared_mesh.url)
    env.pop("GPUMESH_PROGRESS", None)
    r = subprocess.run([sys.executable, "-c", MAP_SCRIPT], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[0, 1, 2, 3, 4, 5]"
    assert "ETA" not in r.stderr and "6/6" not in r.stderr
    # the same batch with a bar forced on, drawn into a console we can read
    import io

    from rich.console import Console

    from gpumesh.client import progress
    out = io.StringIO()
    real = progress.Progress

    def recording(*a, **kw):
        kw.update(console=Console(file=out, force_terminal=True, width=100, color_system=None),
                  enabled=True, keep=True, delay=0.2)
        return real(*a, **kw)
    monkeypatch.setattr("gpumesh.client.pipeline.Progress", recording)
    mesh = shared_mesh.client(output=False)

    def slow(x):
        import time
        time.sleep(0.4)
        return x
    assert mesh.run_calls(slow, [((i,), {}) for i in range(6)]) == list(range(6))
    assert "6/6" in out.getvalue() and "ETA" in out.getvalue()
    # and the same batch run here (GPUMESH_LOCAL=1, as when the mesh is unreachable)
    out.seek(0)
    out.truncate()
    monkeypatch.setenv("GPUMESH_LOCAL", "1")
    assert mesh.run_calls(slow, [((i,), {}) for i in range(4)]) == list(range(4))
    assert "4/4" in out.getvalue() and "ETA" in out.getvalue()


def test_cancel_of_a_job_that_already_ended_says_so(make_mesh, tmp_path):
    m = make_mesh(workers=1)
    script = tmp_path / "one.py"
    script.write_text("import json, sys\nprint(json.dumps(json.load(sys.stdin)['x'] + 1))\n")
    client = m.client(output=False)
    try:
        job = client.submit(script=str(script), payloads=[{"x": 1}])
        assert [r["result"] for r in client.wait(job, timeout=60)] == [2]
    finally:
        client.close()
    env = env_for(m)
    for when in ("still in the coordinator's memory", "after a restart: only in its store"):
        r = run(["cancel", job], env)
        assert r.exit_code == 0, (when, r.output)
        assert r.output.strip() == f"[OK] job {job} had already finished: nothing to cancel", when
        assert json.loads(run(["cancel", job, "--json"], env).output) == {
            "job_id": job, "cancelled": 0, "state": "finished"}, when
        # an id typed in capitals is the same job (the CLI lowercases it)
        assert json.loads(run(["cancel", job.upper(), "--json"], env).output) == {
            "job_id": job, "cancelled": 0, "state": "finished"}, when
        r = run(["status", job.upper(), "--json"], env)
        assert r.exit_code == 0 and json.loads(r.output)["id"] == job, (when, r.output)
        m.restart()
    r = run(["cancel", "0123456789ab"], env)
    assert r.exit_code == 1 and "no such job 0123456789ab" in r.output


@pytest.mark.parametrize("bad", ["", "../../x", "xyz", "ABCG", "12 34", "a" * 65])
def test_a_job_id_that_is_not_one_is_refused_before_any_request(shared_mesh, bad):
    for command in (["cancel", bad], ["status", bad], ["retry", bad], ["logs", bad]):
        r = run(command, env_for(shared_mesh))
        assert r.exit_code == 2, (command, r.output)  # a bad argument: a usage error
        assert "is not a job id" in r.output and "no route" not in r.output, (command, r.output)


#: Every command that talks to a coordinator, with what it needs besides the URL.
URL_COMMANDS = [["jobs"], ["status", "0123456789ab"], ["cancel", "0123456789ab"],
                ["retry", "0123456789ab"], ["logs", "0123456789ab"], ["workers"], ["devices"],
                ["token", "list"], ["token", "add", "ann"], ["token", "revoke", "ann"], ["doctor"]]


@pytest.mark.parametrize("bad", ["ftp://x", "http://", "127.0.0.1:8000"])
def test_a_coordinator_url_that_is_not_http_is_a_usage_error(tmp_path, bad):
    # --url, GPUMESH_URL and a URL argument are checked the same way, before anything
    # is tried: one Error: line that names where the URL came from, exit code 2
    payloads = tmp_path / "p.json"
    payloads.write_text("[1]")
    script = tmp_path / "s.py"
    script.write_text("print(1)\n")
    env = {"GPUMESH_CONFIG": str(tmp_path / "none.json"), "GPUMESH_TOKEN": TOKEN, "GPUMESH_URL": None}
    commands = URL_COMMANDS + [["submit", str(script), "--payloads", str(payloads)]]
    want = "must start with http:// or https:// and name a host"
    for args in commands:
        for how, argv, extra, source in (("flag", [*args, "--url", bad], {}, "--url: "),
                                         ("env", args, {"GPUMESH_URL": bad}, "GPUMESH_URL: ")):
            r = CliRunner().invoke(main, argv, env={**env, **extra})
            lines = r.stderr.strip().splitlines()
            assert r.exit_code == 2 and len(lines) == 1, (how, args, r.output)
            assert lines[0].startswith(f"Error: {source}coordinator URL") and want in lines[0], lines
    for args in (["doctor", bad], ["join", bad, "--token", TOKEN]):
        r = CliRunner().invoke(main, args, env=env)
        assert r.exit_code == 2 and r.stderr.strip().splitlines() == [
            f"Error: coordinator URL {bad!r} {want}, e.g. http://127.0.0.1:8000"], r.output  # as typed
