"""The messages docs/troubleshooting.md quotes are what gpumesh really prints.

Each scenario is produced for real (a refused token, nothing listening, a module a worker
lacks) and its output line must appear in the guide, after the guide's placeholders are
put in: ``http://HOST:8000`` for the coordinator's URL, ``torch`` for the missing module,
any 12-hex-digit task or worker id, and the function and host a notice names.
"""

from __future__ import annotations

import platform
import re
import subprocess
import sys
from pathlib import Path


from ..conftest import Proc, free_port, wait_for

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "troubleshooting.md"
WRONG = "not-the-token-0123456789abcdef"
IDS = re.compile(r"\b[0-9a-f]{12}\b")
#: the function and the worker's host name that a task's error and notice name
WHERE = re.compile(r"[\w.]+\([^)]*\) on worker ")
HOST = platform.node()  # the name a worker reports


def placeholders(text: str) -> str:
    text = text.replace(f"{HOST} (", "laptop-b (").replace(platform.python_version(), "3.11.7")
    return WHERE.sub("FN() on worker ", IDS.sub("ID", text))


def normalised(line: str, module: str | None = None) -> str:
    line = re.sub(r"https?://127\.0\.0\.1:\d+", "http://HOST:8000", line.strip())
    if module:
        line = line.replace(f"'{module}'", "'torch'")
    return placeholders(line)


def assert_quoted(line: str, module: str | None = None) -> None:
    guide = placeholders(GUIDE.read_text(encoding="utf-8"))
    want = normalised(line, module)
    assert want in guide, f"docs/troubleshooting.md does not quote what gpumesh prints:\n{want}"


def gpumesh(args: list[str], env: dict, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpumesh", *args], env=env, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def test_a_refused_token_as_join_and_the_other_commands_print_it(make_mesh):
    m = make_mesh()
    env = dict(m.env, GPUMESH_TOKEN=WRONG)
    r = gpumesh(["workers", "--url", m.url], env)
    assert r.returncode == 1 and r.stdout == ""
    assert_quoted(r.stderr.strip())
    r = gpumesh(["join", m.url], env)
    assert r.returncode == 1
    assert_quoted(r.stderr.strip().splitlines()[-1])


def test_nothing_listening_as_a_command_and_a_worker_print_it(make_mesh, tmp_path):
    m = make_mesh()
    url = f"http://127.0.0.1:{free_port()}"
    r = gpumesh(["workers", "--url", url], m.env)
    assert r.returncode == 1
    assert_quoted(r.stderr.strip())
    worker = Proc(["join", url], m.env, tmp_path / "worker.log")
    try:
        line = wait_for(lambda: next((x for x in worker.output().splitlines()
                                      if "unreachable" in x), None), 30, "the retry line")
    finally:
        worker.stop()
    assert_quoted(line)


def test_a_module_the_worker_lacks_arrives_as_the_guide_says(make_mesh, tmp_path):
    m = make_mesh(workers=1)
    here_only = tmp_path / "caller-only"          # importable by the caller, not the worker
    (here_only / "gm_doc_here_only").mkdir(parents=True)
    (here_only / "gm_doc_here_only" / "__init__.py").write_text("VALUE = 1\n")
    script = tmp_path / "calls.py"
    script.write_text(
        "import sys\n"
        "import gm_doc_here_only\n"
        "from gpumesh import mesh\n\n"
        "@mesh\n"
        "def inside():\n"
        "    import gm_doc_missing_everywhere\n\n"
        "@mesh\n"
        "def uses_module():\n"
        "    return gm_doc_here_only.VALUE\n\n"
        "inside() if sys.argv[1] == 'inside' else uses_module()\n")
    env = {k: v for k, v in m.env.items() if k != "GPUMESH_CONFIG"}
    env.update(GPUMESH_URL=m.url, PYTHONPATH=str(here_only))

    r = subprocess.run([sys.executable, str(script), "inside"], env=env, capture_output=True,
                       text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ModuleNotFoundError: No module named 'gm_doc_missing_everywhere'")
    assert_quoted(last, "gm_doc_missing_everywhere")

    # The caller's own module (on its path only, installed nowhere) travels by value: the
    # call runs; with that turned off (GPUMESH_SHIP_LOCAL=0) the worker lacks it, as the
    # guide says.
    r = subprocess.run([sys.executable, str(script), "module"], env=env, capture_output=True,
                       text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, str(script), "module"], capture_output=True, text=True,
                       env=dict(env, GPUMESH_SHIP_LOCAL="0"), timeout=120, cwd=tmp_path)
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ModuleNotFoundError: No module named 'gm_doc_here_only' on any worker")
    assert_quoted(last, "gm_doc_here_only")


def test_the_doctor_sample_is_what_doctor_prints(make_mesh):
    from gpumesh import __version__
    m = make_mesh(workers=2)  # two: the pool packages line appears
    env = {k: v for k, v in m.env.items() if k != "GPUMESH_TOKEN"}  # the saved config only
    r = gpumesh(["doctor"], env)
    assert r.returncode == 0, r.stdout + r.stderr
    guide = GUIDE.read_text(encoding="utf-8")
    checked = 0
    quoted = ("[OK]   coordinator", "[OK]   token", "[OK]   cloudpickle", "[OK]   pool packages",
              *(("[OK]   runtime",) if sys.platform == "linux" else ()))  # (the sample's is Linux's)
    for line in r.stdout.splitlines():
        if line.startswith(quoted) or line.startswith("all checks"):
            line = line.replace(f"127.0.0.1:{m.port}", "127.0.0.1:8000")
            line = line.replace(f"gpumesh {__version__}", "gpumesh 0.1.0")
            line = re.sub(r"version \S+ \(every", "version 3.1.3 (every", line)
            line = re.sub(r"the same \d+ Python", "the same 87 Python", line)
            assert line in guide, f"docs/troubleshooting.md's doctor sample lacks:\n{line}"
            checked += 1
    assert checked == 4 + len(quoted) - 3, r.stdout
