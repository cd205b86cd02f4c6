"""The caller's own modules travel with its functions (gpumesh.localcode): a user's script
run as ``python main.py`` next to ``helper.py`` and a package ``mypkg/``, which the workers
cannot import (their working directory and PYTHONPATH are elsewhere), gets the right
values; with ``GPUMESH_SHIP_LOCAL=0`` it gets the ModuleNotFoundError naming ``helper``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

RUN_TIMEOUT_S = 120

HELPER = """\
class Point:
    def __init__(self, x):
        self.x = x

    def __eq__(self, other):
        return isinstance(other, Point) and other.x == self.x


def preprocess(p):
    return p.x * 10
"""

MAIN = """\
import json
import os
import sys

from gpumesh import mesh

from helper import Point, preprocess
from mypkg import maths

@mesh
def f(x):
    return preprocess(Point(x)) + maths.triple(x), os.getcwd()

@mesh
def make_point(x):
    return Point(x + 1)

value, cwd = f(2)
mapped = f.map([1, 2, 3])
p = make_point(4)
print(json.dumps({
    "value": value,
    "mapped": [v for v, _ in mapped],
    "cwds": sorted({cwd} | {c for _, c in mapped}),
    "point_x": p.x,
    "isinstance": isinstance(p, Point),
    "here": os.getcwd(),
}))
"""


def _project(tmp_path: Path) -> Path:
    proj = tmp_path / "proj"
    (proj / "mypkg").mkdir(parents=True)
    (proj / "helper.py").write_text(HELPER)
    (proj / "mypkg" / "__init__.py").write_text("")
    (proj / "mypkg" / "maths.py").write_text("def triple(x):\n    return 3 * x\n")
    (proj / "main.py").write_text(MAIN)
    return proj


def _run(proj: Path, mesh, tmp_path: Path, **extra: str) -> subprocess.CompletedProcess:
    home = tmp_path / f"home-{len(list(tmp_path.glob('home-*')))}"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUMESH_")}
    env.update(HOME=str(home), GPUMESH_CONFIG=str(home / "config.json"), GPUMESH_DISCOVERY="0",
               PYTHONUNBUFFERED="1", GPUMESH_URL=mesh.url, GPUMESH_TOKEN=mesh.token, **extra)
    return subprocess.run([sys.executable, "main.py"], env=env, cwd=proj, capture_output=True,
                          text=True, timeout=RUN_TIMEOUT_S, stdin=subprocess.DEVNULL)


def test_a_scripts_own_modules_travel_with_its_functions(make_mesh, tmp_path):
    mesh = make_mesh(workers=2)
    proj = _project(tmp_path)
    # the workers cannot import the project's modules
    for d in [os.getcwd(), *filter(None, mesh.env.get("PYTHONPATH", "").split(os.pathsep))]:
        assert not (Path(d) / "helper.py").exists() and not (Path(d) / "mypkg").exists()
    r = _run(proj, mesh, tmp_path)
    report = f"exit {r.returncode}\n--- stdout\n{r.stdout}\n--- stderr\n{r.stderr}"
    assert r.returncode == 0, report
    assert "connected to coordinator" in r.stderr, report
    assert "running locally" not in r.stderr, report
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["value"] == 2 * 10 + 3 * 2
    assert got["mapped"] == [13, 26, 39]
    assert got["point_x"] == 5
    assert got["isinstance"] is True  # the caller's own class, not a copy of it
    assert str(proj) not in got["cwds"] and got["here"] == str(proj)  # ran on the workers


def test_with_ship_local_0_the_worker_lacks_the_module(make_mesh, tmp_path):
    mesh = make_mesh(workers=1)
    proj = _project(tmp_path)
    r = _run(proj, mesh, tmp_path, GPUMESH_SHIP_LOCAL="0")
    assert r.returncode != 0, r.stdout
    assert "ModuleNotFoundError: No module named 'helper' on any worker" in r.stderr, r.stderr


def test_an_import_inside_the_function_body_still_needs_the_module_on_the_worker(make_mesh,
                                                                                tmp_path):
    mesh = make_mesh(workers=1)
    proj = _project(tmp_path)
    (proj / "main.py").write_text(textwrap.dedent("""\
        import helper  # loaded here, so it is sent; but the body imports it by name
        from gpumesh import mesh

        @mesh
        def f(x):
            import helper as h
            return h.preprocess(h.Point(x))

        print(f(1))
        """))
    r = _run(proj, mesh, tmp_path)
    assert r.returncode != 0, r.stdout
    assert "ModuleNotFoundError: No module named 'helper' on any worker" in r.stderr, r.stderr
    # which is the caller's own module: the error says how to make it travel
    assert ("But 'helper' is one of this caller's own modules, which travel with the function "
            "by value only where it uses them from module level: an `import helper` inside the "
            "function's body runs on the worker, by name. Import it at the top of your script "
            "(module level) instead") in r.stderr, r.stderr
    # not shipped (GPUMESH_SHIP_LOCAL=0): importing it at the top would not help, nor is it said
    r = _run(proj, mesh, tmp_path, GPUMESH_SHIP_LOCAL="0")
    assert "No module named 'helper' on any worker" in r.stderr, r.stderr
    assert "one of this caller's own modules" not in r.stderr, r.stderr


def test_a_module_the_task_configures_or_caches_in_is_one_module_on_the_worker(make_mesh,
                                                                              tmp_path):
    # What a task sets in the caller's module is what that module's own functions read,
    # and a cache the module keeps is the one the task sees (gpumesh.namespaces).
    mesh = make_mesh(workers=1)
    proj = _project(tmp_path)
    (proj / "settings.py").write_text(textwrap.dedent("""\
        THRESHOLD = 1
        LOADS = 0
        _MODEL = None

        def above(xs):
            return [x for x in xs if x > THRESHOLD]

        def load():
            global _MODEL, LOADS
            if _MODEL is None:
                LOADS += 1
                _MODEL = object()
            return _MODEL
        """))
    (proj / "main.py").write_text(textwrap.dedent("""\
        import json
        import os
        from gpumesh import mesh
        import settings
        from settings import above

        settings.THRESHOLD = 2  # configured by the caller before the calls

        @mesh
        def task(t):
            before = above([1, 2, 3, 4])
            settings.THRESHOLD = t
            same = settings.load() is settings._MODEL
            return before, settings.above([1, 2, 3, 4]), settings.LOADS, same, os.getcwd()

        print(json.dumps({"task": task.map([3, 1]), "job": task.map([3, 3], isolation="job"),
                          "caller": settings.THRESHOLD}))
        """))
    r = _run(proj, mesh, tmp_path)
    assert r.returncode == 0, r.stderr
    assert "running locally" not in r.stderr, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert [row[:4] for row in got["task"]] == [[[3, 4], [4], 1, True], [[3, 4], [2, 3, 4], 1, True]]
    assert [row[1:4] for row in got["job"]] == [[[4], 1, True]] * 2
    assert str(proj) not in {row[4] for row in got["task"] + got["job"]}  # ran on the worker
    assert got["caller"] == 2


def test_an_import_of_the_callers_own_module_only_in_the_body_says_to_import_it_at_the_top(
        make_mesh, tmp_path):
    # helper.py lies next to the script but only the function's body imports it: the
    # error said "install it there (or join a worker that has it) and call again".
    mesh = make_mesh(workers=1)
    proj = _project(tmp_path)
    (proj / "main.py").write_text(textwrap.dedent("""\
        import sys
        from gpumesh import mesh

        @mesh
        def f(x):
            import helper
            return helper.preprocess(helper.Point(x))

        try:
            f(1)
        finally:
            print("imported here:", "helper" in sys.modules)
        """))
    r = _run(proj, mesh, tmp_path)
    assert r.returncode != 0, r.stdout
    assert "running locally" not in r.stderr, r.stderr
    assert "imported here: False" in r.stdout, r.stdout
    assert "ModuleNotFoundError: No module named 'helper' on any worker that could run this " \
           "task: " in r.stderr, r.stderr
    assert ("lacks it. But 'helper' is one of this caller's own modules, which travel with the "
            "function by value only where it uses them from module level: an `import helper` "
            "inside the function's body runs on the worker, by name. Import it at the top of "
            "your script (module level) instead") in r.stderr, r.stderr
    assert "install it there" not in r.stderr and "call again" not in r.stderr, r.stderr


def test_a_value_of_the_callers_module_that_cannot_be_pickled_stays_behind(make_mesh, tmp_path):
    # lockmod's _lock cannot be pickled; the task reads lockmod (so its namespace travels)
    # but never _lock: it failed with "global 'lockmod' of the function b cannot be sent".
    mesh = make_mesh(workers=1)
    proj = _project(tmp_path)
    (proj / "lockmod.py").write_text(textwrap.dedent("""\
        import threading
        _lock = threading.Lock()
        LIMIT = 2

        def above(xs):
            return [x for x in xs if x > LIMIT]
        """))
    (proj / "main.py").write_text(textwrap.dedent("""\
        import json
        import os
        import lockmod
        from gpumesh import mesh

        @mesh
        def b(xs):
            return lockmod.above(xs), os.getcwd()

        @mesh
        def needs_it():
            with lockmod._lock:
                return 1

        value, cwd = b([1, 2, 3, 4])
        try:
            needs_it()
            error = None
        except AttributeError as e:
            error = str(e).split(" (needs_it()")[0]
        print(json.dumps({"value": value, "cwd": cwd, "error": error}))
        """))
    r = _run(proj, mesh, tmp_path)
    assert r.returncode == 0, r.stderr
    assert "running locally" not in r.stderr, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["value"] == [3, 4] and got["cwd"] != str(proj)  # ran on the worker
    assert got["error"] == (
        "module 'lockmod' has no attribute '_lock' here: it stayed on the caller, because its "
        "value cannot be pickled (TypeError: cannot pickle '_thread.lock' object), so it did "
        "not travel with the function. A task that needs it must make its own (inside the "
        "function, or lazily in the module), or it must be made picklable")
