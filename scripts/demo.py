#!/usr/bin/env python3
"""What ``make demo`` runs: a two-worker mesh on loopback, then the grid search on it.

1. picks a free loopback port, a temporary state directory and a fresh token,
2. starts ``gpumesh serve`` (its self-worker is worker 1) and waits for ``/v1/health``,
3. starts ``gpumesh join`` (worker 2) and waits until the coordinator lists 2 alive workers,
4. prints ``gpumesh workers``, then runs ``examples/grid_search.py`` against the mesh,
5. always stops both processes (SIGINT, up to 10 s, then kill) and removes the directory.

Nothing outside the temporary directory is touched: every child gets
``GPUMESH_CONFIG=<tmp>/config.json`` and ``HOME=<tmp>/home``, the coordinator keeps its
data in ``<tmp>/data``. The coordinator's and workers' output goes to ``<tmp>/*.log``;
their tails are printed if anything fails. Pass ``--keep`` to keep the directory.

Exit status: that of the grid search; 1 if the mesh could not be started, 130 on Ctrl+C,
143 on SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GRID_SEARCH = ROOT / "examples" / "grid_search.py"

HEALTH_TIMEOUT_S = 20.0
WORKERS_TIMEOUT_S = 30.0
WORKERS_WANTED = 2
STOP_GRACE_S = 10.0
LOG_TAIL_LINES = 40

POSIX = os.name == "posix"

# Loopback only: never send these requests through an HTTP proxy from the environment.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class DemoError(Exception):
    """The mesh could not be brought up; the message says which step failed."""


class Terminated(Exception):
    """This script got SIGTERM."""


def say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


# -- setup ------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def new_token() -> str:
    while True:
        token = secrets.token_urlsafe(32)
        if not token.startswith("-"):  # would read as an option on the command line
            return token


def gpumesh_command() -> list[str]:
    """The ``gpumesh`` entry point of this interpreter's environment, else ``python -m gpumesh``."""
    bindir = Path(sys.executable).parent  # not resolved: a venv's python is often a symlink
    for name in ("gpumesh", "gpumesh.exe"):
        exe = bindir / name
        if exe.is_file() and os.access(exe, os.X_OK):
            return [str(exe)]
    return [sys.executable, "-m", "gpumesh"]


def child_env(tmp: Path) -> dict[str, str]:
    env = dict(os.environ)
    for key in ("GPUMESH_URL", "GPUMESH_TOKEN"):
        env.pop(key, None)
    home = tmp / "home"
    home.mkdir(exist_ok=True)
    env["GPUMESH_CONFIG"] = str(tmp / "config.json")
    env["HOME"] = str(home)
    env["PYTHONUNBUFFERED"] = "1"
    no_proxy = [p for p in env.get("NO_PROXY", env.get("no_proxy", "")).split(",") if p]
    no_proxy += [h for h in ("127.0.0.1", "localhost") if h not in no_proxy]
    env["NO_PROXY"] = env["no_proxy"] = ",".join(no_proxy)
    return env


# -- child processes --------------------------------------------------------------------
def start_service(cmd: list[str], log_path: Path, env: dict[str, str]) -> subprocess.Popen:
    """Start a long-running child in its own process group, output appended to ``log_path``.

    Its own group keeps a Ctrl+C in the terminal from reaching it directly: this script
    stops the services itself, in order, once the caller has finished.
    """
    kwargs: dict = {}
    if POSIX:
        kwargs["start_new_session"] = True
    else:
        kwargs["creationflags"] = subprocess.CREATE_NEW_PROCESS_GROUP
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            env=env, cwd=ROOT, **kwargs,
        )


def _group_alive(proc: subprocess.Popen) -> bool:
    """Whether the child (or, on POSIX, anything left in its process group) still runs."""
    leader_running = proc.poll() is None  # also reaps the leader once it has exited
    if not POSIX:
        return leader_running
    try:
        os.killpg(proc.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        if POSIX:
            os.killpg(proc.pid, sig)
        elif sig == signal.SIGINT:
            proc.send_signal(signal.CTRL_BREAK_EVENT)
        else:
            proc.kill()
    except (ProcessLookupError, PermissionError, OSError):
        pass


def stop_service(name: str, proc: subprocess.Popen | None) -> None:
    """SIGINT to the child's whole group (like Ctrl+C), up to 10 s, then SIGKILL."""
    if proc is None or not _group_alive(proc):
        return
    say(f"stopping {name} (pid {proc.pid})")
    _signal_group(proc, signal.SIGINT)
    deadline = time.monotonic() + STOP_GRACE_S
    while time.monotonic() < deadline:
        if not _group_alive(proc):
            return
        time.sleep(0.1)
    say(f"{name} did not stop within {STOP_GRACE_S:.0f} s; killing it")
    _signal_group(proc, signal.SIGKILL if POSIX else signal.SIGTERM)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def stop_foreground(name: str, proc: subprocess.Popen | None, interrupted: bool) -> None:
    """Stop a child that shares our process group (it already got any Ctrl+C)."""
    if proc is None or proc.poll() is not None:
        return
    if not interrupted:
        try:
            proc.send_signal(signal.SIGINT if POSIX else signal.CTRL_BREAK_EVENT)
        except OSError:
            pass
    try:
        proc.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        say(f"{name} did not stop within {STOP_GRACE_S:.0f} s; killing it")
        proc.kill()
        proc.wait()


# -- talking to the coordinator ---------------------------------------------------------
def get_json(url: str, token: str | None = None, timeout: float = 2.0):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with _OPENER.open(urllib.request.Request(url, headers=headers), timeout=timeout) as resp:
        return json.loads(resp.read() or b"null")


def wait_for_health(url: str, coordinator: subprocess.Popen) -> None:
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    last = "no answer yet"
    while time.monotonic() < deadline:
        if coordinator.poll() is not None:
            raise DemoError(f"the coordinator exited with status {coordinator.returncode} while starting")
        try:
            get_json(f"{url}/v1/health")
            return
        except urllib.error.HTTPError as exc:
            last = f"HTTP {exc.code}"
        except (OSError, ValueError) as exc:
            last = str(exc)
        time.sleep(0.2)
    raise DemoError(f"{url}/v1/health did not answer within {HEALTH_TIMEOUT_S:.0f} s ({last})")


def alive_workers(url: str, token: str) -> list[dict]:
    data = get_json(f"{url}/v1/workers", token)
    if isinstance(data, dict):  # tolerate {"workers": [...]}
        data = data.get("workers", [])
    return [w for w in data or [] if isinstance(w, dict) and w.get("alive")]


def wait_for_workers(url: str, token: str, services: dict[str, subprocess.Popen]) -> list[dict]:
    deadline = time.monotonic() + WORKERS_TIMEOUT_S
    alive: list[dict] = []
    last = ""
    while time.monotonic() < deadline:
        for name, proc in services.items():
            if proc.poll() is not None:
                raise DemoError(f"the {name} exited with status {proc.returncode}")
        try:
            alive = alive_workers(url, token)
            last = ""
        except urllib.error.HTTPError as exc:
            if exc.code in (401, 403):
                raise DemoError(f"the coordinator rejected the token (HTTP {exc.code})") from None
            last = f" (last error: HTTP {exc.code})"
        except (OSError, ValueError) as exc:
            last = f" (last error: {exc})"
        if len(alive) >= WORKERS_WANTED:
            return alive
        time.sleep(0.25)
    raise DemoError(
        f"{len(alive)} of {WORKERS_WANTED} workers alive after {WORKERS_TIMEOUT_S:.0f} s{last}"
    )


# -- reporting --------------------------------------------------------------------------
def print_log_tails(logs: list[Path]) -> None:
    for path in logs:
        try:
            lines = path.read_text(errors="replace").splitlines()
        except OSError:
            continue
        print(f"----- last {min(len(lines), LOG_TAIL_LINES)} lines of {path.name} -----", file=sys.stderr)
        for line in lines[-LOG_TAIL_LINES:]:
            print(line, file=sys.stderr)
    sys.stderr.flush()


def exit_status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode  # killed by signal N -> 128+N


# -- main -------------------------------------------------------------------------------
def _raise_terminated(signum, frame):
    raise Terminated


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run the grid search on a local two-worker mesh.")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (logs, data)")
    args = parser.parse_args(argv)

    # Ctrl+C raises KeyboardInterrupt here even if SIGINT was ignored when we started (as in a
    # background job): children then start with SIGINT at its default, so the SIGINT that
    # stops them below works. SIGTERM unwinds through the same cleanup.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if POSIX:
        signal.signal(signal.SIGTERM, _raise_terminated)

    tmp = Path(tempfile.mkdtemp(prefix="gpumesh-demo-"))
    coordinator_log, worker_log = tmp / "coordinator.log", tmp / "worker.log"
    coordinator = joiner = grid = None
    interrupted = False
    status = 1
    try:
        env = child_env(tmp)
        port, token = free_port(), new_token()
        url = f"http://127.0.0.1:{port}"
        gpumesh = gpumesh_command()

        say(f"state in {tmp}")
        say(f"starting coordinator on {url} (with its self-worker)")
        coordinator = start_service(
            gpumesh + ["serve", "--host", "127.0.0.1", "--port", str(port), "--token", token,
                       "--data-dir", str(tmp / "data")],
            coordinator_log, env,
        )
        wait_for_health(url, coordinator)
        say("coordinator is up; joining a second worker")
        joiner = start_service(gpumesh + ["join", url, "--token", token], worker_log, env)
        workers = wait_for_workers(url, token, {"coordinator": coordinator, "worker": joiner})
        say(f"{len(workers)} workers alive")

        client_env = dict(env, GPUMESH_URL=url, GPUMESH_TOKEN=token)
        listing = subprocess.run(
            gpumesh + ["workers"], env=client_env, cwd=ROOT, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=30,
        )
        print("$ gpumesh workers")
        print(listing.stdout.rstrip("\n"), flush=True)
        if listing.returncode != 0:
            print(f"[demo] warning: `gpumesh workers` exited with status {listing.returncode}",
                  file=sys.stderr, flush=True)

        print(f"$ python {GRID_SEARCH.relative_to(ROOT)}", flush=True)
        grid = subprocess.Popen([sys.executable, str(GRID_SEARCH)], env=client_env, cwd=ROOT,
                                stdin=subprocess.DEVNULL)
        status = exit_status(grid.wait())
        if status != 0:
            print(f"[demo] the grid search exited with status {status}", file=sys.stderr, flush=True)
        return status
    except DemoError as exc:
        print(f"[demo] FAILED: {exc}", file=sys.stderr, flush=True)
        status = 1
        return status
    except subprocess.TimeoutExpired as exc:
        print(f"[demo] FAILED: {exc}", file=sys.stderr, flush=True)
        status = 1
        return status
    except KeyboardInterrupt:
        interrupted = True  # the grid search, in our process group, got the Ctrl+C too
        print("\n[demo] interrupted", file=sys.stderr, flush=True)
        status = 130
        return status
    except Terminated:
        print("[demo] terminated", file=sys.stderr, flush=True)
        status = 143
        return status
    finally:
        # Cleanup is bounded (at most ~15 s per process); a second Ctrl+C must not cut it short.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if POSIX:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stop_foreground("grid search", grid, interrupted)
        stop_service("worker", joiner)          # leave first, while the coordinator still answers
        stop_service("coordinator", coordinator)
        if status not in (0, 130, 143):
            print_log_tails([coordinator_log, worker_log])
        if args.keep:
            say(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
