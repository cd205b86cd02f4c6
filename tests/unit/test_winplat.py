"""Windows' details (gpumesh/winplat.py) decided on Linux: Windows is simulated by
``sys.platform`` and fakes of the three functions that touch it (run_icacls, is_admin,
run_netsh), each asserting the exact command it was given."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from gpumesh import config, winplat
from gpumesh.cli.serve import banner


def _done(args, rc=0, out="", err=""):
    return subprocess.CompletedProcess(args, rc, out, err)


@pytest.fixture
def windows(monkeypatch):
    monkeypatch.setattr(sys, "platform", "win32")
    monkeypatch.setenv("USERNAME", "ann")
    monkeypatch.setenv("USERDOMAIN", "LAPTOP-A")


# --- the config file's ACL ---------------------------------------------------------------

def test_config_is_restricted_with_icacls_before_the_token_is_written(windows, monkeypatch,
                                                                      tmp_path):
    calls = []

    def icacls(args):
        calls.append((args, os.path.getsize(args[0])))  # the file is still empty then
        return _done(args)
    monkeypatch.setattr(winplat, "run_icacls", icacls)
    monkeypatch.setenv("GPUMESH_CONFIG", str(tmp_path / "My Config" / "config.json"))
    path = config.save("http://127.0.0.1:8000", "t" * 43)
    tmp = str(path.with_name(f"config.json.{os.getpid()}.tmp"))
    assert calls == [([tmp, "/inheritance:r", "/grant:r", "LAPTOP-A\\ann:F"], 0)]
    assert config.resolve().token == "t" * 43


def test_the_real_icacls_command_line(monkeypatch):
    seen = {}

    def run(argv, **kw):
        seen["argv"], seen["kw"] = argv, kw
        return _done(argv)
    monkeypatch.setattr(winplat.subprocess, "run", run)
    winplat.run_icacls(["C:\\Users\\Ann Lee\\x.json", "/inheritance:r"])
    assert seen["argv"] == ["icacls", "C:\\Users\\Ann Lee\\x.json", "/inheritance:r"]
    assert seen["kw"]["timeout"] == winplat.TOOL_TIMEOUT_S
    assert seen["kw"]["capture_output"] is True
    assert seen["kw"]["errors"] == "replace"  # a localized message must not crash serve


def test_the_real_netsh_command_line(monkeypatch):
    seen = {}

    def run(argv, **kw):
        seen["argv"], seen["kw"] = argv, kw
        return _done(argv)
    monkeypatch.setattr(winplat.subprocess, "run", run)
    winplat.run_netsh(ADD)
    assert seen["argv"] == ["netsh", *ADD]
    assert seen["kw"]["errors"] == "replace" and seen["kw"]["timeout"] == winplat.TOOL_TIMEOUT_S


def test_account_without_a_domain_is_the_user_name(windows, monkeypatch):
    monkeypatch.delenv("USERDOMAIN")
    assert winplat.owner_only_args("C:\\a b\\c", winplat.windows_account()) == [
        "C:\\a b\\c", "/inheritance:r", "/grant:r", "ann:F"]


@pytest.mark.parametrize("fake, why", [
    (lambda args: _done(args, 5, "", "Access is denied."), "Access is denied."),
    (lambda args: _done(args, 1332, "", ""), "exit code 1332"),
])
def test_an_acl_that_cannot_be_set_is_a_warning_stating_the_limit(windows, monkeypatch, tmp_path,
                                                                   caplog, fake, why):
    monkeypatch.setattr(winplat, "run_icacls", fake)
    target = tmp_path / "config.json"
    target.write_text("{}")
    with caplog.at_level(logging.WARNING, "gpumesh.winplat"):
        assert winplat.restrict_to_owner(target) is False
    assert caplog.messages == [
        f"could not make {target} readable by LAPTOP-A\\ann only (icacls: {why}); it is only as "
        f"private as the permissions of {tmp_path}"]


def test_missing_icacls_is_a_warning_and_the_config_is_still_saved(windows, monkeypatch,
                                                                    tmp_path, caplog):
    def gone(args):
        raise FileNotFoundError(2, "No such file or directory", "icacls")
    monkeypatch.setattr(winplat, "run_icacls", gone)
    monkeypatch.setenv("GPUMESH_CONFIG", str(tmp_path / "config.json"))
    with caplog.at_level(logging.WARNING, "gpumesh.winplat"):
        path = config.save("http://127.0.0.1:8000", "t" * 43)
    assert path.is_file() and config.resolve().token == "t" * 43
    assert len(caplog.messages) == 1 and "icacls: [Errno 2]" in caplog.messages[0]


def test_posix_keeps_mode_0600_and_never_runs_icacls(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(winplat, "run_icacls", lambda args: pytest.fail("icacls on POSIX"))
    f = tmp_path / "x"
    f.write_text("")
    f.chmod(0o644)
    assert winplat.restrict_to_owner(f) is True
    assert f.stat().st_mode & 0o777 == 0o600


# --- serve: the firewall rule --------------------------------------------------------------

ADD = ["advfirewall", "firewall", "add", "rule", "name=gpumesh-8000", "dir=in", "action=allow",
       "protocol=TCP", "localport=8000"]
SHOW = ["advfirewall", "firewall", "show", "rule", "name=gpumesh-8000"]
CMD = ('netsh advfirewall firewall add rule name="gpumesh-8000" dir=in action=allow '
       "protocol=TCP localport=8000")


def _netsh(monkeypatch, answers):
    calls = []

    def run(args):
        calls.append(args)
        return answers[len(calls) - 1](args)
    monkeypatch.setattr(winplat, "run_netsh", run)
    return calls


def test_not_administrator_prints_the_command_and_runs_nothing(windows, monkeypatch):
    monkeypatch.setattr(winplat, "is_admin", lambda: False)
    calls = _netsh(monkeypatch, [])
    assert winplat.firewall_lines("0.0.0.0", 8000) == [
        "[!!] Windows Firewall may block workers on other machines. Run gpumesh serve as "
        "Administrator to have the rule added, or run once in an Administrator prompt:",
        f"   {CMD}"]
    assert calls == []


def test_administrator_adds_the_rule(windows, monkeypatch):
    monkeypatch.setattr(winplat, "is_admin", lambda: True)
    calls = _netsh(monkeypatch, [lambda a: _done(a, 1, "No rules match the specified criteria."),
                                 lambda a: _done(a, 0, "Ok.")])
    assert winplat.firewall_lines("0.0.0.0", 8000) == [
        '[OK] Windows Firewall: added rule "gpumesh-8000" (inbound TCP 8000 allowed)']
    assert calls == [SHOW, ADD]


def test_administrator_keeps_an_existing_rule(windows, monkeypatch):
    monkeypatch.setattr(winplat, "is_admin", lambda: True)
    calls = _netsh(monkeypatch, [lambda a: _done(a, 0, "Rule Name: gpumesh-8000")])
    assert winplat.firewall_lines("192.0.2.10", 8000) == [
        '[OK] Windows Firewall: rule "gpumesh-8000" already allows inbound TCP 8000']
    assert calls == [SHOW]


def test_a_refused_rule_says_why_and_how(windows, monkeypatch):
    monkeypatch.setattr(winplat, "is_admin", lambda: True)
    _netsh(monkeypatch, [lambda a: _done(a, 1, ""),
                         lambda a: _done(a, 1, "The requested operation requires elevation.")])
    assert winplat.firewall_lines("0.0.0.0", 8000) == [
        "[!!] Windows Firewall: could not add the rule (The requested operation requires "
        "elevation.); workers on other machines may be blocked. Add it yourself in an "
        "Administrator prompt:", f"   {CMD}"]


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "127.0.0.2"])
def test_loopback_needs_no_rule(windows, monkeypatch, host):
    monkeypatch.setattr(winplat, "is_admin", lambda: pytest.fail("asked for nothing"))
    assert winplat.firewall_lines(host, 8000) == []


@pytest.mark.parametrize("plat", ["linux", "darwin"])
def test_linux_and_macos_print_nothing_about_a_firewall(monkeypatch, plat):
    monkeypatch.setattr(sys, "platform", plat)
    monkeypatch.setattr(winplat, "run_netsh", lambda a: pytest.fail("netsh off Windows"))
    assert winplat.firewall_lines("0.0.0.0", 8000) == []
    assert winplat.is_admin() is False


def test_is_admin_asks_shell32(windows, monkeypatch):
    import ctypes

    class Shell32:
        @staticmethod
        def IsUserAnAdmin():
            return 1
    monkeypatch.setattr(ctypes, "windll", type("W", (), {"shell32": Shell32})(), raising=False)
    assert winplat.is_admin() is True
    monkeypatch.delattr(ctypes, "windll")
    assert winplat.is_admin() is False  # no shell32 to ask: not elevated, say so


def test_the_serve_banner_itself_is_unchanged_on_windows(windows, monkeypatch):
    # the firewall lines come after it; the banner's own words do not depend on the OS
    monkeypatch.setattr("gpumesh.cli.serve._device_line", lambda: "CPU x")
    lines = banner("127.0.0.1", 8000, "tok", show_token=False)
    assert lines[0] == "[OK] Coordinator listening on 127.0.0.1:8000"
    assert not any("Firewall" in line for line in lines)


# --- consoles --------------------------------------------------------------------------------

def _run(code: str, encoding: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONIOENCODING=encoding)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=60)


def test_safe_streams_turns_what_cp1252_lacks_into_question_marks():
    r = _run("from gpumesh.winplat import safe_streams; safe_streams();"
             "import sys; print('\u2713 h\u00e9 \u2192 \u4e2d'); print('\u2713', file=sys.stderr)",
             "cp1252")
    assert r.returncode == 0, r.stderr
    assert r.stdout == b"? h\xe9 ? ?\n" and r.stderr == b"?\n"
    # without it the same print is a UnicodeEncodeError (what a cp1252 console did)
    r = _run("print('\u2713')", "cp1252")
    assert r.returncode == 1 and b"UnicodeEncodeError" in r.stderr


def test_safe_streams_leaves_utf8_streams_alone():
    r = _run("from gpumesh.winplat import safe_streams; safe_streams();"
             "import sys; print(sys.stdout.errors, '\u2713')", "utf-8")
    assert r.stdout.decode() == "strict \u2713\n"
