"""Things that stand in front of a coordinator in tests: a real nginx (the Debian package)
running the config docs/network.md gives, on a free 127.0.0.1 port with its own prefix,
pid and log paths under the test's tmp dir; stopped by PID."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "network.md"
START_TIMEOUT_S = 15


def documented_nginx_block() -> str:
    """The ```nginx block of docs/network.md, as users copy it."""
    found = re.search(r"```nginx\n(.*?)```", DOC.read_text(), re.S)
    assert found, f"no nginx block in {DOC}"
    return found.group(1)


class Nginx:
    """nginx in the foreground, one process, proxying ``listen_port`` to the coordinator on
    ``upstream_port`` with the documented block (only the two ports replaced)."""

    def __init__(self, root: Path, listen_port: int, upstream_port: int):
        exe = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
        if exe is None:
            raise FileNotFoundError("nginx is not installed (apt-get install -y nginx)")
        self.root, self.port = root, listen_port
        root.mkdir(parents=True, exist_ok=True)
        block = documented_nginx_block()
        assert "127.0.0.1:8000" in block and "listen 80;" in block
        block = block.replace("127.0.0.1:8000", f"127.0.0.1:{upstream_port}")
        block = block.replace("listen 80;", f"listen 127.0.0.1:{listen_port};")
        temp = "\n".join(f"    {what}_temp_path {root}/{what};"
                         for what in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
        self.access_log = root / "access.log"
        self.error_log = root / "error.log"
        conf = root / "nginx.conf"
        conf.write_text(f"""daemon off;
master_process off;
pid {root}/nginx.pid;
error_log {self.error_log} info;
events {{ worker_connections 512; }}
http {{
    access_log {self.access_log};
{temp}
{block}
}}
""")
        with open(root / "nginx.out", "ab") as out:
            self.p = subprocess.Popen([exe, "-p", str(root), "-c", str(conf), "-e", str(self.error_log)],
                                      stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.p.poll() is not None:
                raise RuntimeError("nginx exited:\n" + (root / "nginx.out").read_text()
                                   + (self.error_log.read_text() if self.error_log.exists() else ""))
            try:
                socket.create_connection(("127.0.0.1", listen_port), timeout=0.5).close()
                return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError("nginx did not start listening")

    def requests_seen(self) -> list[str]:
        """The request lines nginx logged ("POST /gpumesh/v1/jobs HTTP/1.1", ...)."""
        if not self.access_log.exists():
            return []
        return re.findall(r'"([A-Z]+ \S+ HTTP/[\d.]+)"', self.access_log.read_text(errors="replace"))

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGQUIT)  # graceful: finish the open requests
            try:
                self.p.wait(5)
            except subprocess.TimeoutExpired:
                os.kill(self.p.pid, signal.SIGKILL)
                self.p.wait()
