"""Where a caller finds its coordinator: arguments, environment, then the saved config.

Order of precedence (first found wins), the same for the CLI and the Python API:

1. explicit arguments (``GPUMesh(url, token=...)``, ``--url/--token``),
2. ``$GPUMESH_URL`` / ``$GPUMESH_TOKEN`` / ``$GPUMESH_FINGERPRINT``,
3. the config file ``gpumesh serve`` writes: ``$GPUMESH_CONFIG`` if set, else
   ``config.json`` in the config directory (``~/.gpumesh`` on Linux; the OS's per-user
   folder on macOS and Windows, see :mod:`gpumesh.userdirs`) — a JSON object
   ``{"url": ..., "token": ...}``, plus ``"fingerprint"`` for a coordinator serving TLS;
   readable by its owner only (mode 0600; an owner-only ACL on Windows). The saved
   fingerprint is used only for the saved URL.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from . import limits, userdirs
from .limits import DEFAULT_PORT


def home_dir() -> Path:
    """The default data directory (``~/.gpumesh`` on Linux; see :mod:`gpumesh.userdirs`)."""
    return userdirs.data_dir()


def config_path() -> Path:
    """``$GPUMESH_CONFIG`` if set; else the first config file that exists (today's
    location, then one an older gpumesh left in ``~/.gpumesh`` on macOS/Windows); else
    today's location, where ``save`` creates it."""
    env = limits.setting("GPUMESH_CONFIG")
    if env:
        return Path(env).expanduser()
    return userdirs.config_file("config.json")


@dataclass(frozen=True)
class Endpoint:
    """A coordinator address and the token to present to it."""

    url: str
    token: str | None
    #: ``SHA256:<hex>`` of the coordinator's TLS certificate to pin, or None.
    fingerprint: str | None = None


def load_saved() -> dict:
    """The saved config as a dict; ``{}`` if there is none or it is unreadable."""
    try:
        data = json.loads(config_path().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def save(url: str, token: str, fingerprint: str | None = None) -> Path:
    """Write ``{"url", "token"}`` (and ``"fingerprint"`` when given) to the config file,
    readable by its owner only (mode 0600; on Windows an ACL granting only this user,
    or a logged warning saying that it could not be set); returns its path.

    Raises ``OSError`` if the directory cannot be created or written.
    """
    from .winplat import restrict_to_owner
    path = config_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    # Windows ignores the mode: restrict the file while it is still empty, so the token
    # is never readable by others (a rename keeps the file's ACL).
    restrict_to_owner(tmp)
    with os.fdopen(fd, "w") as fh:
        data = {"url": url, "token": token}
        if fingerprint:
            data["fingerprint"] = fingerprint
        json.dump(data, fh, indent=2)
        fh.write("\n")
    os.replace(tmp, path)
    os.chmod(path, 0o600)
    return path


def saved_token(url: str) -> str | None:
    """The token the saved config holds for the coordinator at ``url``, or None when the
    config names another coordinator (or none). ``gpumesh serve`` reuses it on a restart."""
    saved = load_saved()
    tok = saved.get("token")
    if not isinstance(tok, str) or not tok or not isinstance(saved.get("url"), str):
        return None
    try:
        same = normalise_url(saved["url"]) == normalise_url(url)
    except ValueError:
        return None
    return tok if same else None


def saved_elsewhere(url: str) -> tuple[str, str | None] | None:
    """``(url, fingerprint)`` of the coordinator the saved config names when that is not
    ``url``; None when there is no saved config (or it names no valid URL) or it names
    ``url`` itself."""
    saved = load_saved()
    if not isinstance(saved.get("url"), str):
        return None
    try:
        other = normalise_url(saved["url"])
        if other == normalise_url(url):
            return None
    except ValueError:
        return None
    fp = saved.get("fingerprint")
    return other, fp if isinstance(fp, str) else None


def resolve(url: str | None = None, token: str | None = None,
            fingerprint: str | None = None) -> Endpoint:
    """Fill in whatever was not given from the environment, then the saved config.

    Falls back to ``http://127.0.0.1:8000`` when nothing names a coordinator. An empty
    ``GPUMESH_URL`` or ``GPUMESH_TOKEN`` counts as unset (``export GPUMESH_TOKEN=`` in a
    shell profile must not hide the saved token).
    """
    saved: dict | None = None
    if url is None:
        url = limits.setting("GPUMESH_URL")
    if url is None:
        saved = load_saved()
        url = saved.get("url")
    if token is None:
        token = os.environ.get("GPUMESH_TOKEN") or None
    if token is None:
        if saved is None:
            saved = load_saved()
        token = saved.get("token")
    url = normalise_url(url or f"http://127.0.0.1:{DEFAULT_PORT}")
    if fingerprint is None:
        fingerprint = limits.setting("GPUMESH_FINGERPRINT")
    if fingerprint is None and url.startswith("https://"):
        if saved is None:
            saved = load_saved()
        if saved.get("url") == url and isinstance(saved.get("fingerprint"), str):
            fingerprint = saved["fingerprint"]
    return Endpoint(url, token, fingerprint)


def normalise_url(url: str) -> str:
    """Validate a coordinator URL and strip a trailing slash.

    Raises ``ValueError`` with a message saying what a valid URL looks like.
    """
    if not isinstance(url, str) or not url.strip():
        raise ValueError("coordinator URL is empty; expected e.g. http://127.0.0.1:8000")
    typed = url.strip()  # (what the messages quote: as the user wrote it)
    url = typed.rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(
            f"coordinator URL {typed!r} must start with http:// or https:// and name a host, "
            f"e.g. http://127.0.0.1:{DEFAULT_PORT}"
        )
    try:
        parts.port
    except ValueError:
        raise ValueError(f"coordinator URL {typed!r} has an invalid port") from None
    return url


def generate_token() -> str:
    """A fresh 256-bit token (``secrets.token_urlsafe(32)``) that never begins with ``-``,
    so it can always be passed as a command-line flag value."""
    while True:
        tok = secrets.token_urlsafe(32)
        if not tok.startswith("-"):
            return tok
