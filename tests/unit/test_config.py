"""Unit tests for gpumesh.config: precedence, URL validation, saving, tokens."""

from __future__ import annotations

import json
import os
import stat

import pytest

from gpumesh import config


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    """No GPUMESH_* from the outside; the config file lives in tmp_path."""
    for name in ("GPUMESH_URL", "GPUMESH_TOKEN", "GPUMESH_CONFIG", "GPUMESH_LOCAL"):
        monkeypatch.delenv(name, raising=False)
    cfg = tmp_path / "cfg" / "config.json"
    monkeypatch.setenv("GPUMESH_CONFIG", str(cfg))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return cfg


def write_cfg(path, **data):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


# ---------------------------------------------------------------- resolve ------------

def test_resolve_default_when_nothing_set(clean_env):
    ep = config.resolve()
    assert ep == config.Endpoint("http://127.0.0.1:8000", None)


def test_resolve_saved_file(clean_env):
    write_cfg(clean_env, url="http://10.0.0.5:9000/", token="saved-tok")
    ep = config.resolve()
    assert ep.url == "http://10.0.0.5:9000"
    assert ep.token == "saved-tok"


def test_resolve_empty_env_counts_as_unset(clean_env, monkeypatch):
    write_cfg(clean_env, url="http://10.0.0.5:9000", token="saved-tok")
    monkeypatch.setenv("GPUMESH_URL", "")
    monkeypatch.setenv("GPUMESH_TOKEN", "")
    assert config.resolve() == config.Endpoint("http://10.0.0.5:9000", "saved-tok")


def test_resolve_env_beats_saved(clean_env, monkeypatch):
    write_cfg(clean_env, url="http://10.0.0.5:9000", token="saved-tok")
    monkeypatch.setenv("GPUMESH_URL", "http://env-host:1234")
    monkeypatch.setenv("GPUMESH_TOKEN", "env-tok")
    assert config.resolve() == config.Endpoint("http://env-host:1234", "env-tok")


def test_resolve_args_beat_env_and_saved(clean_env, monkeypatch):
    write_cfg(clean_env, url="http://10.0.0.5:9000", token="saved-tok")
    monkeypatch.setenv("GPUMESH_URL", "http://env-host:1234")
    monkeypatch.setenv("GPUMESH_TOKEN", "env-tok")
    assert config.resolve("https://arg-host:443/", "arg-tok") == config.Endpoint("https://arg-host:443", "arg-tok")


def test_resolve_mixes_sources_per_field(clean_env, monkeypatch):
    write_cfg(clean_env, url="http://10.0.0.5:9000", token="saved-tok")
    monkeypatch.setenv("GPUMESH_TOKEN", "env-tok")
    # url from the file, token from env
    assert config.resolve() == config.Endpoint("http://10.0.0.5:9000", "env-tok")
    # url from args, token from env
    assert config.resolve("http://a:1") == config.Endpoint("http://a:1", "env-tok")
    monkeypatch.delenv("GPUMESH_TOKEN")
    # url from env, token from the file
    monkeypatch.setenv("GPUMESH_URL", "http://env-host:1234")
    assert config.resolve() == config.Endpoint("http://env-host:1234", "saved-tok")


def test_resolve_unreadable_or_bad_file_is_ignored(clean_env):
    clean_env.parent.mkdir(parents=True)
    clean_env.write_text("{not json")
    assert config.resolve() == config.Endpoint("http://127.0.0.1:8000", None)
    clean_env.write_text("[1, 2]")
    assert config.load_saved() == {}


def test_resolve_validates_env_url(clean_env, monkeypatch):
    monkeypatch.setenv("GPUMESH_URL", "127.0.0.1:8000")
    with pytest.raises(ValueError, match="http://"):
        config.resolve()


def test_config_path_default_is_home(monkeypatch, tmp_path):
    monkeypatch.delenv("GPUMESH_CONFIG", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert config.config_path() == tmp_path / ".gpumesh" / "config.json"
    assert config.home_dir() == tmp_path / ".gpumesh"


# ---------------------------------------------------------------- normalise_url ------

@pytest.mark.parametrize("url, expected", [
    ("http://127.0.0.1:8000", "http://127.0.0.1:8000"),
    ("http://127.0.0.1:8000/", "http://127.0.0.1:8000"),
    ("  https://mesh.example.org  ", "https://mesh.example.org"),
    ("http://[::1]:8000", "http://[::1]:8000"),
])
def test_normalise_url_ok(url, expected):
    assert config.normalise_url(url) == expected


@pytest.mark.parametrize("url, words", [
    ("127.0.0.1:8000", ["http://", "https://", "e.g. http://127.0.0.1:8000"]),
    ("ftp://x", ["http://", "'ftp://x'"]),
    ("localhost", ["must start with http://"]),
    ("http://", ["name a host"]),
    ("", ["empty", "http://127.0.0.1:8000"]),
    ("   ", ["empty"]),
    ("http://127.0.0.1:99999", ["invalid port"]),
    ("http://127.0.0.1:abc", ["invalid port"]),
])
def test_normalise_url_errors_are_helpful(url, words):
    with pytest.raises(ValueError) as ei:
        config.normalise_url(url)
    msg = str(ei.value)
    for w in words:
        assert w in msg, (w, msg)


def test_normalise_url_non_string():
    with pytest.raises(ValueError, match="empty"):
        config.normalise_url(None)  # type: ignore[arg-type]


# ---------------------------------------------------------------- save ---------------

def test_save_writes_0600_json(clean_env):
    old = os.umask(0o022)
    try:
        path = config.save("http://127.0.0.1:8123", "tok-é")
    finally:
        os.umask(old)
    assert path == clean_env
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert json.loads(path.read_text()) == {"url": "http://127.0.0.1:8123", "token": "tok-é"}
    assert config.load_saved() == {"url": "http://127.0.0.1:8123", "token": "tok-é"}
    # no temporary file left behind
    assert sorted(p.name for p in path.parent.iterdir()) == ["config.json"]


def test_save_overwrites_and_tightens_mode(clean_env):
    clean_env.parent.mkdir(parents=True)
    clean_env.write_text("{}")
    os.chmod(clean_env, 0o644)
    config.save("http://h:1", "t2")
    assert stat.S_IMODE(clean_env.stat().st_mode) == 0o600
    assert json.loads(clean_env.read_text()) == {"url": "http://h:1", "token": "t2"}
    assert config.resolve() == config.Endpoint("http://h:1", "t2")


def test_save_into_unwritable_place_raises_oserror(monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("GPUMESH_CONFIG", str(blocker / "sub" / "config.json"))
    with pytest.raises(OSError):
        config.save("http://h:1", "t")


# ---------------------------------------------------------------- tokens -------------

def test_generate_token_never_starts_with_dash_and_is_strong():
    tokens = [config.generate_token() for _ in range(2000)]
    assert not any(t.startswith("-") for t in tokens)
    assert min(len(t) for t in tokens) >= 43
    assert len(set(tokens)) == 2000
    alphabet = set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")
    assert all(set(t) <= alphabet for t in tokens)


def test_generate_token_retries_a_dash(monkeypatch):
    seq = iter(["-abc" + "x" * 40, "-def" + "y" * 40, "good" + "z" * 40])
    monkeypatch.setattr(config.secrets, "token_urlsafe", lambda n: next(seq))
    assert config.generate_token() == "good" + "z" * 40


def test_saved_token_only_for_the_same_coordinator(tmp_path, monkeypatch):
    from gpumesh import config
    monkeypatch.setenv("GPUMESH_CONFIG", str(tmp_path / "config.json"))
    assert config.saved_token("http://127.0.0.1:8000") is None  # no config at all
    config.save("http://127.0.0.1:8000", "t" * 43)
    assert config.saved_token("http://127.0.0.1:8000/") == "t" * 43
    assert config.saved_token("http://127.0.0.1:8001") is None  # another port
    assert config.saved_token("https://127.0.0.1:8000") is None  # another scheme
