"""Choosing the task runtime: ``gpumesh join --runtime fork|spawn`` / ``$GPUMESH_RUNTIME``."""

from __future__ import annotations

import json
import subprocess
import sys

from gpumesh import accelerate

from ..conftest import Proc, wait_for


def _join(m, tmp_path, name, *extra, env=None):
    proc = Proc(["join", m.url, "--slots", "1", *extra], dict(m.env, **(env or {})),
                tmp_path / f"{name}.log")
    m.procs.append(proc)
    return proc


def test_spawn_runtime_runs_tasks_in_processes_the_agent_started(make_mesh, tmp_path):
    m = make_mesh(workers=0)
    spawn = _join(m, tmp_path, "spawn", "--runtime", "spawn", env={"GPUMESH_RUNTIME": "fork"})
    m.wait_alive(1, spawn)
    wait_for(lambda: "runtime: spawn (--runtime=spawn)" in spawn.output(), 10, "the banner")

    @accelerate(m.client(output=False))
    def parent(i):
        import os
        return os.getppid(), os.getpid()

    got = parent.map(range(4))
    assert {ppid for ppid, _ in got} == {spawn.p.pid}  # spawned by the agent itself
    assert len({pid for _, pid in got}) == 4
    spawn.stop()
    fork = _join(m, tmp_path, "fork", env={"GPUMESH_RUNTIME": "fork"})
    m.wait_alive(1, fork)
    wait_for(lambda: "runtime: fork ($GPUMESH_RUNTIME=fork)" in fork.output(), 10, "the banner")
    got = parent.map(range(2))
    assert fork.p.pid not in {ppid for ppid, _ in got}  # forked by the function's host


def test_a_bad_runtime_is_refused_before_joining(make_mesh, tmp_path):
    m = make_mesh(workers=0)
    bad = _join(m, tmp_path, "bad", env={"GPUMESH_RUNTIME": "threads"})
    assert bad.p.wait(60) == 2
    assert "$GPUMESH_RUNTIME='threads': the runtime must be 'fork' or 'spawn'" in bad.output()
    assert m.alive() == 0


def test_doctor_says_which_runtime_and_why(tmp_path):
    env = {"HOME": str(tmp_path), "GPUMESH_RUNTIME": "spawn", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "gpumesh", "doctor", "--json"], env=env,
                         capture_output=True, text=True, timeout=120)
    checks = {c["name"]: c for c in json.loads(out.stdout)["checks"]}
    assert checks["runtime"]["status"] == "ok"
    assert checks["runtime"]["detail"].startswith("spawn: $GPUMESH_RUNTIME=spawn")


def test_a_tasks_stdin_is_open_and_empty_on_both_runtimes(make_mesh, tmp_path):
    # Libraries ask sys.stdin.isatty(); a subprocess inherits descriptor 0. Both runtimes
    # give a task the same stdin: os.devnull, open (spawn's was closed: ValueError).
    m = make_mesh(workers=0)

    @accelerate(m.client(output=False))
    def stdin_facts():
        import os
        import subprocess
        import sys
        try:
            input()
            eof = False
        except EOFError:
            eof = True
        inherited = subprocess.run([sys.executable, "-c", "import sys; print(len(sys.stdin.read()))"],
                                   capture_output=True, text=True, timeout=60).stdout.strip()
        return (sys.stdin.isatty(), sys.stdin.fileno(), eof, inherited,
                os.path.samefile("/proc/self/fd/0", os.devnull))

    for runtime in ("spawn", "fork"):
        proc = _join(m, tmp_path, runtime, "--runtime", runtime)
        m.wait_alive(1, proc)
        assert stdin_facts() == (False, 0, True, "0", True), runtime
        proc.stop()
        wait_for(lambda: m.alive() == 0, 10, "the worker to leave")



def test_a_task_gets_its_share_of_the_cores_as_thread_caps(make_mesh, tmp_path):
    # --cpu-slots 2: each task's math libraries get cores // 2 threads (at least 1), as
    # Dask's and Ray's workers cap them; a cap the owner set for `join` stands.
    import os

    from gpumesh.worker.procs import THREAD_VARS
    m = make_mesh(workers=0)

    @accelerate(m.client(output=False))
    def caps():
        import os
        return {name: os.environ.get(name) for name in THREAD_VARS}

    share = str(max(1, (os.cpu_count() or 1) // 2))
    for runtime in ("fork", "spawn"):
        proc = _join(m, tmp_path, f"share-{runtime}", "--runtime", runtime, "--cpu-slots", "2",
                     env={"OMP_NUM_THREADS": "3"})
        m.wait_alive(1, proc)
        got = caps()
        assert got == {**{name: share for name in THREAD_VARS}, "OMP_NUM_THREADS": "3"}, runtime
        proc.stop()
        wait_for(lambda: m.alive() == 0, 10, "the worker to leave")
