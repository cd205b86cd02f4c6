"""Windows' details that can be exercised on Linux with real processes: a HOME, data
directory and script path with spaces and backslashes in them; a console that speaks
cp1252; and serve's firewall lines (Windows itself simulated inside the serve process by
a sitecustomize that fakes only gpumesh.winplat's OS checks and netsh)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ..conftest import Mesh, Proc, free_port, wait_for

#: A directory name as awkward as Windows users' ("C:\Users\Ann Lee\My Files"): a space
#: and a backslash, which on Linux is an ordinary character of a name.
ODD = "Ann Lee\\My Files"

SCRIPT = r'''
import json, os, sys
payload = json.load(sys.stdin)
print("caf\u00e9 \u2192 \u2713 from", os.path.basename(__file__))   # output, then the result
print(json.dumps({"x2": payload["x"] * 2, "home": os.environ["HOME"],
                  "label": "Zo\u00eb \u2192 \u2713"}))
'''

CALLER = r'''
from gpumesh import GPUMesh, accelerate
import os, sys
mesh = GPUMesh()   # the saved config under the spaced HOME
assert mesh.url.startswith("http://127.0.0.1:"), mesh.url

@accelerate(mesh)
def where(i):
    import os
    print(f"caf\u00e9 \u2192 \u2713 {i}", flush=True)  # more than the worker's cp1252 has
    return i, os.environ["HOME"]

print(sorted(where.map([1, 2, 3])))
'''


@pytest.fixture(scope="module")
def odd_mesh(tmp_path_factory):
    root = tmp_path_factory.mktemp("win") / ODD
    m = Mesh(root)
    # the config goes where serve puts it by default: under the spaced HOME
    m.env.pop("GPUMESH_CONFIG")
    # stdio in a legacy code page, as Windows' Python has it on a console or a pipe
    m.env["PYTHONIOENCODING"] = "cp1252"
    m.start()
    m.add_worker()
    yield m
    m.stop()


def _caller_env(m: Mesh, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUMESH_")}
    env.update(HOME=m.env["HOME"], PYTHONUNBUFFERED="1", **extra)  # URL and token: saved config
    return env


def test_serve_saves_the_config_under_a_home_with_spaces(odd_mesh):
    home = Path(odd_mesh.env["HOME"])
    saved = home / ".gpumesh" / "config.json"
    assert f"[gpumesh] config saved to {saved}" in odd_mesh.coordinator.output()
    assert json.loads(saved.read_text())["url"] == odd_mesh.url
    assert saved.stat().st_mode & 0o777 == 0o600
    assert (odd_mesh.root / "data" / "gpumesh.db").is_file()


def test_a_script_at_a_path_with_spaces_and_backslashes_runs(odd_mesh, tmp_path):
    # ... and prints what the worker's code page lacks: the worker reads a script's output
    # as UTF-8, so that is what the script writes, whatever the worker's own stdio uses
    folder = tmp_path / "my scripts\\v2"
    folder.mkdir()
    script = folder / "train run.py"
    script.write_text(SCRIPT, encoding="utf-8")
    payloads = folder / "pay loads.json"
    payloads.write_text(json.dumps([{"x": 1}, {"x": 21}]))
    r = subprocess.run([sys.executable, "-m", "gpumesh", "submit", str(script), "--payloads",
                        str(payloads), "--wait", "--json"], env=_caller_env(odd_mesh),
                       capture_output=True, text=True, encoding="utf-8", timeout=180,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    view = json.loads(r.stdout)
    assert view["name"] == str(script)
    results = sorted((t["result"] for t in view["tasks"]), key=lambda x: x["x2"])
    home = odd_mesh.env["HOME"]
    assert results == [{"x2": 2, "home": home, "label": "Zo\u00eb \u2192 \u2713"},
                       {"x2": 42, "home": home, "label": "Zo\u00eb \u2192 \u2713"}]


def test_a_caller_script_in_a_spaced_folder_finds_the_saved_config(odd_mesh, tmp_path):
    folder = tmp_path / "Ann Lee\\proj ects"
    folder.mkdir(parents=True)
    (folder / "run me.py").write_text(CALLER)
    r = subprocess.run([sys.executable, str(folder / "run me.py")], env=_caller_env(odd_mesh),
                       capture_output=True, text=True, timeout=180, cwd=folder)
    assert r.returncode == 0, r.stdout + r.stderr
    home = odd_mesh.env["HOME"]
    lines = r.stdout.strip().splitlines()
    assert lines[-1] == repr([(1, home), (2, home), (3, home)])
    # what the tasks printed reaches the caller whole (a task writes UTF-8, as it is read)
    printed = sorted(line.split(") ", 1)[-1] for line in lines[:-1])
    assert printed == [f"caf\u00e9 \u2192 \u2713 {i}" for i in (1, 2, 3)], lines


def test_cli_output_on_a_cp1252_console_does_not_crash(odd_mesh, tmp_path):
    script = tmp_path / "s.py"
    script.write_text(SCRIPT, encoding="utf-8")
    payloads = tmp_path / "p.json"
    payloads.write_text(json.dumps([{"x": 4}]))
    r = subprocess.run([sys.executable, "-m", "gpumesh", "submit", str(script), "--payloads",
                        str(payloads), "--name", "Zo\u00eb's sweep \u2192 v2", "--wait"],
                       env=_caller_env(odd_mesh, PYTHONIOENCODING="cp1252"),
                       capture_output=True, timeout=180, cwd=tmp_path)
    out = r.stdout.decode("cp1252")
    assert r.returncode == 0, out + r.stderr.decode("cp1252")
    assert "Traceback" not in r.stderr.decode("cp1252")
    # what cp1252 has is printed as it is (ë, é); what it lacks (→, ✓) becomes "?"
    assert "Job: Zo\u00eb's sweep ? v2 (" in out
    assert "  ? task " in out and "[done]" in out
    assert '"label": "Zo\u00eb ? ?"' in out


#: In the serve process only: Windows as winplat sees it, not elevated; netsh recorded.
FAKE_WINDOWS = '''
import json, os, subprocess
import gpumesh.winplat as w
w.is_windows = lambda: True
w._loopback = lambda host: False   # this test may bind loopback only; pretend it is the LAN
w.is_admin = lambda: os.environ["FAKE_ADMIN"] == "1"
def _netsh(args):
    with open(os.environ["FAKE_NETSH_LOG"], "a") as fh:
        fh.write(json.dumps(args) + "\\n")
    return subprocess.CompletedProcess(args, 1 if "show" in args else 0, "", "")
w.run_netsh = _netsh
'''


@pytest.mark.parametrize("admin", [False, True])
def test_serve_on_windows_prints_or_adds_the_firewall_rule(tmp_path, admin):
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "sitecustomize.py").write_text(FAKE_WINDOWS)
    port = free_port()
    log = tmp_path / "netsh.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUMESH_")}
    env.update(HOME=str(tmp_path), GPUMESH_CONFIG=str(tmp_path / "c.json"), PYTHONPATH=str(fake),
               FAKE_ADMIN="1" if admin else "0", FAKE_NETSH_LOG=str(log))
    proc = Proc(["serve", "--port", str(port), "--no-self-worker", "--data-dir",
                 str(tmp_path / "data")], env, tmp_path / "serve.log")
    try:
        wait_for(lambda: "Ctrl+C to stop" in proc.output(), 60, "serve's banner")
        wait_for(lambda: "Windows Firewall" in proc.output(), 10, "the firewall line")
        out = proc.output()
    finally:
        proc.stop()
    lines = out.splitlines()
    i = lines.index("   Ctrl+C to stop")
    cmd = (f'netsh advfirewall firewall add rule name="gpumesh-{port}" dir=in action=allow '
           f"protocol=TCP localport={port}")
    if admin:
        assert lines[i + 1] == (f'[OK] Windows Firewall: added rule "gpumesh-{port}" '
                                f"(inbound TCP {port} allowed)")
        assert [json.loads(x) for x in log.read_text().splitlines()] == [
            ["advfirewall", "firewall", "show", "rule", f"name=gpumesh-{port}"],
            ["advfirewall", "firewall", "add", "rule", f"name=gpumesh-{port}", "dir=in",
             "action=allow", "protocol=TCP", f"localport={port}"]]
    else:
        assert lines[i + 1].startswith("[!!] Windows Firewall may block workers on other machines.")
        assert lines[i + 2] == f"   {cmd}"
        assert not log.exists()
