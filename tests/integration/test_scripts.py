"""Script jobs (``gpumesh submit``) on real meshes: protocol, errors, retry, safe mode."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import platform
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpumesh.cli import main
from gpumesh.errors import RequestRejected

from ..conftest import Mesh

REPO = Path(__file__).resolve().parents[2]

SQUARE = """\
import json, sys
p = json.load(sys.stdin)
print("working on", p["x"])
print(json.dumps({"x": p["x"], "sq": p["x"] ** 2}))
print("not json: the result is the last line that parses as JSON")
"""


def cli(m: Mesh, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpumesh", *args], env=m.env, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL, cwd=REPO)


def invoke(m: Mesh, *args: str):
    """The CLI in this process (click's runner), against mesh ``m``."""
    env = {"GPUMESH_URL": m.url, "GPUMESH_TOKEN": m.token, "GPUMESH_CONFIG": m.env["GPUMESH_CONFIG"]}
    return CliRunner().invoke(main, list(args), env=env, catch_exceptions=False)


@pytest.fixture
def script_mesh(make_mesh):
    return make_mesh(workers=1, slots=2)


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_submit_wait_prints_progress_and_results(script_mesh, tmp_path):
    script = write(tmp_path, "square.py", SQUARE)
    payloads = write(tmp_path, "p.json", json.dumps([{"x": i} for i in range(4)]))
    r = invoke(script_mesh, "submit", str(script), "--payloads", str(payloads), "--wait",
               "--name", "squares")
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    job_id = lines[0].split()[-1]
    assert lines[0] == f"[OK] Submitted job {job_id}"
    assert lines[1] == f"Job: squares ({job_id})"
    assert any("#################### 100%  4/4 done" in ln for ln in lines)
    assert "  Status: finished" in lines and "  Counts: {'done': 4}" in lines
    results = [json.loads(ln.split("result: ", 1)[1]) for ln in lines if "result: " in ln]
    assert sorted(r["sq"] for r in results) == [0, 1, 4, 9]
    done = [ln for ln in lines if ln.startswith("  ✓ task ")]
    assert len(done) == 4 and all("[done]  cost=1.0  worker=" in ln for ln in done)
    # everything the script printed is kept per task
    logs = invoke(script_mesh, "logs", job_id, "--json")
    kept = json.loads(logs.output)
    assert [t["stdout"].splitlines()[0] for t in kept] == [f"working on {i}" for i in range(4)]


def test_submit_returns_at_once_and_python_api(script_mesh, tmp_path):
    script = write(tmp_path, "square.py", SQUARE)
    payloads = write(tmp_path, "p.json", "\n".join(json.dumps({"x": i}) for i in range(3)))  # JSON lines
    r = invoke(script_mesh, "submit", str(script), "--payloads", str(payloads), "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["n_tasks"] == 3
    mesh = script_mesh.client()
    got = mesh.wait(out["job_id"], timeout=60)
    assert [g["result"] for g in got] == [{"x": i, "sq": i * i} for i in range(3)]
    # GPUMesh.submit(name=, script=, payloads=) and status(job_id)
    job_id = mesh.submit(name="api", script=str(script), payloads=[{"x": 7}])
    assert mesh.wait(job_id, timeout=60)[0]["result"] == {"x": 7, "sq": 49}
    st = mesh.status(job_id)
    assert st["kind"] == "script" and st["state"] == "finished" and st["counts"] == {"done": 1}
    df = mesh.results_to_dataframe(got)
    assert list(df["sq"]) == [0, 1, 4] and list(df["state"]) == ["done"] * 3


def test_failures_are_clear_and_exit_code_1(script_mesh, tmp_path):
    script = write(tmp_path, "bad.py", """\
import json, sys
p = json.load(sys.stdin)
if p["mode"] == "exit":
    print("about to fail", file=sys.stderr)
    sys.exit(3)
if p["mode"] == "nojson":
    print("just text")
if p["mode"] == "ok":
    print(json.dumps([1, 2]))
""")
    payloads = write(tmp_path, "p.json", json.dumps([{"mode": m} for m in ("exit", "nojson", "ok")]))
    r = invoke(script_mesh, "submit", str(script), "--payloads", str(payloads), "--wait")
    assert r.exit_code == 1, r.output
    assert "  Counts: {'done': 1, 'failed': 2}" in r.output
    assert "error: the script exited with status 3; stderr ends with: about to fail" in r.output
    assert "error: the script printed no JSON line on stdout" in r.output
    assert "result: [1, 2]" in r.output
    job_id = r.output.splitlines()[0].split()[-1]
    st = invoke(script_mesh, "status", job_id, "--json")
    assert st.exit_code == 1
    view = json.loads(st.output)
    errors = {t["index"]: t["error"] for t in view["tasks"]}
    assert errors[0]["type"] == "ScriptFailed" and errors[0]["code"] == 3
    assert "about to fail" in errors[0]["stderr_tail"]
    assert errors[2] is None


def test_timeout_and_cancel_kill_the_process_group(script_mesh, tmp_path):
    marker = tmp_path / "child-alive"
    script = write(tmp_path, "slow.py", f"""\
import json, subprocess, sys, time
p = json.load(sys.stdin)
# a grandchild in the same process group: it must die with the task
subprocess.Popen([sys.executable, "-c", "import time, pathlib; time.sleep(3); "
                  "pathlib.Path({str(marker)!r}).write_text('x')"])
time.sleep(p["sleep"])
print(json.dumps("woke"))
""")
    payloads = write(tmp_path, "p.json", json.dumps([{"sleep": 30}]))
    t0 = time.monotonic()
    r = invoke(script_mesh, "submit", str(script), "--payloads", str(payloads), "--wait",
               "--timeout", "1")
    assert r.exit_code == 1, r.output
    assert time.monotonic() - t0 < 20
    assert "error: the task ran longer than its timeout of 1s" in r.output
    # cancel a running script job
    r = invoke(script_mesh, "submit", str(script), "--payloads", str(payloads), "--json")
    job_id = json.loads(r.output)["job_id"]
    mesh = script_mesh.client()
    deadline = time.monotonic() + 20
    while mesh.status(job_id)["counts"].get("leased") != 1:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    time.sleep(0.5)
    c = invoke(script_mesh, "cancel", job_id, "--json")
    assert json.loads(c.output) == {"job_id": job_id, "cancelled": 1, "state": "cancelled"}
    time.sleep(4)
    assert not marker.exists(), "a process the script started outlived its task"


def test_retry_requeues_failed_tasks(script_mesh, tmp_path):
    script = write(tmp_path, "flaky.py", """\
import json, pathlib, sys
p = json.load(sys.stdin)
flag = pathlib.Path(p["flag"])
if p["flaky"] and not flag.exists():
    flag.write_text("seen")
    sys.exit("first attempt fails")
print(json.dumps({"n": p["n"]}))
""")
    payloads = write(tmp_path, "p.json", json.dumps(
        [{"n": i, "flaky": i == 1, "flag": str(tmp_path / "flag")} for i in range(3)]))
    r = invoke(script_mesh, "submit", str(script), "--payloads", str(payloads), "--wait")
    assert r.exit_code == 1 and "first attempt fails" in r.output
    job_id = r.output.splitlines()[0].split()[-1]
    r = invoke(script_mesh, "retry", job_id)
    assert r.exit_code == 0 and r.output.strip() == f"[OK] re-queued 1 failed task(s) of job {job_id}"
    mesh = script_mesh.client()
    got = mesh.wait(job_id, timeout=60)
    assert [g["result"] for g in got] == [{"n": 0}, {"n": 1}, {"n": 2}]
    view = mesh.status(job_id)
    assert view["counts"] == {"done": 3}
    # the re-run is attempt 2; the failed attempt 1 stays in the history, and logs show both apart
    t1 = next(t for t in view["tasks"] if t["index"] == 1)
    assert t1["attempts"] == 2
    assert [(h["attempt"], h["ended"], h.get("retried")) for h in t1["history"]] == [
        (1, "failed; re-run by gpumesh retry", True)]
    # named by its host, as every other ended attempt is ("--- attempt 1 on HOST (ID)")
    assert t1["history"][0]["hostname"] == platform.node()
    (log1,) = [t for t in mesh.logs(job_id) if t["index"] == 1]
    assert [a["attempt"] for a in log1["attempts"]] == [1, 2]
    assert "first attempt fails" in log1["attempts"][0]["stderr"]
    assert log1["attempts"][1]["stdout"].strip() == '{"n": 1}'
    r = invoke(script_mesh, "retry", job_id, "--json")
    assert json.loads(r.output) == {"job_id": job_id, "retried": 0}
    # unknown job: one line, exit 1
    r = cli(script_mesh, "retry", "0123456789ab")
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1
    assert "no such job" in r.stderr and "Traceback" not in r.stderr


def test_retry_of_a_function_job_is_410(script_mesh):
    mesh = script_mesh.client(output=False)
    from gpumesh import accelerate  # noqa: F401 - function jobs are released once collected

    def double(x):
        return 2 * x
    assert mesh.run_calls(double, [((1,), {})]) == [2]
    job = mesh.jobs(limit=1)[0]
    deadline = time.monotonic() + 10
    while True:
        try:
            mesh.retry(job["id"])
        except RequestRejected as e:
            assert e.status == 410 and "cannot be retried" in str(e)
            break
        assert time.monotonic() < deadline, "the job was never released"
        time.sleep(0.1)


def test_usage_errors_exit_2_and_bad_payloads_exit_1(script_mesh, tmp_path):
    script = write(tmp_path, "square.py", SQUARE)
    r = cli(script_mesh, "submit", str(script))
    assert r.returncode == 2 and "--payloads" in r.stderr
    bad = write(tmp_path, "bad.json", '{\n  "x": 1\n}\n')
    r = cli(script_mesh, "submit", str(script), "--payloads", str(bad))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip() == (f"Error: the payloads file {bad} must hold a JSON array with one "
                                "payload per task, or one JSON value per line, not a JSON object "
                                "over 3 lines (for a single task, put it in brackets: [ ... ], "
                                "or on one line)")
    # JSON Lines of a single line is one task (what --payloads' help and cli.md say)
    one = write(tmp_path, "one.jsonl", '{"x": 3}\n')
    r = cli(script_mesh, "submit", str(script), "--payloads", str(one), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["n_tasks"] == 1
    broken = write(tmp_path, "broken.json", "[1, 2")
    r = cli(script_mesh, "submit", str(script), "--payloads", str(broken))
    assert r.returncode == 1 and "is not JSON" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_safe_mode_accepts_script_jobs(make_mesh, tmp_path):
    m = Mesh(tmp_path / "safe")
    m.start(extra=["--safe-mode"])
    try:
        m.add_worker()
        script = write(tmp_path, "square.py", SQUARE)
        mesh = m.client()
        job_id = mesh.submit(script=str(script), payloads=[{"x": 5}])
        assert mesh.wait(job_id, timeout=60)[0]["result"] == {"x": 5, "sq": 25}
    finally:
        m.stop()


def _example():
    spec = importlib.util.spec_from_file_location("grid_search_example", REPO / "examples" / "grid_search.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_grid_search_example_prints_what_the_spec_shows(script_mesh):
    """The spec's ``submit --wait`` command, verbatim: six payloads whose ``cost`` hints
    show as ``cost=1.0`` ... ``cost=10.0``, each task followed by its ``result:`` line."""
    payloads = json.loads((REPO / "examples" / "payloads.json").read_text())
    assert payloads[0] == {"lr": 0.01, "epochs": 100, "l2": 0.0, "cost": 1.0}
    assert payloads[-1] == {"lr": 0.3, "epochs": 1000, "l2": 0.01, "cost": 10.0}
    assert len(payloads) == 6
    r = cli(script_mesh, "submit", "examples/grid_search.py", "--payloads", "examples/payloads.json",
            "--wait", timeout=110)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    job_id = lines[0].split()[-1]
    assert lines[:2] == [f"[OK] Submitted job {job_id}", f"Job: examples/grid_search.py ({job_id})"]
    assert any(re.fullmatch(r"  #{20} 100%  6/6 done  \(\d+s\)", ln) for ln in lines), lines
    assert "  Status: finished" in lines and "  Counts: {'done': 6}" in lines
    heads = [i for i, ln in enumerate(lines) if ln.startswith("  ✓ task ")]
    assert len(heads) == 6
    train = _example().train
    for i, p in zip(heads, payloads):
        assert re.fullmatch(r"  ✓ task [0-9a-f]{12} \[done\]  cost=%s  worker=[0-9a-f]{12}"
                            % re.escape(repr(p["cost"])), lines[i]), lines[i]
        assert lines[i + 1].startswith("    result: {")
        value = json.loads(lines[i + 1].split("result: ", 1)[1])
        assert list(value) == ["lr", "epochs", "l2", "val_accuracy", "weights"]
        assert value == train(p["lr"], p["epochs"], p["l2"])  # the payload reached it whole
    assert "cost=1.0" in lines[heads[0]] and "cost=10.0" in lines[heads[-1]]


RAISES = """\
import json, os, sys
p = json.load(sys.stdin)
print(json.dumps({"file": os.path.basename(__file__), "argv0": os.path.basename(sys.argv[0]),
                  "cwd": os.listdir(".")}), flush=True)
if p["fail"]:
    print("failing now", file=sys.stderr)
    raise ValueError("boom " + str(p["fail"]))
print(json.dumps({"ok": p["fail"]}))
"""


def _frame(name: str, tail: str) -> re.Match | None:
    return re.search(r'File "(?P<dir>[^"]*)[/\\]' + re.escape(name) + r'", line 7, in <module>\n'
                     r'\s+raise ValueError\("boom " \+ str\(p\["fail"\]\)\)', tail)


def test_a_script_traceback_names_the_script_and_its_line(script_mesh, tmp_path):
    mesh = script_mesh.client(output=False)
    script = write(tmp_path, "task.py", RAISES)
    job = mesh.submit(script=str(script), payloads=[{"fail": 0}, {"fail": 1}])
    ok, failed = mesh.wait(job, timeout=60)
    assert ok["result"] == {"ok": 0} and failed["state"] == "failed"
    tail = failed["error"]["stderr_tail"]
    frame = _frame("task.py", tail)
    assert frame, tail  # the script's own name and line, not the blob's content hash
    assert re.search(r"[0-9a-f]{64}", tail) is None, tail
    # the script runs as task.py, from a directory of its own; its cwd is still empty
    logs = {t["index"]: t for t in mesh.logs(job)}
    assert json.loads(logs[0]["stdout"].splitlines()[0]) == {"file": "task.py", "argv0": "task.py",
                                                             "cwd": []}
    assert _frame("task.py", logs[1]["stderr"]), logs[1]["stderr"]
    r = invoke(script_mesh, "logs", job)
    assert _frame("task.py", r.output), r.output
    view = json.loads(invoke(script_mesh, "status", job, "--json").output)
    assert _frame("task.py", view["tasks"][1]["error"]["stderr_tail"])

    # the same source under another name: the worker's one cached blob (content-addressed)
    # runs under each job's own name
    again = write(tmp_path, "renamed.py", RAISES)
    (second,) = mesh.wait(mesh.submit(script=str(again), payloads=[{"fail": 2}]), timeout=60)
    tail = second["error"]["stderr_tail"]
    assert _frame("renamed.py", tail) and "task.py" not in tail, tail
    # source given as bytes has no name of its own: script.py
    (third,) = mesh.wait(mesh.submit(script=RAISES.encode(), payloads=[{"fail": 3}]), timeout=60)
    assert _frame("script.py", third["error"]["stderr_tail"]), third["error"]
    # the copies are gone with their tasks; the cache holds the blob once, by its hash
    copy = Path(frame["dir"])
    assert copy.name.startswith("gpumesh-src-") and not copy.exists()
    worker_dir = next(p for p in copy.parents if (p / "fn").is_dir())
    assert sorted(p.name for p in (worker_dir / "fn").iterdir()) == [
        hashlib.sha256(RAISES.encode()).hexdigest()]


def test_a_script_name_is_a_plain_file_name(script_mesh):
    from gpumesh import protocol, wire
    assert protocol.script_name("/home/me/jobs/task.py") == "task.py"
    assert protocol.script_name("C:\\jobs\\task.py") == "task.py"
    assert protocol.script_name("we?ird:na|me.py") == "we_ird_na_me.py"
    assert protocol.script_name("jobs/..") is None and protocol.script_name("") is None
    assert len(protocol.script_name("x" * 500 + ".py") or "") == protocol.SCRIPT_NAME_MAX
    # the coordinator takes only such a name, and only for a script job
    mesh = script_mesh.client(output=False)
    source = b"print(1)\n"
    fn = hashlib.sha256(source).hexdigest()
    for kind, name, words in (("script", "../../etc/x.py", "plain file name"),
                              ("script", "a/b.py", "plain file name"),
                              ("function", "task.py", "for script jobs")):
        submit = protocol.JobSubmit(job_id="0123456789ab", fn=fn, n_tasks=1, kind=kind,
                                    fn_inline=True, script=name)
        body, _ = wire.pack_frames([json.dumps(submit.as_dict()).encode(), source, b"1"])
        with pytest.raises(RequestRejected, match=words) as e:
            mesh.http.request("POST", protocol.JOBS, content=b"".join(bytes(c) for c in body),
                              timeout=10)
        assert e.value.status == 400


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, -signal.SIGTERM)])
def test_leaving_submit_wait_says_the_job_goes_on_and_how_to_follow_it(script_mesh, tmp_path, signum, code):
    # A script job is nobody's call: leaving the wait does not cancel it, and the user is
    # told so, with its id and the commands to follow or stop it (it said "Aborted!").
    script = write(tmp_path, "slow.py", "import json, sys, time\njson.load(sys.stdin)\n"
                                        "time.sleep(30)\nprint(json.dumps(1))\n")
    payloads = write(tmp_path, "p.json", json.dumps([{}, {}]))
    proc = subprocess.Popen([sys.executable, "-m", "gpumesh", "submit", str(script), "--payloads",
                             str(payloads), "--wait"], env=script_mesh.env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL, cwd=REPO)
    try:
        first = proc.stdout.readline()
        job_id = re.match(r"\[OK\] Submitted job ([0-9a-f]+)$", first.strip()).group(1)
        time.sleep(0.5)  # (into the wait)
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == code, (out, err)
    assert (f"interrupted: job {job_id} goes on running on the mesh (leaving does not cancel a "
            f"script job); follow it with: gpumesh status {job_id}; stop it with: gpumesh cancel "
            f"{job_id}") in err, err
    assert "Aborted!" not in err and "Traceback" not in err
    job = json.loads(cli(script_mesh, "status", job_id, "--json").stdout)
    assert job["state"] == "active"  # it goes on
    assert cli(script_mesh, "cancel", job_id).returncode == 0
