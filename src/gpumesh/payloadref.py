"""One reference to a payload's bytes, wherever they lie.

A payload (a task's arguments, its result) reaches the process that unpickles it in one
of four ways, and each is a :class:`PayloadRef` of its own kind:

=========  =====================================  ==================  =====================
kind       where the bytes are                    :meth:`~PayloadRef.open`   :meth:`~PayloadRef.release`
=========  =====================================  ==================  =====================
inline     in hand: a frame of an HTTP body, a    the bytes' view     drops the bytes
           blob read from a socket
store      a payload file of the coordinator's    maps the range      closes the descriptor
           store (same machine), ``path`` +       (copy-on-write),    it opened (the file
           ``offset`` + ``size``, or a            under a shared      is the store's)
           descriptor :meth:`~PayloadRef.pin`     lock held while
           opened (under that lock)               the map lives (see
                                                  gpumesh.handoff)
handoff    a file a sender wrote whole for its    maps the file       removes the file
           receiver (the handoff directory, the
           spawn runtime's spool)
shm        shared memory: a memory file           maps the range      closes the descriptor
           (``memfd``; its descriptor travels by  (copy-on-write)     (``fd``) or removes
           SCM_RIGHTS) or, where there are none                       the file (``path``)
           (Windows, macOS, the spawn runtime),                       when it owns them
           a file of the worker's spool
=========  =====================================  ==================  =====================

A reference crosses a process boundary as JSON, under one key of the message that
carries it (:func:`from_meta` reads it back, :meth:`PayloadRef.to_meta` writes it): a
descriptor is named by its index among the descriptors the message passes. A view from
:meth:`~PayloadRef.open` outlives :meth:`~PayloadRef.release` (a map outlives its file
and its descriptor), so a receiver opens, unpickles, and releases at once.

Over HTTP a frames body's metadata carries its references under one key, ``refs``
(:data:`REFS`): a map from the frame number (``"0"`` = the first frame after the meta) or
the field (``"args"`` of a task grant, ``"result"`` of a results-page item) to the
reference's wire form (:meth:`PayloadRef.to_wire`, :func:`from_wire`)::

    {"kind": "handoff", "name": "<24 hex>.part", "size": 123}   a file in the handoff directory
    {"kind": "store", "path": "args/<job>/<task>", "size": 123}  a file of the store, relative
                                                                 to its blob directory

A wire form never carries an absolute path, nor one that leaves its directory. Until the
next release the API's old keys are written and read too (``handoff_files`` per frame,
``args_file``, a result's ``file``), so that a peer of the same version from before
``refs`` keeps working; :func:`handoff_names` and :func:`store_file` read those.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import handoff

KINDS = ("inline", "store", "handoff", "shm")
#: The kinds that travel over HTTP by reference (a file on the coordinator's machine).
WIRE_KINDS = ("handoff", "store")
#: The one key of a frames body's metadata that carries its payload references.
REFS = "refs"
#: Open flags: not inherited by child processes, binary on Windows.
_RDONLY = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)


class BadRef(ValueError):
    """A payload reference that cannot be read: its message names the field."""


class PayloadRef:
    """A payload's bytes by reference; see the module's table for the kinds.

    ``offset`` and ``size`` are in bytes (``size`` None: to the end of the file).
    ``owned``: :meth:`release` closes ``fd`` / removes ``path`` (else they belong to
    someone else: the store, or the worker agent that made the shared memory).
    ``keep``: an object kept alive until release (the buffer a range is part of).
    Raises :class:`BadRef` for values that name no payload.
    """

    __slots__ = ("kind", "data", "path", "fd", "offset", "size", "owned", "owned_fd", "keep",
                 "_released")

    def __init__(self, kind: str, *, data: Any = None, path: str | os.PathLike | None = None,
                 fd: int | None = None, offset: int = 0, size: int | None = None,
                 owned: bool = False, keep: Any = None):
        if kind not in KINDS:
            raise BadRef(f"payload reference: 'kind' must be one of {', '.join(KINDS)}, not {kind!r}")
        for name, value in (("offset", offset), ("size", size)):
            if value is not None and (type(value) is not int or value < 0):
                raise BadRef(f"payload reference: {name!r} must be a whole number of bytes >= 0, "
                             f"not {value!r}")
        if kind == "inline":
            if data is None:
                raise BadRef("payload reference: an inline payload needs its 'data'")
        elif fd is not None:  # an open file (a memory file has no path; a pinned one may)
            if type(fd) is not int or fd < 0:
                raise BadRef(f"payload reference: 'fd' must be an open descriptor, not {fd!r}")
        elif not isinstance(path, (str, os.PathLike)) or not str(path):
            raise BadRef(f"payload reference: a {kind} payload needs a 'path', not {path!r}")
        self.kind, self.data, self.fd = kind, data, fd
        self.path = None if path is None else str(path)
        self.offset, self.size, self.owned, self.keep = offset, size, owned, keep
        self.owned_fd = False  # a descriptor pin() opened
        self._released = False

    # ------------------------------------------------------------ constructors ------
    @classmethod
    def inline(cls, data) -> PayloadRef:
        """Bytes in hand (``bytes``, ``bytearray``, ``memoryview``)."""
        return cls("inline", data=data, size=memoryview(data).nbytes)

    @classmethod
    def shared(cls, body, offset: int, size: int) -> PayloadRef:
        """``size`` bytes at ``offset`` of a :mod:`gpumesh.worker.membody` buffer (a memory
        file, or a spool file where there are none). The buffer stays alive until release;
        it frees its memory itself once nothing maps it."""
        fd, path = getattr(body, "fd", None), getattr(body, "path", None)
        return cls("shm", fd=fd, path=None if fd is not None else path, offset=offset,
                   size=size, keep=body)

    # ------------------------------------------------------------ using it ---------
    def __len__(self) -> int:
        if self.size is not None:
            return self.size
        if self.fd is not None:
            return os.fstat(self.fd).st_size - self.offset
        assert self.path is not None  # (no data, no fd: __init__ asked for a path)
        return os.stat(self.path).st_size - self.offset

    def pin(self) -> PayloadRef:
        """Open the file now (a ``store`` or ``handoff`` reference), so that the payload
        stays readable even if the file is removed before :meth:`open`; the descriptor is
        closed by :meth:`release`. A store file is opened under a shared lock (see
        gpumesh.handoff), which lasts while this descriptor or any copy of it is open (a
        task process it is passed to, the maps :meth:`open` makes): the store does not
        give the file to its pool meanwhile. Raises ``OSError`` (``FileNotFoundError``: it
        is gone, or the store no longer names it)."""
        if self.fd is None and self.path is not None:
            self.fd = self._locked_fd() if self.kind == "store" else os.open(self.path, _RDONLY)
            self.owned_fd = True
        return self

    def open(self) -> memoryview:
        """The payload's bytes: a writable view (copy-on-write for the file kinds, whose
        pages are shared until written). Raises ``FileNotFoundError``/``OSError`` for a
        file that is gone, :class:`BadRef` for a range outside it or a released ref."""
        if self._released:
            raise BadRef(f"payload reference ({self.kind}): already released")
        if self.kind == "inline":
            return memoryview(self.data).cast("B")
        if self.keep is not None:  # a range of a buffer of this process: no map needed
            view = memoryview(self.keep).cast("B")
            return view[self.offset:self.offset + (view.nbytes if self.size is None else self.size)]
        if self.kind == "store":
            return self._open_locked()
        fd, close = self.fd, False
        if fd is None:
            assert self.path is not None  # (no data, no fd: __init__ asked for a path)
            fd, close = os.open(self.path, _RDONLY), True
        try:
            return handoff.map_fd(fd, self.offset, self.size)
        except ValueError as e:
            raise BadRef(f"payload reference ({self.kind}): 'offset'/'size': {e}") from None
        finally:
            if close:
                os.close(fd)

    def _open_locked(self) -> memoryview:
        """A store file mapped under a shared lock held while the map lives, so that the
        store never gives the file to its pool (gpumesh.handoff) under it: by its path, or
        from the descriptor :meth:`pin` opened under the lock (here, or in the agent that
        passed it to this task process), a copy of which the map keeps open. Raises
        ``FileNotFoundError`` if the store no longer names the file."""
        # (flock belongs to the open file description: a copy of the descriptor holds
        # the lock that pin() took for as long as the copy stays open)
        fd = self._locked_fd() if self.fd is None else os.dup(self.fd)
        try:
            return handoff.map_locked(fd, self.offset, self.size)  # (takes fd over)
        except ValueError as e:
            raise BadRef(f"payload reference ({self.kind}): 'offset'/'size': {e}") from None

    def _locked_fd(self) -> int:
        """The store file opened by its path, under a shared lock (handoff.lock_shared).
        Raises ``FileNotFoundError`` if it is gone or the store no longer names it."""
        assert self.path is not None  # (a store ref without fd has a path)
        fd = os.open(self.path, _RDONLY)
        try:
            if not handoff.lock_shared(fd, self.path):
                raise FileNotFoundError(f"{self.path}: released by the store")
        except BaseException:
            os.close(fd)
            raise
        return fd

    def release(self) -> None:
        """Give back what this reference holds (once; later calls do nothing): a
        descriptor it opened or owns is closed, a file it owns is removed, the buffer it
        kept is let go. Views already opened stay valid. Never raises."""
        if self._released:
            return
        self._released = True
        fd, self.fd = self.fd, None
        if fd is not None and (self.owned or self.owned_fd):
            try:
                os.close(fd)
            except OSError:
                pass
        if self.owned and self.path is not None and self.kind in ("handoff", "shm"):
            try:
                os.unlink(self.path)
            except OSError:  # gone already; or still mapped on Windows: it goes with the spool
                pass
        unlink = getattr(self.keep, "unlink", None)
        if self.kind == "shm" and unlink is not None:
            unlink()  # a spool file the agent made: the task has mapped it by now
        self.data = self.keep = None

    # ------------------------------------------------------------ as JSON ----------
    def to_meta(self, by_path: bool = False) -> tuple[dict, list[int]]:
        """The reference as JSON for another process on this machine, and the descriptors
        to pass with it (``fd`` in the JSON is an index into them). ``by_path``: for a
        receiver that cannot be passed descriptors (the spawn runtime): the file's path
        only, and no descriptors. Raises :class:`BadRef` for an inline payload, which
        travels as bytes, not by reference, and (``by_path``) for one that has no path."""
        if self.kind == "inline":
            raise BadRef("payload reference: an inline payload travels as bytes, not as a reference")
        if by_path and self.path is None:
            raise BadRef(f"payload reference ({self.kind}): a memory file has no 'path'")
        meta: dict = {"kind": self.kind, "offset": self.offset}
        if self.size is not None:
            meta["size"] = self.size
        fds: list[int] = []
        if self.fd is not None and not by_path:
            meta["fd"], fds = 0, [self.fd]
            return meta, fds
        if self.path is not None:
            meta["path"] = self.path
        return meta, fds

    def to_wire(self, root: str | os.PathLike) -> dict:
        """The reference's JSON for ``refs`` over HTTP (see the module's docstring):
        ``root`` is the directory its file lies in (the handoff directory for a handoff
        file, the store's blob directory for a store file). Raises :class:`BadRef` for a
        kind that does not travel over HTTP (inline bytes, shared memory) and for a file
        outside ``root``."""
        if self.kind not in WIRE_KINDS or self.path is None:
            raise BadRef(f"payload reference ({self.kind}): only a handoff or store file "
                         "travels over HTTP by reference")
        rel = os.path.relpath(self.path, root).replace(os.sep, "/")
        if self.kind == "handoff" and not handoff.NAME.fullmatch(rel):
            raise BadRef(f"payload reference: {self.path!r} is not a handoff file of {root}")
        if self.kind == "store" and (rel.startswith("/") or _UNSAFE.search(rel)):
            raise BadRef(f"payload reference: {self.path!r} is not a payload file of {root}")
        wire: dict = {"kind": self.kind, "name" if self.kind == "handoff" else "path": rel}
        if self.offset:
            wire["offset"] = self.offset
        if self.size is not None:
            wire["size"] = self.size
        return wire

    def __repr__(self) -> str:
        where = f"fd {self.fd}" if self.fd is not None else self.path
        return f"PayloadRef({self.kind}, {where}, offset={self.offset}, size={self.size})"


def from_meta(meta: Any, fds: Sequence[int] = ()) -> PayloadRef:
    """Read a reference written by :meth:`PayloadRef.to_meta` in another process; ``fds``
    are the descriptors its message passed (this process owns them: release closes the
    one the reference names). Raises :class:`BadRef` naming the field that is wrong."""
    if not isinstance(meta, dict):
        raise BadRef(f"payload reference: expected a JSON object, not {type(meta).__name__}")
    kind = meta.get("kind")
    if kind == "inline" or kind not in KINDS:
        raise BadRef(f"payload reference: 'kind' must be one of store, handoff, shm, not {kind!r}")
    fd = None
    if "fd" in meta:
        at = meta["fd"]
        if type(at) is not int or not 0 <= at < len(fds):
            raise BadRef(f"payload reference: 'fd' must index the {len(fds)} descriptor(s) "
                         f"passed with it, not {at!r}")
        fd = fds[at]
    elif not isinstance(meta.get("path"), str) or not meta["path"]:
        raise BadRef(f"payload reference: 'path' must name a file, not {meta.get('path')!r}")
    # A descriptor passed to us is ours to close; a file is the sender's to remove.
    return PayloadRef(kind, path=meta.get("path") if fd is None else None, fd=fd,
                      offset=meta.get("offset", 0), size=meta.get("size"), owned=fd is not None)


# ---------------------------------------------------------------- over HTTP -------
#: Where a store file's path (relative to the store's blob directory) may not lead.
_UNSAFE = re.compile(r"(^|/)\.\.(/|$)")


def store_file(blob_dir: str | os.PathLike, rel: Any) -> PayloadRef:
    """A ``store`` reference to the payload file ``rel`` that a coordinator named (a path
    relative to its blob directory: ``args_file``, a result's ``file``). Raises
    :class:`BadRef` for a path that leaves the directory."""
    if not isinstance(rel, str) or not rel or rel.startswith(("/", "\\")) or _UNSAFE.search(rel):
        raise BadRef(f"payload reference: not a payload path: {rel!r}")
    return PayloadRef("store", path=Path(blob_dir) / rel)


def check_wire(wire: Any, field: str) -> dict:
    """``wire`` checked to be a reference's wire form (see the module's docstring), with
    no I/O: returns it. Raises :class:`BadRef` whose message starts with ``field`` (e.g.
    ``refs.0``) for anything else: another kind, a handoff name that is not one, a store
    path that is absolute or leaves the blob directory, a bad ``offset``/``size``, a key
    that is not one of these."""
    if not isinstance(wire, dict):
        raise BadRef(f"{field}: a payload reference must be an object, not {type(wire).__name__}")
    kind = wire.get("kind")
    if kind not in WIRE_KINDS:
        raise BadRef(f"{field}: 'kind' must be handoff or store, not {kind!r}")
    where = "name" if kind == "handoff" else "path"
    extra = set(wire) - {"kind", where, "offset", "size"}
    if extra:
        raise BadRef(f"{field}: a {kind} reference has no {', '.join(map(repr, sorted(extra)))}")
    rel = wire.get(where)
    if kind == "handoff" and not (isinstance(rel, str) and handoff.NAME.fullmatch(rel)):
        raise BadRef(f"{field}: 'name' must be a handoff file name, not {rel!r}")
    if kind == "store" and not (isinstance(rel, str) and rel and not rel.startswith(("/", "\\"))
                                and not any(c in rel for c in "\\:\0") and not _UNSAFE.search(rel)):
        raise BadRef(f"{field}: 'path' must be a payload path inside the store, not {rel!r}")
    for name in ("offset", "size"):
        v = wire.get(name, 0)
        if type(v) is not int or v < 0:
            raise BadRef(f"{field}: {name!r} must be a whole number of bytes >= 0, not {v!r}")
    return wire


def check_refs(refs: Any, field: str = REFS, keys: Sequence[str] | None = None) -> dict:
    """``refs`` checked to be a map of key -> wire form; ``keys``: the keys it may have
    (None: frame numbers). Returns it. Raises :class:`BadRef` naming the field."""
    if not isinstance(refs, dict):
        raise BadRef(f"{field}: must be an object of frame number -> payload reference")
    for key, wire in refs.items():
        if keys is None and not (isinstance(key, str) and key.isdigit() and len(key) < 10):
            raise BadRef(f"{field}: {key!r} is not a frame number")
        if keys is not None and key not in keys:
            raise BadRef(f"{field}: {key!r} is not one of {', '.join(keys)}")
        check_wire(wire, f"{field}.{key}")
    return refs


def from_wire(wire: Any, root: str | os.PathLike, field: str = REFS) -> PayloadRef:
    """The reference a wire form names (checked by :func:`check_wire`), its file under
    ``root`` (the handoff directory or the store's blob directory, as its kind says).
    The file is not opened: :meth:`PayloadRef.pin` or :meth:`PayloadRef.open` does.
    Raises :class:`BadRef` naming ``field``."""
    wire = check_wire(wire, field)
    rel = wire["name"] if wire["kind"] == "handoff" else wire["path"]
    return PayloadRef(wire["kind"], path=Path(root) / rel, offset=wire.get("offset", 0),
                      size=wire.get("size"))


def refs_meta(meta: dict, refs: dict[str, dict]) -> dict:
    """``meta`` with ``refs`` (key -> wire form) under :data:`REFS`; ``meta`` itself
    when there are none."""
    return dict(meta, **{REFS: refs}) if refs else meta


def handoff_refs(meta: dict, frame_count: int) -> dict[int, dict]:
    """The handoff files a sender named in its frames body's metadata: ``{frame: wire
    form}`` (``name``, and ``size`` where the sender gave it), frame 0 being the first
    after the meta. Read from ``meta["refs"]`` or, from a sender before it, from
    ``meta["handoff_files"]`` (``{"<frame number>": "<file name>"}``). Raises
    :class:`BadRef` (its message starts with the key) for a map that is not one, a frame
    that is not there, a reference that is not to a handoff file (a sender never names
    the store's files), or a name that is not a handoff file name."""
    refs = meta.get(REFS)
    if refs is not None:
        check_refs(refs)
        out = {}
        for key, wire in refs.items():
            if int(key) >= frame_count:
                raise BadRef(f"{REFS}: {key!r} is not a frame number")
            if wire["kind"] != "handoff":
                raise BadRef(f"{REFS}.{key}: a sender may name only handoff files, "
                             f"not {wire['kind']!r}")
            if "offset" in wire:
                raise BadRef(f"{REFS}.{key}: a handoff file is sent whole: no 'offset'")
            out[int(key)] = wire
        return out
    return {i: {"kind": "handoff", "name": name}
            for i, name in _handoff_files(meta, frame_count).items()}


def handoff_names(meta: dict, frame_count: int) -> dict[int, str]:
    """:func:`handoff_refs`' file names: ``{frame: name}``."""
    return {i: wire["name"] for i, wire in handoff_refs(meta, frame_count).items()}


# The key before refs: drop it (here, in the coordinator's schemas and in protocol.py)
# in the release after the one that added refs.
def _handoff_files(meta: dict, frame_count: int) -> dict[int, str]:
    names = meta.get("handoff_files")
    if names is None:
        return {}
    if not isinstance(names, dict):
        raise BadRef("handoff_files: must be an object of frame number -> file name")
    out: dict[int, str] = {}
    for key, name in names.items():
        if not (isinstance(key, str) and key.isdigit() and int(key) < frame_count):
            raise BadRef(f"handoff_files: {key!r} is not a frame number")
        i = int(key)
        if not isinstance(name, str) or not handoff.NAME.fullmatch(name):
            raise BadRef(f"handoff_files: {name!r} is not a handoff file name")
        out[i] = name
    return out


def handoff_meta(meta: dict, names: dict[int, str] | dict[str, str],
                 sizes: dict[int, int] | dict[str, int] | None = None) -> dict:
    """``meta`` with the handoff files of a frames body named, ``{frame: name}`` (see
    :func:`handoff_refs`), under ``refs`` (with their ``sizes`` in bytes, by the same
    keys, where given); ``meta`` itself when there are none."""
    if not names:
        return meta
    sizes = sizes or {}
    refs: dict[str, dict[str, Any]] = {}
    for i, name in names.items():
        refs[str(i)] = {"kind": "handoff", "name": name}
        if i in sizes:
            refs[str(i)]["size"] = sizes[i]  # type: ignore[index]  # (keys shared with names)
    # The old key too, for a coordinator from before refs: drop it in the next release.
    return dict(meta, refs=refs, handoff_files={str(i): name for i, name in names.items()})
