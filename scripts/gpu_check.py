#!/usr/bin/env python3
"""gpumesh on a real NVIDIA GPU: detection, scores, a CUDA task, tensors back to a CPU-only
caller, GPU memory hints. Run through scripts/gpu_check.sh (which sets up the imports).

Starts its own coordinator and one worker on 127.0.0.1 (in a temporary directory), checks,
prints one PASS/FAIL line per check and a summary, and stops them. Needs torch on this
machine (the tasks and the memory hog use it). Exit code: 0 all passed, 1 a check failed,
2 no NVIDIA GPU (nothing checked).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

RESULTS: list[tuple[str, bool, str]] = []
ROOT = Path(__file__).resolve().parents[1]
CASE_C07 = ROOT.parent / "shared" / "cases" / "c07_cuda_tensor_result.py"


def check(name: str, ok: bool, detail: str = "") -> bool:
    RESULTS.append((name, bool(ok), detail))
    print(f"[{'PASS' if ok else 'FAIL'}] {name}{': ' + detail if detail else ''}", flush=True)
    return bool(ok)


def nvidia_smi() -> list[dict]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    out = subprocess.run([exe, "--query-gpu=index,name,memory.total,memory.free",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30)
    gpus = []
    for line in out.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 4 and parts[0].isdigit():
            gpus.append({"index": int(parts[0]), "name": ", ".join(parts[1:-2]),
                         "total": int(float(parts[-2])), "free": int(float(parts[-1]))})
    return gpus


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def wait_for(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            got = cond()
        except Exception:  # noqa: BLE001 - not up yet
            got = None
        if got:
            return got
        time.sleep(0.2)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")


def main() -> int:
    smi = nvidia_smi()
    if not smi:
        print("SKIP: no NVIDIA GPU here (nvidia-smi is missing or lists none); nothing was checked")
        return 2
    import torch  # noqa: F401 - the checks need it; fail early and clearly if it is missing

    tmp = Path(tempfile.mkdtemp(prefix="gpumesh-gpu-check-"))
    (tmp / "home").mkdir()
    token = secrets.token_urlsafe(32)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, GPUMESH_TOKEN=token, HOME=str(tmp / "home"),
               GPUMESH_CONFIG=str(tmp / "config.json"), PYTHONUNBUFFERED="1")
    env.pop("GPUMESH_FAKE_GPUS", None)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    procs = []

    def start(args, log):
        p = subprocess.Popen([sys.executable, "-m", "gpumesh", *args], env=env, stdin=subprocess.DEVNULL,
                             stdout=open(tmp / log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(p)
        return p

    try:
        start(["serve", "--port", str(port), "--no-self-worker", "--data-dir", str(tmp / "data")],
              "coordinator.log")
        from gpumesh import GPUMesh, Unsatisfiable, accelerate
        import urllib.request

        def healthy() -> bool:
            try:
                with urllib.request.urlopen(f"{url}/v1/health", timeout=1) as r:
                    return r.status == 200
            except OSError:
                return False
        wait_for(healthy, 30, "the coordinator")
        t_join = time.monotonic()
        start(["join", url, "--cpu-slots", "1"], "worker.log")
        m = GPUMesh(url, token=token, output=False)
        w = wait_for(lambda: [x for x in m.workers() if x["alive"]], 60, "the worker")[0]
        joined_s = time.monotonic() - t_join
        run_checks(m, w, smi, env, url, token, joined_s, tmp, accelerate, Unsatisfiable)
    except Exception as e:  # noqa: BLE001 - report it as a failed check, then clean up
        check("the checks ran to the end", False, f"{type(e).__name__}: {e}")
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
        for log in ("worker.log", "coordinator.log"):
            path = tmp / log
            if path.exists():
                print(f"--- {log} (last lines)")
                print("\n".join(path.read_text(errors="replace").splitlines()[-15:]))
        shutil.rmtree(tmp, ignore_errors=True)

    passed = sum(ok for _, ok, _ in RESULTS)
    print(f"\nSUMMARY: {passed} passed, {len(RESULTS) - passed} failed")
    for name, ok, detail in RESULTS:
        print(f"  {'PASS' if ok else 'FAIL'}  {name}{' - ' + detail if detail else ''}")
    return 0 if passed == len(RESULTS) else 1


def run_checks(m, w, smi, env, url, token, joined_s, tmp, accelerate, Unsatisfiable) -> None:
    import torch

    # -- detection ---------------------------------------------------------------
    got = [(g["index"], g["name"], g["memory_total_mb"]) for g in w.get("gpus", [])]
    want = [(g["index"], g["name"], g["total"]) for g in smi]
    check("detection: every GPU with its model and memory (NVML, as nvidia-smi)", got == want,
          f"worker {got} / nvidia-smi {want}")
    kinds = [s["kind"] for s in w["slot_list"]]
    check("slots: one per GPU plus one CPU slot", kinds == ["cuda"] * len(smi) + ["cpu"], str(kinds))
    print(f"       the worker joined {joined_s:.1f}s after it started")

    # -- scores ------------------------------------------------------------------
    t0 = time.monotonic()
    w = wait_for(lambda: next((x for x in m.workers() if x["alive"] and x.get("scores")), None), 180,
                 "the benchmark")
    scores = w["scores"]
    print(f"       scores after {time.monotonic() - t0:.1f}s more: {json.dumps(scores)}")
    log = (tmp / "worker.log").read_text(errors="replace")
    check("the benchmark ran after joining", 0 <= log.find("joined mesh as") < log.find("device=GPU"),
          "; ".join(ln for ln in log.splitlines() if "device=" in ln))
    gpu_scores = [scores.get(f"cuda:{g['index']}") for g in smi]
    check("score: every GPU measured", all(s is not None for s in gpu_scores), str(gpu_scores))
    check("score: GPU above CPU", all((s or 0) > scores.get("cpu", 0) for s in gpu_scores),
          f"gpu {gpu_scores} vs cpu {scores.get('cpu')}")

    # -- a torch task on cuda ----------------------------------------------------
    @accelerate(m, gpu="cuda")
    def on_gpu():
        import os as _os

        import torch as _t
        x = _t.arange(6, dtype=_t.float32, device="cuda").reshape(2, 3) * 2
        return (x, _os.environ.get("CUDA_VISIBLE_DEVICES"), _t.cuda.device_count(),
                _t.cuda.get_device_name(0), str(x.device))

    t0 = time.monotonic()
    x, cvd, n, name, device = on_gpu()
    want_x = torch.arange(6, dtype=torch.float32).reshape(2, 3) * 2
    check("torch task on 'cuda' returns a tensor", isinstance(x, torch.Tensor)
          and torch.equal(x.detach().cpu(), want_x) and device.startswith("cuda"),
          f"{x!r} computed on {device} in {time.monotonic() - t0:.1f}s")
    check("the task sees only its own GPU", cvd in {str(g["index"]) for g in smi} and n == 1
          and name == smi[int(cvd)]["name"], f"CUDA_VISIBLE_DEVICES={cvd}, {n} device(s), {name}")
    if len(smi) > 1:
        got = on_gpu.map([()] * len(smi))
        check("one task per GPU at once", sorted(g[1] for g in got) == sorted(str(g["index"]) for g in smi),
              str([g[1] for g in got]))

    @accelerate(m, gpu="cpu")
    def on_cpu():
        import torch as _t
        return _t.cuda.is_available()
    check("a CPU slot's task sees no GPU", on_cpu() is False)

    # -- a CUDA tensor to a caller without CUDA ----------------------------------
    caller = textwrap.dedent(f"""
        import torch
        from gpumesh import GPUMesh, accelerate
        assert not torch.cuda.is_available()
        m = GPUMesh({url!r}, token={token!r}, output=False)
        @accelerate(m)
        def f():
            import torch as t
            lin = t.nn.Linear(3, 2).cuda()
            return {{"x": t.ones(2, 2, device="cuda") * 3, "state": lin.state_dict()}}
        out = f.to("cuda")()
        assert out["x"].device.type == "cpu" and out["x"].sum().item() == 12.0, out
        assert out["state"]["weight"].device.type == "cpu"
        print("OK", out["x"].device)
    """)
    cpu_env = dict(env, CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, "-c", caller], env=cpu_env, capture_output=True, text=True, timeout=300)
    check("a CUDA tensor reaches a CPU-only caller as a CPU tensor", r.returncode == 0 and "OK cpu" in r.stdout,
          (r.stdout + r.stderr).strip()[-400:])
    if CASE_C07.exists():
        r = subprocess.run([sys.executable, str(CASE_C07)], env=dict(cpu_env, GPUMESH_URL=url),
                           capture_output=True, text=True, timeout=600)
        check("shared case c07 (CPU-only caller)", r.returncode == 0 and "OK [c07]" in r.stdout,
              (r.stdout + r.stderr).strip()[-400:])
        r = subprocess.run([sys.executable, str(CASE_C07)], env=dict(env, GPUMESH_URL=url),
                           capture_output=True, text=True, timeout=600)
        check("shared case c07 (caller with CUDA)", r.returncode == 0 and "OK [c07]" in r.stdout,
              (r.stdout + r.stderr).strip()[-400:])
    else:
        print(f"       (no {CASE_C07}: shared case c07 not run)")

    # -- GPU memory hints --------------------------------------------------------
    gpu = smi[0]

    @accelerate(m, gpu="cuda")
    def hinted(i):
        import os as _os
        return _os.environ.get("CUDA_VISIBLE_DEVICES")

    biggest = max(g["total"] for g in smi)
    try:
        hinted.map([{"i": 0, "gpu_memory_mb": biggest + 1}])
        check("a hint above every GPU's memory is refused", False, "it ran")
    except Unsatisfiable as e:
        check("a hint above every GPU's memory is refused", True, str(e)[:200])
    check("a hint below the free memory is accepted", hinted.map([{"i": 0, "gpu_memory_mb": 1024}]) in
          ([str(g["index"])] for g in smi))

    # Fill all but ~4 GiB of every GPU from another process; a task hinting 8 GiB must wait.
    hog = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import sys, time, torch
        held = []
        for i in range(torch.cuda.device_count()):
            free, _ = torch.cuda.mem_get_info(i)
            held.append(torch.empty(max(0, free - 4 * 2**30), dtype=torch.uint8, device=f"cuda:{i}"))
        print("held", flush=True)
        time.sleep(600)
    """)], env=env, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        line = hog.stdout.readline().strip()
        lowest = wait_for(lambda: (lambda ws: ws and max(g["memory_free_mb"] for g in ws[0]["gpus"]) < 6000
                                   and ws)([x for x in m.workers() if x["alive"]]), 30,
                          "the heartbeat to report the filled GPU")
        free_now = [g["memory_free_mb"] for g in lowest[0]["gpus"]]
        check("free GPU memory is refreshed by the heartbeat", line == "held", f"free now {free_now} MiB")
        out: list = []
        th = threading.Thread(target=lambda: out.append(hinted.map([{"i": 1, "gpu_memory_mb": 8192}])),
                              daemon=True)
        th.start()
        th.join(8)
        check("a hint above the free memory keeps the task off the busy GPU", th.is_alive() and not out,
              f"free {free_now} MiB < 8192 MiB hinted: still waiting after 8 s")
    finally:
        os.killpg(hog.pid, signal.SIGKILL)
        hog.wait()
    th.join(60)
    check("...and it runs once the memory is free again", bool(out), str(out))
    print(f"       GPU {gpu['index']}: {gpu['name']}, {gpu['total']} MiB")


if __name__ == "__main__":
    sys.exit(main())
