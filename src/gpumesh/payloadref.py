"""One reference to a payload's bytes, wherever they lie.

A payload (a task's arguments, its result) reaches the process that unpickles it in one
of four ways, and each is a :class:`PayloadRef` of its own kind:

=========  =====================================  ==================  =====================
kind       where the bytes are                    :meth:`~PayloadRef.open`   :meth:`~PayloadRef.release`
=========  =====================================  ==================  =====================
inline     in hand: a frame of an HTTP body, a    the bytes' view     drops the bytes
           blob read from a socket
store      a payload file of the coordinator's    maps the range      closes the descriptor
           store (same machine), ``path`` +       (copy-on-write)     it opened (the file
           ``offset`` + ``size``                                      is the store's)
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

Over HTTP the same references keep the keys the API has always had (see
:mod:`gpumesh.handoff`): a sender names its handoff files per frame under
``handoff_files``, a task's arguments kept as a store file come as ``args_file``, a result
as ``file``; :func:`handoff_names` and :func:`store_file` read them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import handoff

KINDS = ("inline", "store", "handoff", "shm")
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
        return os.stat(self.path).st_size - self.offset

    def pin(self) -> PayloadRef:
        """Open the file now (a ``store`` or ``handoff`` reference), so that the payload
        stays readable even if the file is removed before :meth:`open`; the descriptor is
        closed by :meth:`release`. Raises ``OSError`` (``FileNotFoundError``: it is gone)."""
        if self.fd is None and self.path is not None:
            self.fd = os.open(self.path, _RDONLY)
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
        fd, close = self.fd, False
        if fd is None:
            fd, close = os.open(self.path, _RDONLY), True
        try:
            return handoff.map_fd(fd, self.offset, self.size)
        except ValueError as e:
            raise BadRef(f"payload reference ({self.kind}): 'offset'/'size': {e}") from None
        finally:
            if close:
                os.close(fd)

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


def handoff_names(meta: dict, frame_count: int) -> dict[int, str]:
    """The handoff files a sender named in its frames body's metadata: ``{frame: name}``,
    frame 0 being the first after the meta. ``meta["handoff_files"]`` is
    ``{"<frame number>": "<file name>"}``. Raises :class:`BadRef` (its message starts
    with the key) for a map that is not one, a frame that is not there, or a name that is
    not a handoff file name."""
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


def handoff_meta(meta: dict, names: dict[int, str] | dict[str, str]) -> dict:
    """``meta`` with the handoff files of a frames body named, ``{frame: name}`` (see
    :func:`handoff_names`); ``meta`` itself when there are none."""
    if not names:
        return meta
    return dict(meta, handoff_files={str(i): name for i, name in names.items()})
