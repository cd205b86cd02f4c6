"""``GPUMesh.status(job_id)`` and ``gpumesh status JOB`` show each finished task's result:
script jobs the JSON value the script printed, function jobs the returned value decoded as
the call decodes it; after a coordinator restart too, and marked once results are
released. Also the spec's "Job management" block, as written."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gpumesh import GPUMesh

from ..conftest import Mesh

REPO = Path(__file__).resolve().parents[2]

SQUARE = """\
import json, sys
p = json.load(sys.stdin)
print("working on", p["x"])
print(json.dumps({"x": p["x"], "sq": p["x"] ** 2}))
"""


def cli(m: Mesh, *args: str) -> subprocess.CompletedProcess:
    env = dict(m.env, GPUMESH_URL=m.url)
    return subprocess.run([sys.executable, "-m", "gpumesh", *args], env=env, capture_output=True,
                          text=True, timeout=60, stdin=subprocess.DEVNULL, cwd=REPO)


def result_lines(stdout: str) -> list[str]:
    return [ln.split("result: ", 1)[1] for ln in stdout.splitlines() if ln.startswith("    result: ")]


def test_script_job_status_shows_results_also_after_a_restart(make_mesh, tmp_path):
    m = make_mesh(workers=1, slots=2)
    script = tmp_path / "square.py"
    script.write_text(SQUARE)
    mesh = m.client(output=False)
    job_id = mesh.submit(name="squares", script=str(script),
                         payloads=[{"x": 3}, {"x": 4, "cost": 2}, {"x": "bad"}])
    mesh.wait(job_id, timeout=60)
    for attempt in ("before", "after"):
        st = mesh.status(job_id)
        assert st["released"] is False and st["state"] == "finished", attempt
        assert [(t["index"], t["state"]) for t in st["tasks"]] == [(0, "done"), (1, "done"), (2, "failed")]
        assert [t.get("result") for t in st["tasks"]] == [{"x": 3, "sq": 9}, {"x": 4, "sq": 16}, None]
        assert "result" not in st["tasks"][2] and st["tasks"][2]["error"]["type"] == "ScriptFailed"
        r = cli(m, "status", job_id)
        assert r.returncode == 1, r.stderr                    # a task failed
        assert result_lines(r.stdout) == ['{"x": 3, "sq": 9}', '{"x": 4, "sq": 16}']
        assert "  ✓ task " in r.stdout and "cost=2.0" in r.stdout
        j = json.loads(cli(m, "status", job_id, "--json").stdout)
        assert [t.get("result") for t in j["tasks"]] == [{"x": 3, "sq": 9}, {"x": 4, "sq": 16}, None]
        assert j["released"] is False and j["kind"] == "script"
        if attempt == "before":
            mesh.close()
            m.restart()                                       # results are in the store
            mesh = m.client(output=False)


class Point:
    """Not JSON: status gives the object itself; --json gives its repr."""

    def __init__(self, x):
        self.x = x

    def __eq__(self, other):
        return isinstance(other, Point) and other.x == self.x

    def __repr__(self):
        return f"Point({self.x})"


def slow_point(i):
    import time as _t
    if i:
        _t.sleep(6)
    return {"i": i, "point": Point(i), "tags": {"a", "b"}} if i == 0 else i


def test_function_job_status_decodes_results_and_marks_release(make_mesh):
    m = make_mesh(workers=1, slots=2)
    mesh = m.client(output=False)
    out: list = []
    th = threading.Thread(target=lambda: out.append(mesh.distribute(slow_point, [0, 1])), daemon=True)
    th.start()
    deadline = time.monotonic() + 30
    while not mesh.jobs(limit=1) or mesh.jobs(limit=1)[0]["counts"].get("done") != 1:
        assert time.monotonic() < deadline, "the first task never finished"
        time.sleep(0.1)
    job_id = mesh.jobs(limit=1)[0]["id"]
    st = mesh.status(job_id)                                  # the job is still running
    assert st["kind"] == "function" and st["released"] is False and st["state"] == "active"
    first, second = st["tasks"]
    assert first["state"] == "done" and first["result"] == {"i": 0, "point": Point(0), "tags": {"a", "b"}}
    assert second["state"] == "leased" and "result" not in second
    j = json.loads(cli(m, "status", job_id, "--json").stdout)  # not JSON: its repr, marked
    assert j["tasks"][0]["result_repr"] is True
    assert j["tasks"][0]["result"].startswith("{'i': 0, 'point': Point(0), 'tags': {")
    th.join(30)
    assert out == [[{"i": 0, "point": Point(0), "tags": {"a", "b"}}, 1]]
    # the caller collected its results: they are released, and status says so
    deadline = time.monotonic() + 15
    while not mesh.status(job_id)["released"]:
        assert time.monotonic() < deadline, "the job was never released"
        time.sleep(0.1)
    st = mesh.status(job_id)
    assert [t["state"] for t in st["tasks"]] == ["done", "done"]
    assert all("result" not in t for t in st["tasks"])
    r = cli(m, "status", job_id)
    assert r.returncode == 0
    assert "  Results: released (collected by the caller, or let go)" in r.stdout
    assert result_lines(r.stdout) == ["(released: its caller collected the results, or let them go)"] * 2


def test_strict_mesh_does_not_unpickle_a_status_result(make_mesh):
    m = make_mesh(workers=1, slots=2)
    mesh = m.client(output=False)
    th = threading.Thread(target=lambda: mesh.distribute(slow_point, [0, 1]), daemon=True)
    th.start()
    deadline = time.monotonic() + 30
    while not mesh.jobs(limit=1) or mesh.jobs(limit=1)[0]["counts"].get("done") != 1:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    job_id = mesh.jobs(limit=1)[0]["id"]
    strict = m.client(output=False, strict=True)
    first = strict.status(job_id)["tasks"][0]
    assert "result" not in first and "strict" in first["result_error"]
    th.join(30)


def point_or_fail(i):
    if i == 2:
        raise ValueError(f"no point {i}")
    return {"i": i, "point": Point(i)} if i == 0 else i


def test_wait_on_a_function_job_gives_its_values_as_status_does(make_mesh):
    from gpumesh import RequestRejected, accelerate
    m = make_mesh(workers=1, slots=2)
    caller = m.client(output=False)
    # an .imap that is not read yet: its results stay on the coordinator, unreleased
    it = accelerate(caller)(point_or_fail).imap([0, 1, 2], return_exceptions=True)
    job_id = it.job_id
    other = m.client(output=False)
    got = other.wait(job_id, timeout=60)
    assert [(r["index"], r["state"]) for r in got] == [(0, "done"), (1, "done"), (2, "failed")]
    # the values the function returned, unpickled, not an {"error": ...} dict
    assert [r["result"] for r in got] == [{"i": 0, "point": Point(0)}, 1, None]
    assert not any("result_error" in r for r in got), got
    assert got[0]["error"] is None and got[2]["error"]["type"] == "ValueError"
    assert "no point 2" in got[2]["error"]["message"]
    st = other.status(job_id)
    assert [t.get("result") for t in st["tasks"]] == [{"i": 0, "point": Point(0)}, 1, None]
    # a strict mesh never unpickles: no value, and result_error says why (as status does)
    strict = m.client(output=False, strict=True).wait(job_id, timeout=60)
    assert [r["result"] for r in strict] == [None, None, None]
    assert all("strict=True" in r["result_error"] for r in strict[:2]), strict
    assert "result_error" not in strict[2]
    # waiting released nothing: the caller still gets every value, and then releases them
    assert sorted(it, key=lambda iv: iv[0])[:2] == [(0, {"i": 0, "point": Point(0)}), (1, 1)]
    deadline = time.monotonic() + 15
    while not other.status(job_id)["released"]:
        assert time.monotonic() < deadline, "the job was never released"
        time.sleep(0.1)
    with pytest.raises(RequestRejected, match="results were released: collected by its caller") as e:
        other.wait(job_id, timeout=10)
    assert e.value.status == 410


def train_model(lr, epochs):
    return {"lr": lr, "epochs": epochs, "accuracy": round(0.90 + lr, 3)}


def test_the_spec_job_management_block_as_written(make_mesh, tmp_path, monkeypatch):
    pytest.importorskip("pandas")
    m = make_mesh(workers=1, slots=2)
    data = tmp_path / "data"
    data.mkdir()
    (data / "data.csv").write_text("a,b\n1,2\n3,4\n5,6\n")
    monkeypatch.chdir(tmp_path)                                 # script="process.py" is relative
    (tmp_path / "process.py").write_text(f"""\
import csv, json, os, sys
p = json.load(sys.stdin)
with open(os.path.join({str(data)!r}, p["file"])) as fh:
    rows = list(csv.DictReader(fh))
print(json.dumps({{"file": p["file"], "rows": len(rows), "sum_a": sum(int(r["a"]) for r in rows)}}))
""")
    TOKEN = m.token
    mesh = GPUMesh(m.url, token=TOKEN)
    results = mesh.distribute(
        function=train_model,
        params=[{"lr": 0.01, "epochs": 100}, {"lr": 0.05, "epochs": 200}],
        timeout=600,
    )
    # -- the spec's block, verbatim --
    job_id = mesh.submit(name="preprocess", script="process.py",
                         payloads=[{"file": "data.csv"}])
    status = mesh.status(job_id)
    df     = mesh.results_to_dataframe(results)   # requires pandas
    # --
    assert list(df.columns) == ["lr", "epochs", "accuracy"]
    assert df.to_dict("records") == [{"lr": 0.01, "epochs": 100, "accuracy": 0.91},
                                     {"lr": 0.05, "epochs": 200, "accuracy": 0.95}]
    assert status["id"] == job_id and status["name"] == "preprocess" and status["kind"] == "script"
    assert status["n_tasks"] == 1 and status["state"] in ("active", "finished")
    deadline = time.monotonic() + 60
    while status["state"] != "finished":
        assert time.monotonic() < deadline, status
        time.sleep(0.1)
        status = mesh.status(job_id)
    assert status["tasks"][0]["result"] == {"file": "data.csv", "rows": 3, "sum_a": 9}
    frame = mesh.results_to_dataframe(status)                   # a status view works too
    assert frame[["index", "state", "file", "rows", "sum_a"]].to_dict("records") == [
        {"index": 0, "state": "done", "file": "data.csv", "rows": 3, "sum_a": 9}]


def sweep_point(i):
    if i in (13, 57):
        raise ValueError(f"bad point {i}")
    if i == 5:
        print("hello from point 5")
    return i


def test_a_big_jobs_status_lists_its_failures_by_item_and_logs_only_what_printed(make_mesh):
    from gpumesh import accelerate
    from gpumesh.cli.jobs import SUMMARY_ABOVE_TASKS
    m = make_mesh(workers=1, slots=4)
    mesh = m.client(output=False)
    n = SUMMARY_ABOVE_TASKS + 20
    got = accelerate(mesh)(sweep_point).map(range(n), return_exceptions=True)
    assert [type(v).__name__ for v in got if not isinstance(v, int)] == ["ValueError"] * 2
    (job,) = mesh.jobs(limit=1)
    jid = job["id"]
    ids = {t["index"]: t["id"] for t in mesh.status(jid)["tasks"]}

    # as frames: the failed items' rows say why; the results and a status view alike
    df = mesh.results_to_dataframe(got)
    assert list(df.columns) == ["result", "error"]
    assert df["result"].isna().tolist() == [i in (13, 57) for i in range(n)]
    assert df["error"].tolist() == [f"ValueError: bad point {i}" if i in (13, 57) else None
                                    for i in range(n)]
    view = mesh.results_to_dataframe(mesh.status(jid.upper()))  # (an id in capitals too)
    assert view["state"].tolist() == ["failed" if i in (13, 57) else "done" for i in range(n)]
    assert view["error"].tolist() == df["error"].tolist()

    # above SUMMARY_ABOVE_TASKS tasks: the failed ones, each with its item, and how to see all
    r = cli(m, "status", jid)
    assert r.returncode == 1, r.stderr
    lines = r.stdout.splitlines()
    tasks = [ln for ln in lines if " task " in ln and ln.startswith("  ")]
    assert [ln.split("  worker=")[0] for ln in tasks] == [
        f"  ✗ task {ids[i]} [failed]  cost=1.0" for i in (13, 57)], lines
    assert [ln.rsplit("  ", 1)[1] for ln in tasks] == ["item=13", "item=57"]
    assert "    error: ValueError: bad point 13" in lines
    assert lines[-1] == (f"  listed: the 2 failed of {n} tasks; every task: gpumesh status {jid} --all, "
                         f"or one state: --state STATE (pending, leased, done, failed, cancelled)")
    assert len(r.stdout) < 2000

    # --all: every task, in item order; --state: only those
    every = [ln for ln in cli(m, "status", jid, "--all").stdout.splitlines() if " task " in ln]
    assert [ln.rsplit("item=", 1)[1] for ln in every] == [str(i) for i in range(n)]
    done = [ln for ln in cli(m, "status", jid, "--state", "done").stdout.splitlines() if " task " in ln]
    assert len(done) == n - 2 and all("[done]" in ln for ln in done)
    assert "item=13" not in "".join(done)
    j = json.loads(cli(m, "status", jid, "--state", "failed", "--json").stdout)
    assert [(t["index"], t["state"]) for t in j["tasks"]] == [(13, "failed"), (57, "failed")]
    assert "(no task is cancelled)" in cli(m, "status", jid, "--state", "cancelled").stdout
    r = cli(m, "status", jid, "--all", "--state", "failed")  # one would do nothing: usage error
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip() == "Error: --all lists every task and --state only some: drop one"

    # logs: only the task that printed, and one line for the rest
    r = cli(m, "logs", jid)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [f"=== task {ids[5]} (#5, done)", "hello from point 5",
                                     f"({n - 1} of {n} task(s) printed nothing; not shown)"]
    r = cli(m, "logs", jid, "--task", ids[6])
    assert r.stdout.splitlines() == [f"(task {ids[6]} (#6, done) printed nothing)"]
