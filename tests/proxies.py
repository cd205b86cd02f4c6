"""Things that stand in front of a coordinator in tests: a real nginx and a real Caddy (the
Debian packages) running the configs docs/network.md gives, each on a free 127.0.0.1 port
with its own config, pid, data and log paths under the test's tmp dir; stopped by PID."""

from __future__ import annotations

import json
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


def documented_block(lang: str) -> str:
    """The ```nginx (or ```caddy) block of docs/network.md, as users copy it."""
    found = re.search(rf"```{lang}\n(.*?)```", DOC.read_text(), re.S)
    assert found, f"no {lang} block in {DOC}"
    return found.group(1)


def _which(name: str) -> str:
    exe = shutil.which(name) or next((p for p in (f"/usr/sbin/{name}", f"/usr/bin/{name}")
                                      if os.path.exists(p)), None)
    if exe is None:
        raise FileNotFoundError(f"{name} is not installed (apt-get install -y {name})")
    return exe


class _Proxy:
    """A proxy process started by a subclass: waits for ``port``, stops by PID."""

    name = "proxy"

    def _start(self, argv: list[str], env: dict | None = None) -> None:
        with open(self.root / f"{self.name}.out", "ab") as out:
            self.p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True, env=env)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.p.poll() is not None:
                raise RuntimeError(f"{self.name} exited:\n" + self.log_text())
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"{self.name} did not start listening:\n" + self.log_text())

    def log_text(self) -> str:
        return "".join(f.read_text(errors="replace") for f in sorted(self.root.glob("*.out"))
                       + sorted(self.root.glob("error.log")))

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(self.stop_signal)
            try:
                self.p.wait(5)
            except subprocess.TimeoutExpired:
                os.kill(self.p.pid, signal.SIGKILL)
                self.p.wait()


class Caddy(_Proxy):
    """Caddy in the foreground with the documented block: the site address becomes
    ``http://127.0.0.1:listen_port`` (no automatic HTTPS, no admin endpoint), the upstream
    the coordinator on ``upstream_port``; an access log is added for the tests to read."""

    name = "caddy"
    stop_signal = signal.SIGTERM

    def __init__(self, root: Path, listen_port: int, upstream_port: int):
        exe = _which("caddy")
        self.root, self.port = root, listen_port
        root.mkdir(parents=True, exist_ok=True)
        block = documented_block("caddy")
        assert "example.org {" in block and "127.0.0.1:8000" in block
        self.access_log = root / "access.log"
        block = block.replace("127.0.0.1:8000", f"127.0.0.1:{upstream_port}")
        block = block.replace("example.org {", f"http://127.0.0.1:{listen_port} {{\n"
                              f"    log {{\n        output file {self.access_log}\n    }}")
        conf = root / "Caddyfile"
        conf.write_text("{\n    admin off\n    auto_https off\n}\n\n" + block)
        env = dict(os.environ, HOME=str(root), XDG_DATA_HOME=str(root / "data"),
                   XDG_CONFIG_HOME=str(root / "config"))
        self._start([exe, "run", "--config", str(conf), "--adapter", "caddyfile"], env)

    def requests_seen(self) -> list[str]:
        """The requests Caddy logged, as request lines ("POST /gpumesh/v1/jobs HTTP/1.1")."""
        if not self.access_log.exists():
            return []
        seen = []
        for line in self.access_log.read_text(errors="replace").splitlines():
            try:
                r = json.loads(line)["request"]
            except (ValueError, KeyError):
                continue
            seen.append(f"{r['method']} {r['uri']} {r['proto']}")
        return seen


class Nginx(_Proxy):
    """nginx in the foreground, one process, proxying ``listen_port`` to the coordinator on
    ``upstream_port`` with the documented block (only the two ports replaced)."""

    name = "nginx"
    stop_signal = signal.SIGQUIT  # graceful: finish the open requests

    def __init__(self, root: Path, listen_port: int, upstream_port: int):
        exe = _which("nginx")
        self.root, self.port = root, listen_port
        root.mkdir(parents=True, exist_ok=True)
        block = documented_block("nginx")
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
        self._start([exe, "-p", str(root), "-c", str(conf), "-e", str(self.error_log)])

    def requests_seen(self) -> list[str]:
        """The request lines nginx logged ("POST /gpumesh/v1/jobs HTTP/1.1", ...)."""
        if not self.access_log.exists():
            return []
        return re.findall(r'"([A-Z]+ \S+ HTTP/[\d.]+)"', self.access_log.read_text(errors="replace"))
