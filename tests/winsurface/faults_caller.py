"""Run under the Windows surface by tests/integration/test_winsurface.py: a timeout, a
crash and a cancel against the mesh at $GPUMESH_URL. Prints one JSON line: what each
raised, and the pids of the task processes (and their children) for the test to check."""

import json
import os
import sys
import threading
import time

from gpumesh import Cancelled, GPUMesh, TaskCrashed, TaskTimeout, accelerate

mesh = GPUMesh(output=False)
OUT = sys.argv[1]


def hold(path):
    """A task that starts a child of its own, says both pids, and sleeps."""
    import os
    import subprocess
    import sys
    import time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(path, "w") as fh:
        fh.write(f"{os.getpid()} {child.pid}")
    time.sleep(600)


def wait_file(path):
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if os.path.exists(path) and open(path).read().strip():
            return [int(p) for p in open(path).read().split()]
        time.sleep(0.05)
    raise SystemExit(f"no pids in {path}")


def surface():
    import os
    import socket
    return [hasattr(os, "fork"), hasattr(socket, "AF_UNIX"), hasattr(os, "killpg")]


report = {"surface": accelerate(mesh)(surface)()}

try:
    accelerate(mesh, timeout=3)(hold)(os.path.join(OUT, "timeout"))
except TaskTimeout as e:
    report["timeout"] = str(e)
report["timeout_pids"] = wait_file(os.path.join(OUT, "timeout"))


def crash(code):
    import os
    os._exit(code)


try:
    accelerate(mesh)(crash)(5)
except TaskCrashed as e:
    report["crash"] = str(e)

got = {}
held = accelerate(mesh)(hold)


def run():
    try:
        held.map([os.path.join(OUT, "cancel")])
    except Cancelled as e:
        got["cancel"] = f"Cancelled: {e}"
    except BaseException as e:  # noqa: BLE001
        got["cancel"] = f"{type(e).__name__}: {e}"


t = threading.Thread(target=run)
t.start()
report["cancel_pids"] = wait_file(os.path.join(OUT, "cancel"))
job = mesh.jobs()[0]
report["cancelled"] = mesh.cancel(job["id"])
t.join(60)
report["cancel"] = got.get("cancel")
print(json.dumps(report), flush=True)
