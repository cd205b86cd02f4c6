"""Config, data and cache folders per OS (gpumesh/userdirs.py), and that existing users'
files keep being found. macOS and Windows are simulated by ``sys.platform`` and by the
environment platformdirs reads there (HOME, APPDATA, LOCALAPPDATA)."""

from __future__ import annotations

import os
import sys

import pytest

from gpumesh import config, userdirs
from gpumesh.cli import owner


@pytest.fixture
def home(monkeypatch, tmp_path):
    home = tmp_path / "Users" / "Ann Lee"
    home.mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("APPDATA", str(home / "AppData" / "Roaming"))
    monkeypatch.setenv("LOCALAPPDATA", str(home / "AppData" / "Local"))
    monkeypatch.delenv("GPUMESH_CONFIG", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    return home


def _as(monkeypatch, plat: str) -> None:
    monkeypatch.setattr(sys, "platform", plat)
    if plat == "win32":  # platformdirs asks the registry/shell32 there: read the variables
        import platformdirs.windows as pw
        names = {"CSIDL_APPDATA": "APPDATA", "CSIDL_LOCAL_APPDATA": "LOCALAPPDATA"}
        monkeypatch.setattr(pw, "get_win_folder", lambda csidl: os.environ[names[csidl]])


def test_linux_paths_are_the_ones_gpumesh_always_used(monkeypatch, home):
    _as(monkeypatch, "linux")
    assert userdirs.config_dir() == home / ".gpumesh"
    assert userdirs.data_dir() == home / ".gpumesh"
    assert userdirs.cache_dir() == home / ".cache" / "gpumesh"
    assert config.config_path() == home / ".gpumesh" / "config.json"
    assert config.home_dir() == home / ".gpumesh"
    assert owner.worker_config_path() == home / ".gpumesh" / "worker.toml"


def test_linux_paths_ignore_xdg_variables(monkeypatch, home, tmp_path):
    # an existing user's config must not move because XDG_CONFIG_HOME happens to be set
    _as(monkeypatch, "linux")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdgdata"))
    assert config.config_path() == home / ".gpumesh" / "config.json"
    assert userdirs.data_dir() == home / ".gpumesh"


def test_macos_uses_application_support(monkeypatch, home):
    _as(monkeypatch, "darwin")
    support = home / "Library" / "Application Support" / "gpumesh"
    assert userdirs.config_dir() == support
    assert userdirs.data_dir() == support
    assert userdirs.cache_dir() == home / "Library" / "Caches" / "gpumesh"
    assert config.config_path() == support / "config.json"
    assert owner.worker_config_path() == support / "worker.toml"


def test_windows_uses_localappdata_never_the_roaming_profile(monkeypatch, home):
    # what is saved belongs to this machine (a 127.0.0.1 URL, its sharing rules)
    _as(monkeypatch, "win32")
    local = home / "AppData" / "Local" / "gpumesh"
    assert userdirs.config_dir() == local
    assert userdirs.data_dir() == local
    assert userdirs.cache_dir() == local / "Cache"
    assert config.config_path() == local / "config.json"
    assert owner.worker_config_path() == local / "worker.toml"


@pytest.mark.parametrize("plat", ["darwin", "win32"])
def test_an_older_config_in_dot_gpumesh_is_still_read(monkeypatch, home, plat):
    _as(monkeypatch, plat)
    legacy = home / ".gpumesh"
    legacy.mkdir()
    (legacy / "config.json").write_text('{"url": "http://10.0.0.7:8000", "token": "old-tok"}')
    (legacy / "worker.toml").write_text("max_slots = 1\n")
    assert config.config_path() == legacy / "config.json"
    assert config.resolve().url == "http://10.0.0.7:8000"
    assert config.resolve().token == "old-tok"
    assert owner.worker_config_path() == legacy / "worker.toml"
    # once a config exists where this OS keeps it, that one wins
    new = userdirs.config_dir() / "config.json"
    new.parent.mkdir(parents=True)
    new.write_text('{"url": "http://10.0.0.8:8000", "token": "new-tok"}')
    assert config.config_path() == new
    assert config.resolve().token == "new-tok"


@pytest.mark.parametrize("plat", ["darwin", "win32"])
def test_an_older_job_store_in_dot_gpumesh_keeps_being_served(monkeypatch, home, plat):
    _as(monkeypatch, plat)
    legacy = home / ".gpumesh"
    legacy.mkdir()
    (legacy / "config.json").write_text("{}")  # a config alone does not pin the data dir
    assert userdirs.data_dir() != legacy
    (legacy / "gpumesh.db").write_bytes(b"")
    assert userdirs.data_dir() == legacy
    assert config.home_dir() == legacy


def test_gpumesh_config_still_wins_everywhere(monkeypatch, home, tmp_path):
    _as(monkeypatch, "win32")
    monkeypatch.setenv("GPUMESH_CONFIG", str(tmp_path / "c d" / "x.json"))
    assert config.config_path() == tmp_path / "c d" / "x.json"


def test_save_on_macos_creates_the_application_support_folder(monkeypatch, home):
    _as(monkeypatch, "darwin")
    path = config.save("http://127.0.0.1:8000", "t" * 43)
    assert path == home / "Library" / "Application Support" / "gpumesh" / "config.json"
    assert config.resolve().token == "t" * 43
    assert path.stat().st_mode & 0o777 == 0o600
