"""gpumesh.limits' settings table: each kind of variable is parsed, checked and defaulted
in one place, and a bad value names its variable and what it expects."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpumesh import limits
from gpumesh.limits import SettingError, setting



# --- the table itself -------------------------------------------------------------------

def test_every_public_constant_of_limits_is_declared_once_with_its_value():
    names = [n for n in vars(limits) if n.isupper() and not n.startswith("_")
             and isinstance(getattr(limits, n), (int, float, bool))]
    undeclared = [n for n in names if n not in limits.SETTINGS]
    assert not undeclared, f"constants in limits.py outside the settings table: {undeclared}"
    for name, s in limits.SETTINGS.items():
        if not name.startswith("GPUMESH_"):
            assert getattr(limits, name) == s.read(), name  # the attribute is the table's value
        assert s.unit and s.meaning, name


def test_values_are_the_ones_the_code_always_had():
    # Pinned figures: the refactor into a table changed no value.
    assert (limits.WORKER_TTL_S, limits.MAX_ATTEMPTS, limits.CALLER_RECONNECT_S,
            limits.NO_WORKER_WAIT_S, limits.RETENTION_S, limits.PURGE_INTERVAL_S) == \
        (10.0, 3, 300.0, 600.0, 24 * 3600.0, 60.0)
    assert limits.MAX_BODY_BYTES == 2048 * 2**20 and isinstance(limits.MAX_BODY_BYTES, int)
    assert limits.MAX_JSON_BODY_BYTES == 1024 * 1024 and isinstance(limits.MAX_JSON_BODY_BYTES, int)
    assert limits.REQUEST_HEAD_TIMEOUT_S == 30.0 and limits.AUTH_LOOPBACK_EXEMPT is True
    assert limits.MAX_RELEASE_JOBS == 1000 and limits.RELEASE_BATCH_MAX <= limits.MAX_RELEASE_JOBS
    assert limits.ERROR_TAIL_BYTES == 4096 and limits.DISCOVERY_BROWSE_S == 3.0
    assert (limits.MAX_PACKAGES, limits.MAX_NAME_CHARS, limits.MAX_VERSION_CHARS,
            limits.MAX_REQUIREMENTS, limits.MAX_REQUIREMENT_CHARS) == (5000, 200, 100, 64, 200)
    assert setting("GPUMESH_ENV_CACHE_MB", {}) == 5120 * 2**20


def test_the_modules_that_used_twins_now_use_the_one_value():
    from gpumesh import packages
    from gpumesh.coordinator import metrics, usage
    from gpumesh.worker import device
    assert packages.MAX_PACKAGES is limits.MAX_PACKAGES
    # (the dashboard's and the metrics' usage windows: coordinator/usage.py, their one owner)
    assert usage.DAY_S is limits.DAY_S and metrics.MiB == device.MiB == limits.MiB


def test_unknown_and_non_setting_variables_are_refused_by_setting():
    with pytest.raises(KeyError, match="GPUMESH_NOPE"):
        setting("GPUMESH_NOPE")
    # A credential is documented but is never a setting (it must not sit in a value table).
    assert "GPUMESH_TOKEN" in limits.OTHER_VARIABLES and limits.OTHER_VARIABLES["GPUMESH_TOKEN"].why
    with pytest.raises(KeyError):
        setting("GPUMESH_TOKEN")


# --- each kind of value -----------------------------------------------------------------

@pytest.mark.parametrize("env, text, value", [
    ("GPUMESH_NO_WORKER_TIMEOUT", "2.5", 2.5),           # seconds
    ("GPUMESH_NO_WORKER_TIMEOUT", "0", 0.0),
    ("GPUMESH_NO_WORKER_TIMEOUT", "inf", math.inf),      # wait for ever, as float() allowed
    ("GPUMESH_WORKER_TTL", " 3 ", 3.0),                   # float() ignores spaces
    ("GPUMESH_RETENTION_HOURS", "0.5", 1800.0),           # hours -> seconds
    ("GPUMESH_MAX_ATTEMPTS", "5", 5),                     # a count
    ("GPUMESH_MAX_BODY_MB", "3", 3 * 2**20),              # MiB -> bytes
    ("GPUMESH_MAX_JSON_KB", "2", 2048),                   # KiB -> bytes
    ("GPUMESH_ENV_CACHE_MB", "0.5", 2**19),               # fractional MiB -> whole bytes
    ("GPUMESH_SYNC", "full", "FULL"),                     # a choice, any case
    ("GPUMESH_SYNC", "NORMAL", "NORMAL"),
    ("GPUMESH_TRUSTED_PROXIES", "10.0.0.0/8,, 192.168.1.1", ["10.0.0.0/8", " 192.168.1.1"]),
    ("GPUMESH_URL", "http://h:1", "http://h:1"),          # text
    ("GPUMESH_PROGRESS", "1", True),                      # forced on / off / automatic
    ("GPUMESH_PROGRESS", "0", False),
    ("GPUMESH_PROGRESS", "yes", None),
])
def test_a_variable_is_parsed_into_the_attributes_unit(env, text, value):
    assert setting(env, {env: text}) == value


@pytest.mark.parametrize("env, default", [
    ("GPUMESH_NO_WORKER_TIMEOUT", 600.0), ("GPUMESH_RETENTION_HOURS", 86400.0),
    ("GPUMESH_MAX_BODY_MB", 2048 * 2**20), ("GPUMESH_SYNC", "NORMAL"), ("GPUMESH_URL", None),
    ("GPUMESH_HOST", "127.0.0.1"), ("GPUMESH_TRUSTED_PROXIES", []), ("GPUMESH_PROGRESS", None),
    ("GPUMESH_OUTPUT", True), ("GPUMESH_LOCAL", False), ("GPUMESH_DISCOVERY", True),
])
def test_unset_or_empty_is_the_default(env, default):
    assert setting(env, {}) == default
    # "export GPUMESH_X=" in a profile must not break anything: empty counts as unset
    assert setting(env, {env: ""}) == default


@pytest.mark.parametrize("text", ["0", "1", "off", "yes", " 0", "anything"])
def test_switches_read_exactly_as_they_always_did(text):
    """The expressions each module used before the table, for every kind of switch."""
    assert setting("GPUMESH_OUTPUT", {"GPUMESH_OUTPUT": text}) is (text != "0")
    assert setting("GPUMESH_HANDOFF", {"GPUMESH_HANDOFF": text}) is (text != "0")
    assert setting("GPUMESH_LOOPBACK_EXEMPT", {"GPUMESH_LOOPBACK_EXEMPT": text}) is (text != "0")
    assert setting("GPUMESH_LOCAL", {"GPUMESH_LOCAL": text}) is (text == "1")
    assert setting("GPUMESH_STRICT_RESULTS", {"GPUMESH_STRICT_RESULTS": text}) is (text == "1")
    assert setting("GPUMESH_DISCOVERY", {"GPUMESH_DISCOVERY": text}) is (
        text.strip().lower() not in ("0", "false", "no", "off"))


@pytest.mark.parametrize("env, text, expected", [
    ("GPUMESH_WORKER_TTL", "ten", "a number of seconds (at least 0)"),
    ("GPUMESH_WORKER_TTL", "-1", "a number of seconds (at least 0)"),
    ("GPUMESH_WORKER_TTL", "nan", "a number of seconds (at least 0)"),
    ("GPUMESH_RETENTION_HOURS", "1d", "a number of hours (at least 0)"),
    ("GPUMESH_MAX_ATTEMPTS", "0", "a whole number of attempts (at least 1)"),
    ("GPUMESH_MAX_ATTEMPTS", "2.5", "a whole number of attempts (at least 1)"),
    ("GPUMESH_MAX_BODY_MB", "1.5", "a whole number of MiB (at least 0)"),
    ("GPUMESH_MAX_JSON_KB", "1M", "a whole number of KiB (at least 0)"),
    ("GPUMESH_ENV_CACHE_MB", "5G", "a number of MiB (at least 0)"),
    ("GPUMESH_SYNC", "OFF", "NORMAL or FULL"),
])
def test_a_bad_value_names_the_variable_and_what_it_expects(env, text, expected):
    with pytest.raises(SettingError) as e:
        setting(env, {env: text})
    assert str(e.value) == f"{env}={text!r}: expected {expected}"
    assert isinstance(e.value, ValueError)  # what callers caught before the table


def _python(code: str, argv: list[str] = (), **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("GPUMESH_")}
    full.update(env)
    return subprocess.run([sys.executable, "-c", code, *argv], env=full, capture_output=True,
                          text=True, timeout=60)


def test_a_variable_read_at_import_is_what_the_process_started_with():
    r = _python("from gpumesh import limits; print(limits.WORKER_TTL_S, limits.RETENTION_S, "
                "limits.MAX_JSON_BODY_BYTES, limits.AUTH_LOOPBACK_EXEMPT)",
                GPUMESH_WORKER_TTL="3", GPUMESH_RETENTION_HOURS="2", GPUMESH_MAX_JSON_KB="8",
                GPUMESH_LOOPBACK_EXEMPT="0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["3.0", "7200.0", "8192", "False"]


def test_a_bad_value_read_at_import_stops_the_process_with_the_variable_named():
    r = _python("import gpumesh.limits", GPUMESH_MAX_BODY_MB="lots")
    assert r.returncode == 1
    assert ("gpumesh.limits.SettingError: GPUMESH_MAX_BODY_MB='lots': expected a whole number "
            "of MiB (at least 0)") in r.stderr


@pytest.mark.parametrize("argv", [["--help"], ["workers"], ["join", "--help"]])
def test_a_bad_value_stops_the_command_with_one_line_and_a_usage_exit(argv):
    """The command reports it as a usage error (exit 2), without a traceback, whatever
    it was asked to do."""
    r = _python("import sys; from gpumesh.cli import main; main(sys.argv[1:], prog_name='gpumesh')",
                GPUMESH_WARM_IDLE="abc", argv=argv)
    assert r.returncode == 2, r.stderr
    assert r.stderr == "Error: GPUMESH_WARM_IDLE='abc': expected a number of seconds (at least 0)\n"
    assert r.stdout == ""


def test_the_store_refuses_a_bad_sync_setting(tmp_path, monkeypatch):
    from gpumesh.coordinator.store import Store
    monkeypatch.setenv("GPUMESH_SYNC", "sometimes")
    with pytest.raises(SettingError, match=r"GPUMESH_SYNC='sometimes': expected NORMAL or FULL"):
        Store(tmp_path / "data")
    monkeypatch.setenv("GPUMESH_SYNC", "full")
    assert Store(tmp_path / "data2").full_sync is True


def test_call_time_settings_follow_the_environment(monkeypatch, tmp_path):
    from gpumesh import config, handoff
    from gpumesh.worker import envs
    monkeypatch.setenv("GPUMESH_HANDOFF", "0")
    assert handoff.enabled() is False
    monkeypatch.setenv("GPUMESH_ENV_CACHE_MB", "2")
    assert envs.default_cap_bytes() == 2 * 2**20
    monkeypatch.setenv("GPUMESH_ENV_DIR", str(tmp_path / "envs"))
    assert envs.default_root() == tmp_path / "envs"
    monkeypatch.setenv("GPUMESH_CONFIG", str(tmp_path / "c.json"))
    assert config.config_path() == tmp_path / "c.json"
    monkeypatch.setenv("GPUMESH_CONFIG", "")
    assert config.config_path() == Path.home() / ".gpumesh" / "config.json"
