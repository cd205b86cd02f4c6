r"""Where gpumesh keeps its config, data and caches on each OS.

* Linux: config and data in ``~/.gpumesh``, caches in ``~/.cache/gpumesh``;
* macOS: config and data in ``~/Library/Application Support/gpumesh``, caches in
  ``~/Library/Caches/gpumesh``;
* Windows: config and data in ``%LOCALAPPDATA%\gpumesh``, caches in its ``Cache`` folder.

Linux keeps the paths gpumesh has always used (existing configs and job stores stay where
their users put them). On macOS and Windows the OS's own per-user folders are used
(computed by ``platformdirs``); a ``~/.gpumesh`` left there by an older gpumesh is still
found: its ``config.json`` is read when the new one does not exist yet, and a data
directory holding a job store keeps being used, so no job history is split in two.
"""

from __future__ import annotations

import sys
from pathlib import Path

APP = "gpumesh"
#: The directory older gpumesh versions used on every OS (and still use on Linux).
LEGACY_NAME = ".gpumesh"
#: The file that marks a data directory as holding a job store (coordinator/store.py).
STORE_FILE = "gpumesh.db"


def _platform() -> str:
    """``"linux"`` (and every other POSIX), ``"darwin"`` or ``"win32"``."""
    return sys.platform if sys.platform in ("darwin", "win32") else "linux"


def legacy_dir() -> Path:
    """``~/.gpumesh``: the config and data directory on Linux, and on every OS before."""
    return Path.home() / LEGACY_NAME


def _dirs():
    """platformdirs' answer for this OS, chosen by ``sys.platform`` here and not at its
    import (so one test run can ask as macOS and as Windows)."""
    # Imported when asked: Linux never needs it.
    if _platform() == "win32":
        from platformdirs.windows import Windows as Dirs
    else:
        from platformdirs.macos import MacOS as Dirs
    return Dirs(APP, appauthor=False, roaming=False)


def config_dir() -> Path:
    """The directory the config file lives in (see the table above)."""
    plat = _platform()
    if plat == "linux":
        return legacy_dir()
    # %LOCALAPPDATA% on Windows, not the roaming %APPDATA%: what is saved there belongs to
    # this machine (serve saves a 127.0.0.1 URL; worker.toml is this machine's sharing
    # rules), and a roaming profile would carry it to machines it is wrong for.
    return Path(_dirs().user_config_dir)


def data_dir() -> Path:
    """``serve``'s default ``--data-dir`` (see the table above).

    On macOS and Windows, an existing ``~/.gpumesh`` that holds a job store wins, so an
    upgrade keeps serving the jobs it had."""
    plat = _platform()
    legacy = legacy_dir()
    if plat == "linux" or (legacy / STORE_FILE).exists():
        return legacy
    return Path(_dirs().user_data_dir)


def cache_dir() -> Path:
    """Where re-creatable files go (task environments); see the table above."""
    if _platform() == "linux":
        return Path.home() / ".cache" / APP
    return Path(_dirs().user_cache_dir)


def config_file(name: str) -> Path:
    """The config file ``name`` (``config.json``, ``worker.toml``) to read and write: in
    today's config directory, unless only an older gpumesh's ``~/.gpumesh`` has it (macOS,
    Windows), which then keeps being used."""
    current = config_dir() / name
    legacy = legacy_dir() / name
    if current != legacy and not current.is_file() and legacy.is_file():
        return legacy
    return current
