"""Task environments for ``requires=``: built by uv on the worker, cached, capped, LRU.

``@accelerate(m, requires=["scikit-learn>=1.4"])`` runs on a worker that has those
distributions already, or on one whose owner allows installs (``gpumesh join
--allow-installs``). There the task runs with a directory of its own in front of
``sys.path``::

    requires (canonical, sorted) ─► key = sha256(Python version, platform, requires)
        │
        ├─ <cache>/<key>/ready exists ─► reuse it (its mtime is the LRU clock)
        └─ else: uv pip install --target <cache>/.<key>.<pid>.tmp/site  (lock: .<key>.lock)
                 ─► rename to <cache>/<key> ─► ready ─► evict least recently used
                    environments until the cache is under its cap

Everything the worker itself imports before a task (gpumesh, cloudpickle) still comes
from the worker's own environment; anything else the task imports comes from the
environment first. The cache is ``$GPUMESH_ENV_DIR`` (default
``~/.cache/gpumesh/envs`` on Linux, see ``gpumesh.userdirs``), capped at ``$GPUMESH_ENV_CACHE_MB`` (default 5120 MiB).
An environment in use by a task of this worker is never evicted; one larger than the
whole cap is still built, used and then the first to go. Two workers sharing the cache
build one environment once (the second waits for the first's lock).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from .. import limits, oslock, userdirs

log = logging.getLogger("gpumesh.worker")

#: Longest an environment build may take, seconds.
BUILD_TIMEOUT_S = 1800.0
#: How often a worker waiting for another's build of the same environment looks again.
WAIT_POLL_S = 0.25


#: Most characters of uv's output an :class:`InstallError` carries.
MAX_REASON_CHARS = 1500
#: Words of the lines of uv's output that carry why it failed: its resolver's
#: explanation ("Because the current Python version (3.10.13) does not satisfy
#: Python>=3.11 and ... we can conclude that ..."), its "No solution found" and hints.
REASON_WORDS = ("python", "because", "not satisfy", "no solution", "unsatisfiable", "hint",
                "error")
#: Lines of uv's output kept when none carries those words (its last ones).
TAIL_LINES = 6


class InstallError(Exception):
    """An environment could not be built; the message ends with uv's own words."""


def uv_reason(output: str) -> str:
    """The lines of uv's failed ``output`` that say why, in their order, joined by
    `` / ``, at most :data:`MAX_REASON_CHARS` (the first, which carry the cause, kept):
    those with one of :data:`REASON_WORDS`, else the last :data:`TAIL_LINES`. Keeping
    only the last lines lost the reason, which uv prints first (the Python version a
    package needs, say), and kept its download progress."""
    lines = [ln.strip() for ln in output.strip().splitlines() if ln.strip()]
    kept = [ln for ln in lines if any(w in ln.lower() for w in REASON_WORDS)] or lines[-TAIL_LINES:]
    text = " / ".join(kept)
    return text if len(text) <= MAX_REASON_CHARS else text[:MAX_REASON_CHARS - 3] + "..."


def find_uv() -> str | None:
    """The ``uv`` executable: on PATH, else the one the ``uv`` Python package ships."""
    found = shutil.which("uv")
    if found:
        return found
    try:
        from uv import find_uv_bin
        return find_uv_bin()
    except (ImportError, FileNotFoundError):
        return None


def default_root() -> Path:
    env = limits.setting("GPUMESH_ENV_DIR")
    return Path(env).expanduser() if env else userdirs.cache_dir() / "envs"


def default_cap_bytes() -> int:
    return limits.setting("GPUMESH_ENV_CACHE_MB")


def env_key(requires) -> str:
    """The cache key of an environment: its requirements, for this Python and platform."""
    ident = [platform.python_implementation(), platform.python_version(), sys.platform,
             platform.machine(), sorted(requires)]
    return hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:24]


def _size(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


class EnvCache:
    """The environments of one worker (or several sharing ``root``)."""

    def __init__(self, root: Path | None = None, cap_bytes: int | None = None,
                 uv: str | None = None):
        self.root = Path(root or default_root())
        self.cap_bytes = default_cap_bytes() if cap_bytes is None else cap_bytes
        self.uv = uv or find_uv()
        self._lock = threading.Lock()
        self._in_use: dict[str, int] = {}

    def acquire(self, requires) -> tuple[str, str]:
        """``(key, site directory)`` of the environment for ``requires``, built if need
        be; hold it until :meth:`release`. Raises :class:`InstallError`."""
        key = env_key(requires)
        with self._lock:
            self._in_use[key] = self._in_use.get(key, 0) + 1
        try:
            site = self._ensure(key, list(requires))
        except BaseException:
            self.release(key)
            raise
        return key, site

    def release(self, key: str) -> None:
        with self._lock:
            n = self._in_use.get(key, 0) - 1
            if n > 0:
                self._in_use[key] = n
            else:
                self._in_use.pop(key, None)

    def _ensure(self, key: str, requires: list[str]) -> str:
        final = self.root / key
        deadline = time.monotonic() + BUILD_TIMEOUT_S
        built = False
        while True:
            if (final / "ready").is_file():
                os.utime(final / "ready")  # most recently used
                if not built:
                    log.info("environment %s reused (%s)", key[:12], ", ".join(requires))
                return str(final / "site")
            self.root.mkdir(parents=True, exist_ok=True)
            try:
                lock = oslock.acquire(self.root / f".{key}.lock")
            except oslock.Held:  # another worker is building it: wait for its result
                if time.monotonic() > deadline:
                    raise InstallError(f"waited {BUILD_TIMEOUT_S:.0f} s for another worker "
                                       f"to build the environment for {requires}") from None
                time.sleep(WAIT_POLL_S)
                continue
            try:
                if not (final / "ready").is_file():
                    self._build(key, requires, final)
                    built = True
                    self.evict()
            finally:
                lock.release()

    def _build(self, key: str, requires: list[str], final: Path) -> None:
        if self.uv is None:
            raise InstallError("this worker allows installs but has no uv to build with: "
                               "pip install uv")
        tmp = self.root / f".{key}.{os.getpid()}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        t0 = time.monotonic()
        cmd = [self.uv, "pip", "install", "--quiet", "--python", sys.executable,
               "--target", str(tmp / "site"), *requires]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S,
                               stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise InstallError(f"could not build the environment for {requires}: {e}") from None
        if r.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            raise InstallError(f"uv could not install {requires}: " + uv_reason(r.stderr or r.stdout))
        size = _size(tmp)
        (tmp / "requires.json").write_text(json.dumps({"requires": requires, "bytes": size}))
        shutil.rmtree(final, ignore_errors=True)  # a half-made one from a crash
        os.replace(tmp, final)
        (final / "ready").write_bytes(b"")
        log.info("environment %s built in %.1f s (%d MiB: %s)", key[:12],
                 time.monotonic() - t0, size // 2**20, ", ".join(requires))

    def entries(self) -> list[tuple[float, int, Path]]:
        """``(last used, bytes, path)`` of every ready environment, least recent first."""
        out: list[tuple[float, int, Path]] = []
        try:
            dirs = [p for p in self.root.iterdir() if not p.name.startswith(".")]
        except OSError:
            return out
        for d in dirs:
            try:
                used = (d / "ready").stat().st_mtime
                size = int(json.loads((d / "requires.json").read_text()).get("bytes", 0))
            except (OSError, ValueError):
                continue
            out.append((used, size, d))
        return sorted(out)

    def evict(self) -> list[Path]:
        """Remove least recently used environments not in use until the cache is within
        its cap; returns those removed."""
        entries = self.entries()
        total = sum(size for _, size, _ in entries)
        removed = []
        with self._lock:
            busy = set(self._in_use)
        for _, size, path in entries:
            if total <= self.cap_bytes:
                break
            if path.name in busy:
                continue
            try:
                lock = oslock.acquire(self.root / f".{path.name}.lock")
            except (oslock.Held, OSError):
                continue  # being built or rebuilt right now
            try:
                (path / "ready").unlink(missing_ok=True)  # no longer offered, then gone
                shutil.rmtree(path, ignore_errors=True)
            finally:
                lock.release()
            total -= size
            removed.append(path)
            log.info("environment %s evicted (cache over %d MiB)", path.name[:12],
                     self.cap_bytes // 2**20)
        return removed
