"""The wheel of the gpumesh this coordinator runs, for other machines to install.

``GET /v1/dist/gpumesh-<version>-py3-none-any.whl`` answers it without a token: the code
is not a secret, and a machine that is about to join has nothing else yet. The package
index is no way to get it (PyPI's ``gpumesh`` is another project, with another
protocol), and a second machine must run exactly the code of the coordinator::

    pip install http://HOST:PORT/v1/dist/gpumesh-0.1.0-py3-none-any.whl
    gpumesh join http://HOST:PORT --token=...

The wheel is made on first request from the *installed* distribution: the files of the
``gpumesh`` package this process imported (an editable install's source tree, or a
regular install's site-packages copy) plus the distribution's own metadata
(``METADATA``, ``entry_points.txt``, licence files). That needs no build backend and no
network (``pip wheel`` of a source tree would fetch setuptools into an isolated build
environment), gives the same result for every kind of install, and carries exactly the
code that runs here, local edits included. Entries are written in sorted order with a
fixed timestamp, so the same code always gives the same bytes (and sha256).

It is kept as ``<data dir>/dist/<name>``, rebuilt once per coordinator process (a
restarted coordinator may run edited code under the same version number).
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import threading
import zipfile
from importlib import metadata
from pathlib import Path

from .. import protocol
from .._version import __version__

log = logging.getLogger("gpumesh.coordinator")

DIST_NAME = "gpumesh"
WHEEL_TAG = "py3-none-any"
#: Route prefix the wheel is served under (no token needed).
DIST_PATH = protocol.DIST
#: Distribution metadata files that describe one installation, not the package: never copied.
_LOCAL_FILES = {"RECORD", "INSTALLER", "REQUESTED", "direct_url.json", "WHEEL"}
#: Timestamp of every entry (zip's epoch, 1980): same code, same wheel bytes.
_ZIP_TIME = (1980, 1, 1, 0, 0, 0)


class DistUnavailable(Exception):
    """This coordinator cannot make its wheel (e.g. it runs from a source tree that was
    never installed); the message says what to do."""


def wheel_name(version: str = __version__) -> str:
    """``gpumesh-<version>-py3-none-any.whl`` (the version with ``-`` made ``_``, as
    wheel file names require)."""
    return f"{DIST_NAME}-{version.replace('-', '_')}-{WHEEL_TAG}.whl"


def wheel_url(base_url: str, version: str = __version__) -> str:
    """The URL of gpumesh ``version``'s wheel on the coordinator at ``base_url``."""
    return f"{base_url.rstrip('/')}{DIST_PATH}/{wheel_name(version)}"


def install_command(base_url: str, version: str = __version__) -> str:
    """The one command that installs the coordinator's gpumesh on another machine."""
    return f"pip install {wheel_url(base_url, version)}"


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return "sha256=" + digest.decode()


def _package_files(package_dir: Path) -> list[tuple[str, Path]]:
    """``(archive name, path)`` of every file of the package, bytecode caches left out."""
    out = []
    for root, dirs, files in os.walk(package_dir):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for f in sorted(files):
            if f.endswith((".pyc", ".pyo")):
                continue
            path = Path(root) / f
            rel = path.relative_to(package_dir.parent).as_posix()
            out.append((rel, path))
    return out


def _metadata_files(dist: metadata.Distribution, version: str) -> list[tuple[str, bytes]]:
    """The distribution's own metadata files, as ``(name inside .dist-info, bytes)``."""
    out: dict[str, bytes] = {}
    for f in dist.files or ():
        parts = f.parts
        if len(parts) < 2 or not parts[0].endswith(".dist-info") or parts[1] in _LOCAL_FILES:
            continue
        try:
            out["/".join(parts[1:])] = Path(str(dist.locate_file(f))).read_bytes()
        except OSError:
            continue
    meta = out.get("METADATA")
    if meta is None:
        text = dist.read_text("METADATA")
        if text is None:
            raise DistUnavailable("the installed gpumesh has no METADATA; reinstall it (pip install .)")
        meta = text.encode()
    # A stale editable install may still say an older version: the wheel says this one.
    lines = meta.decode("utf-8").split("\n")
    for i, line in enumerate(lines):
        if line.startswith("Version:"):
            lines[i] = f"Version: {version}"
            break
    out["METADATA"] = "\n".join(lines).encode("utf-8")
    if "entry_points.txt" not in out:
        out["entry_points.txt"] = b"[console_scripts]\ngpumesh = gpumesh.cli:main\n"
    return sorted(out.items())


def build_wheel(out_dir: Path) -> Path:
    """Write the wheel of the running gpumesh into ``out_dir``; returns its path.

    Raises :class:`DistUnavailable` if no installed distribution describes this code,
    ``OSError`` if ``out_dir`` cannot be written.
    """
    version = __version__  # (the code inside is this version: the wheel must say so)
    import gpumesh
    try:
        dist = metadata.distribution(DIST_NAME)
    except metadata.PackageNotFoundError:
        raise DistUnavailable("this coordinator runs gpumesh from a source tree that is not "
                              "installed; install it (pip install .) to serve its wheel") from None
    package_dir = Path(gpumesh.__file__).resolve().parent
    info_dir = f"{DIST_NAME}-{version.replace('-', '_')}.dist-info"
    entries: list[tuple[str, bytes]] = [(name, path.read_bytes())
                                        for name, path in _package_files(package_dir)]
    entries += [(f"{info_dir}/{name}", data) for name, data in _metadata_files(dist, version)]
    entries.append((f"{info_dir}/WHEEL",
                    f"Wheel-Version: 1.0\nGenerator: gpumesh {version}\nRoot-Is-Purelib: true\n"
                    f"Tag: {WHEEL_TAG}\n".encode()))
    record = "".join(f"{name},{_record_hash(data)},{len(data)}\n" for name, data in entries)
    entries.append((f"{info_dir}/RECORD", (record + f"{info_dir}/RECORD,,\n").encode()))

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / wheel_name(version)
    tmp = out_dir / f".{path.name}.{os.getpid()}.tmp"
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data in entries:
            zi = zipfile.ZipInfo(name, date_time=_ZIP_TIME)
            zi.compress_type = zipfile.ZIP_DEFLATED
            zi.external_attr = 0o644 << 16
            zf.writestr(zi, data)
    os.replace(tmp, path)
    return path


class WheelCache:
    """The wheel, built once per process into ``directory`` on first :meth:`get`
    (thread-safe: concurrent first requests build it once)."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self._lock = threading.Lock()
        self._data: bytes | None = None

    def get(self) -> bytes:
        """The wheel's bytes. Raises :class:`DistUnavailable` or ``OSError``."""
        with self._lock:
            if self._data is None:
                path = build_wheel(self.directory)
                self._data = path.read_bytes()
                log.info("serving %s (%d KiB, sha256 %s) for other machines to install",
                         path.name, len(self._data) // 1024,
                         hashlib.sha256(self._data).hexdigest()[:16])
            return self._data
