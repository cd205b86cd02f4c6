"""Sweeps that survive their own failures, on real meshes: ``return_exceptions``,
``imap`` (results as they finish, closing cancels the rest), errors that name the item,
the worker and the user's own file and line, ``retries``/``retry_on``, and the CLI's
account of it all (progress, ``jobs``, ``logs``)."""

from __future__ import annotations

import json
import linecache
import socket
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpumesh import RemoteTraceback, accelerate
from gpumesh.cli import main

from ..conftest import Mesh, wait_for


def invoke(m: Mesh, *args: str):
    env = {"GPUMESH_URL": m.url, "GPUMESH_TOKEN": m.token, "GPUMESH_CONFIG": m.env["GPUMESH_CONFIG"],
           "GPUMESH_PROGRESS": "0"}
    return CliRunner().invoke(main, list(args), env=env, catch_exceptions=False)


def user_code(tmp_path: Path, source: str, filename: str | None = None) -> dict:
    """Compile ``source`` as a user's script or notebook cell would be: a real file name
    (or an IPython-style cell name kept in linecache), run as ``__main__`` so that its
    functions travel by value."""
    if filename is None:
        path = tmp_path / "sweep_user.py"
        path.write_text(source)
        filename = str(path)
    else:  # what IPython does with a cell: no file, the lines in linecache
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    ns = {"__name__": "__main__"}
    exec(compile(source, filename, "exec"), ns)
    return ns


SWEEP = """\
def train(lr, epochs=1):
    if lr in (5, 13):
        raise ValueError(f"diverged at lr={lr}")
    return {"lr": lr, "score": lr * epochs}
"""


@pytest.fixture
def mesh2(make_mesh):
    return make_mesh(workers=2)


def test_return_exceptions_keeps_the_other_results_in_order(mesh2, tmp_path):
    client = mesh2.client(output=False)
    train = accelerate(client)(user_code(tmp_path, SWEEP)["train"])
    items = [{"lr": i, "epochs": 2} for i in range(20)]
    got = train.map(items, return_exceptions=True)
    assert len(got) == 20
    for i, v in enumerate(got):
        if i in (5, 13):
            assert type(v) is ValueError and str(v) == f"diverged at lr={i}"
            assert isinstance(v.__cause__, RemoteTraceback) and v.__cause__.index == i
        else:
            assert v == {"lr": i, "score": 2 * i}
    job = client.jobs(limit=1)[0]
    assert job["counts"] == {"done": 18, "failed": 2}  # nothing was cancelled
    # distribute() takes it too, with the same meaning
    again = client.distribute(train, items[4:7], return_exceptions=True)
    assert again[0] == {"lr": 4, "score": 8} and type(again[1]) is ValueError
    assert again[2] == {"lr": 6, "score": 12}


def test_map_progress_counts_failures_apart(mesh2, tmp_path, monkeypatch):
    from gpumesh.client import pipeline
    from gpumesh.client.progress import Progress
    seen = []

    class Recording(Progress):
        def update(self, done, total=None, *, failed=0, cancelled=0):
            seen.append((done, failed, cancelled))
            super().update(done, total, failed=failed, cancelled=cancelled)

    monkeypatch.setattr(pipeline, "Progress", Recording)
    client = mesh2.client(output=False)
    train = accelerate(client)(user_code(tmp_path, SWEEP)["train"])
    train.map([{"lr": i} for i in range(20)], return_exceptions=True)
    assert seen[-1] == (20, 2, 0)  # 20 final, of which 2 failed: not "20/20 done"
    assert [d for d, _, _ in seen] == sorted(d for d, _, _ in seen)


def test_default_first_failure_raises_and_says_how_to_keep_going(mesh2, tmp_path):
    client = mesh2.client(output=False)
    train = accelerate(client)(user_code(tmp_path, SWEEP)["train"])
    with pytest.raises(ValueError, match="diverged at lr=5") as ei:
        train.map([{"lr": i} for i in range(4, 8)])
    text = "\n".join(getattr(ei.value, "__notes__", [])) + str(ei.value.__cause__)
    assert "return_exceptions=True" in text and "cancelled" in text
    assert ".map item 1 of 4, train(lr=5)," in text


STUCK_OR_DEAD = """\
import os, time

def step(i):
    if i == 1:
        os._exit(3)
    if i == 2:
        time.sleep(30)
    return i
"""


def test_a_crashed_or_timed_out_item_says_where_as_attributes_too(mesh2, tmp_path, monkeypatch):
    """gpumesh's own errors in a return_exceptions sweep carry where the task ran as
    attributes (.index, .task_id, .worker, .hostname, .attempt), as a function's own
    exception's RemoteTraceback cause does: a TaskTimeout too, on the mesh and locally."""
    from gpumesh import TaskCrashed, TaskTimeout
    client = mesh2.client(output=False)
    step = accelerate(client)(user_code(tmp_path, STUCK_OR_DEAD)["step"])
    got = step.map([0, 1, 2], return_exceptions=True, timeout=2)
    assert got[0] == 0
    crashed, timed_out = got[1], got[2]
    assert type(crashed) is TaskCrashed and type(timed_out) is TaskTimeout
    workers = {w["id"]: w["hostname"] for w in mesh2.workers()}
    # (a crash's message counts its attempts, "attempt 3 of 3": said once, not again here)
    for exc, index, attempt, said in [(crashed, 1, 3, ""), (timed_out, 2, 1, "attempt 1, ")]:
        assert (exc.index, exc.attempt) == (index, attempt), exc
        assert exc.worker in workers and exc.hostname == workers[exc.worker]
        assert exc.task_id and f".map item {index} of 3, step({index}), on worker {exc.hostname} " \
            f"({exc.worker}), {said}task {exc.task_id}" in str(exc)
        assert str(exc).count(f"attempt {attempt}") == 1, exc
    # the same sweep run locally (no mesh): the item is an attribute there too
    monkeypatch.setenv("GPUMESH_LOCAL", "1")
    local = step.map([0, 2], return_exceptions=True, timeout=1)
    assert local[0] == 0 and type(local[1]) is TaskTimeout and local[1].index == 1
    assert ".map item 1 of 2, step(2), on " in str(local[1])


def test_remote_traceback_names_item_worker_and_the_users_file_and_line(mesh2, tmp_path):
    client = mesh2.client(output=False)
    ns = user_code(tmp_path, SWEEP)
    cell = user_code(tmp_path, "import math\n\ndef cell_fn(x):\n    return math.sqrt(-x)\n",
                     filename="<ipython-input-3-5f2a9c1e0b7d>")
    train, cell_fn = accelerate(client)(ns["train"]), accelerate(client)(cell["cell_fn"])
    got = train.map([{"lr": i} for i in range(8)], return_exceptions=True)
    exc = got[5]
    cause = exc.__cause__
    assert isinstance(cause, RemoteTraceback)
    path = str(tmp_path / "sweep_user.py")
    assert f'File "{path}", line 3, in train' in cause.tb
    assert 'raise ValueError(f"diverged at lr={lr}")' in cause.tb
    assert "runner.py" not in cause.tb  # starts in the user's code, not gpumesh's
    workers = {w["id"]: w["hostname"] for w in mesh2.workers()}
    assert cause.index == 5 and cause.attempt == 1 and cause.worker in workers
    assert cause.hostname == workers[cause.worker] == socket.gethostname()
    if sys.version_info >= (3, 11):
        note = exc.__notes__[-1]
        assert f".map item 5 of 8, train(lr=5), on worker {cause.hostname} ({cause.worker}), " \
               f"attempt 1, task {cause.task_id}" in note
    # a notebook cell: the cell's name and line, and the line's text from this kernel
    with pytest.raises(ValueError, match="math domain error") as ei:
        cell_fn(4)
    tb = ei.value.__cause__.tb
    assert 'File "<ipython-input-3-5f2a9c1e0b7d>", line 4, in cell_fn' in tb
    assert "    return math.sqrt(-x)" in tb
    assert "<dynamic-code>" not in tb


def test_traceback_of_a_module_shipped_by_value_names_its_file(mesh2, tmp_path, monkeypatch):
    import importlib

    import cloudpickle
    (tmp_path / "caller_only_mod.py").write_text(
        "def parse(text):\n    value = int(text)\n    return value * 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    mod = importlib.import_module("caller_only_mod")  # only the caller has it: sent by value
    cloudpickle.register_pickle_by_value(mod)
    try:
        parse = accelerate(mesh2.client(output=False))(mod.parse)
        got = parse.map(["1", "x", "3"], return_exceptions=True)
    finally:
        cloudpickle.unregister_pickle_by_value(mod)
        sys.modules.pop("caller_only_mod", None)
    assert got[0] == 2 and got[2] == 6 and type(got[1]) is ValueError
    tb = got[1].__cause__.tb
    assert f'File "{tmp_path / "caller_only_mod.py"}", line 2, in parse' in tb
    assert "    value = int(text)" in tb and "<dynamic-code>" not in tb


def test_imap_yields_every_index_once_as_tasks_finish(make_mesh, tmp_path):
    m = make_mesh(workers=2, slots=2)
    client = m.client(output=False)

    @accelerate(client)
    def slow_square(x):
        import time as _t
        _t.sleep(0.4 if x == 0 else 0.0)  # item 0 finishes late: order is completion order
        return x * x

    it = slow_square.imap(range(20))
    assert it.job_id is not None and len(it) == 20
    got = list(it)
    assert sorted(i for i, _ in got) == list(range(20))
    assert all(v == i * i for i, v in got)
    assert got[0][0] != 0  # the slow item did not hold the others back
    assert client.status(it.job_id)["counts"] == {"done": 20}
    # .map(ordered=False) is the same iterator
    assert sorted(slow_square.map([1, 2, 3], ordered=False)) == [(0, 1), (1, 4), (2, 9)]


def test_closing_imap_cancels_what_is_left_on_the_coordinator(make_mesh):
    m = make_mesh(workers=1)
    client = m.client(output=False)

    @accelerate(client)
    def step(x):
        import time as _t
        _t.sleep(0.3)
        return x

    taken = []
    with step.imap(range(20)) as it:
        for i, v in it:
            taken.append((i, v))
            if len(taken) == 2:
                break
    assert len(taken) == 2 and all(i == v for i, v in taken)
    counts = wait_for(lambda: (c := client.status(it.job_id)["counts"]).get("cancelled") and
                      not c.get("pending") and not c.get("leased") and c, 20, "the job to be cancelled")
    assert counts.get("done", 0) + counts["cancelled"] == 20 and counts["cancelled"] >= 15
    assert client.status(it.job_id)["state"] == "cancelled"
    # and an iterator that is simply dropped does the same
    it2 = step.imap(range(10))
    job = it2.job_id
    next(it2)
    del it2
    wait_for(lambda: client.status(job)["counts"].get("cancelled"), 20, "the dropped iterator's job cancelled")


def test_imap_with_return_exceptions_yields_failures_in_place(mesh2, tmp_path):
    client = mesh2.client(output=False)
    train = accelerate(client)(user_code(tmp_path, SWEEP)["train"])
    got = dict(train.imap([{"lr": i} for i in range(15)], return_exceptions=True))
    assert sorted(got) == list(range(15))
    # (in completion order: item 13 may finish before item 5)
    assert sorted(i for i, v in got.items() if isinstance(v, ValueError)) == [5, 13]


FLAKY = """\
import os

def flaky(i, marks):
    print(f"run of item {i}")
    with open(os.path.join(marks, "runs.log"), "a") as fh:
        fh.write(f"{i}\\n")
    first = os.path.join(marks, f"seen-{i}")
    if i % 3 == 0 and not os.path.exists(first):
        open(first, "w").close()
        raise OSError(f"disk busy for item {i}")
    if i % 3 == 1:
        raise ValueError(f"item {i} is wrong")
    if i == 8:
        raise FileNotFoundError(f"item {i} never finds its file")
    return i * 10
"""


def test_retry_on_reruns_only_the_named_types_elsewhere(mesh2, tmp_path):
    client = mesh2.client(output=False)
    marks = tmp_path / "marks"
    marks.mkdir()
    flaky = accelerate(client, retries=2, retry_on=(OSError,))(user_code(tmp_path, FLAKY)["flaky"])
    got = flaky.map([{"i": i, "marks": str(marks)} for i in range(9)], return_exceptions=True)
    for i, v in enumerate(got):
        if i == 8:  # FileNotFoundError is an OSError: retried twice, then the answer
            assert type(v) is FileNotFoundError and v.__cause__.attempt == 3
        elif i % 3 == 0:  # failed once with OSError, then returned
            assert v == i * 10
        elif i % 3 == 1:  # ValueError is not retried
            assert type(v) is ValueError and v.__cause__.attempt == 1
        else:
            assert v == i * 10
    runs = sorted(int(x) for x in (marks / "runs.log").read_text().split())
    # a result that was delivered is never re-run; a retried item runs once per attempt
    assert runs == sorted([0, 0, 1, 2, 3, 3, 4, 5, 6, 6, 7, 8, 8, 8])
    job = client.jobs(limit=1)[0]
    tasks = {t["index"]: t for t in client.status(job["id"])["tasks"]}
    for i in (0, 3, 6):
        t = tasks[i]
        assert t["state"] == "done" and t["attempts"] == 2
        (h,) = t["history"]
        assert h["attempt"] == 1 and h["retried"] is True and h["error"]["type"] == "OSError"
        assert h["worker"] != t["worker_id"]  # the second attempt ran on the other worker
    assert tasks[8]["attempts"] == 3 and len(tasks[8]["history"]) == 2
    assert all(tasks[i]["attempts"] == 1 and not tasks[i]["history"] for i in (1, 2, 4, 5, 7))
    # status shows the attempts; logs shows each attempt's output apart
    status = invoke(mesh2, "status", job["id"])
    assert "attempts=2" in status.output
    assert "attempt 1 on " in status.output and "OSError: disk busy for item 3" in status.output
    logs = invoke(mesh2, "logs", job["id"], "--task", tasks[3]["id"])
    assert logs.exit_code == 0, logs.output
    text = logs.output
    assert text.count("run of item 3") == 2
    first, second = text.index("--- attempt 1 on "), text.index("--- attempt 2 on ")
    assert first < text.index("run of item 3") < second < text.rindex("run of item 3")
    assert "raised OSError" in text[first:second]
    # every attempt, the last one too, is named by its worker's hostname and id
    host = {w["id"]: w["hostname"] for w in client.workers()}[tasks[3]["worker_id"]]
    assert f"--- attempt 2 on {host} ({tasks[3]['worker_id']}): done" in text
    as_json = invoke(mesh2, "logs", job["id"], "--task", tasks[3]["id"], "--json")
    (last,) = [a for a in json.loads(as_json.output)[0]["attempts"] if a["attempt"] == 2]
    assert last["hostname"] == host and last["worker"] == tasks[3]["worker_id"]


def test_without_retry_on_a_raised_exception_is_the_answer(mesh2, tmp_path):
    client = mesh2.client(output=False)
    marks = tmp_path / "marks"
    marks.mkdir()
    flaky = accelerate(client)(user_code(tmp_path, FLAKY)["flaky"])
    got = flaky.map([{"i": 0, "marks": str(marks)}], return_exceptions=True)
    assert type(got[0]) is OSError
    assert (marks / "runs.log").read_text().split() == ["0"]


def test_local_fallback_has_the_same_semantics(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUMESH_LOCAL", "1")
    from gpumesh import GPUMesh
    client = GPUMesh("http://127.0.0.1:9", token="x")
    train = accelerate(client)(user_code(tmp_path, SWEEP)["train"])
    got = train.map([{"lr": i} for i in range(7)], return_exceptions=True)
    assert [type(v).__name__ for v in got] == ["dict"] * 5 + ["ValueError", "dict"]
    assert [i for i, _ in train.imap(range(3))] == [0, 1, 2]
    marks = tmp_path / "marks"
    marks.mkdir()
    flaky = accelerate(client, retries=1, retry_on=OSError)(user_code(tmp_path, FLAKY)["flaky"])
    assert flaky.map([{"i": 3, "marks": str(marks)}]) == [30]
    assert (marks / "runs.log").read_text().split() == ["3", "3"]


def test_jobs_has_a_header_and_says_1_task(mesh2):
    client = mesh2.client(output=False)

    @accelerate(client)
    def one(x):
        return x

    assert one(1) == 1
    assert one.map([1, 2]) == [1, 2]
    r = invoke(mesh2, "jobs")
    lines = r.output.splitlines()
    assert lines[0].split() == ["JOB", "CREATED", "STATE", "TASKS", "COUNTS", "OWNER", "NAME"]
    assert "  1 task  " in lines[2] and "1 tasks" not in r.output
    assert "  2 tasks  " in lines[1]
    assert lines[0].index("TASKS") == lines[1].index("2 tasks") == lines[2].index("1 task")


def test_submit_wait_counts_failures_apart(make_mesh, tmp_path):
    m = make_mesh(workers=1)
    script = tmp_path / "half.py"
    script.write_text("import json, sys\np = json.load(sys.stdin)\n"
                      "if p['x'] == 2:\n    sys.exit('no')\nprint(json.dumps(p['x']))\n")
    payloads = tmp_path / "p.json"
    payloads.write_text("[{\"x\": 0}, {\"x\": 1}, {\"x\": 2}, {\"x\": 3}]")
    r = invoke(m, "submit", str(script), "--payloads", str(payloads), "--wait")
    assert r.exit_code == 1
    bar = next(line for line in r.output.splitlines() if "%" in line)
    assert "4/4 final: 3 done, 1 failed" in bar
    assert "4/4 done" not in r.output
