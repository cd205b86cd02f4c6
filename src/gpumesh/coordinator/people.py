"""People: named tokens with a role, who may do what, and whose job is whose.

A coordinator always has its main token (role ``admin``, person ``admin``) and may have a
worker token (role ``worker``, person ``worker``); both come from ``serve`` and are
checked by :mod:`.auth`. An admin adds more with ``gpumesh token add NAME --role R``
(``POST /v1/tokens``): each is one person's own token, kept in the store as
``sha256(token)`` only and recognised by that digest.

**Why a plain SHA-256 and not the KDF of the main token.** These tokens are drawn by the
coordinator (:func:`gpumesh.config.generate_token`, 256 random bits), never chosen by a
person, so there is nothing for a KDF to stretch: a guesser faces 2**256 candidates either
way. A digest also lets the token be found by an index lookup without trying every stored
hash, and keeps working across restarts. A stolen database gives names and digests, not
tokens.

Roles, from most to least allowed::

    admin    everything, including every person's jobs and the token admin routes
    submit   submit jobs; read, cancel, retry and release *their own* jobs; see the pool
    view     see the pool, the job list and job states; never submit, cancel or read
             anyone's results or output
    worker   act as a worker (register, lease, post results); nothing else

A revoked token is dropped from the in-memory table in the same event-loop step that
deletes its row: the next request presenting it is refused.
"""

from __future__ import annotations

import hashlib
import re
import time
from dataclasses import dataclass

ROLE_ADMIN = "admin"
ROLE_SUBMIT = "submit"
ROLE_VIEW = "view"
ROLE_WORKER = "worker"
ROLES = (ROLE_ADMIN, ROLE_SUBMIT, ROLE_VIEW, ROLE_WORKER)

#: The persons the serve tokens stand for; no added token may take these names.
MAIN_PERSON = "admin"
WORKER_PERSON = "worker"
RESERVED_NAMES = (MAIN_PERSON, WORKER_PERSON)

#: A person's name: what ``jobs``, ``status``, the dashboard and the metrics show.
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}\Z")
#: Most tokens one coordinator keeps (a pool is a few friends or a lab, not a SaaS).
MAX_PEOPLE = 1000
#: Highest ``--max-running`` accepted.
MAX_RUNNING_CAP = 1_000_000

#: Who may call what, by route group (see ``route(..., roles=...)`` in :mod:`.app`).
READ = frozenset({ROLE_ADMIN, ROLE_SUBMIT, ROLE_VIEW})          # pool, job list, job states
SUBMIT = frozenset({ROLE_ADMIN, ROLE_SUBMIT})                    # submit, own jobs
WORKER = frozenset({ROLE_ADMIN, ROLE_WORKER})                    # worker protocol
CALLER_AND_WORKER = frozenset({ROLE_ADMIN, ROLE_SUBMIT, ROLE_WORKER})  # blobs, handoff
ADMIN = frozenset({ROLE_ADMIN})                                  # token admin


@dataclass(frozen=True)
class Identity:
    """Who a request comes from: ``name`` (the person), ``role`` (one of :data:`ROLES`),
    ``max_running`` (their cap on running tasks, None: none)."""

    name: str
    role: str
    max_running: int | None = None

    @property
    def admin(self) -> bool:
        return self.role == ROLE_ADMIN

    def may_touch(self, owner: str | None) -> bool:
        """Whether this person may read the results of, cancel or retry a job owned by
        ``owner`` (None: a job from before people existed, the admin's)."""
        return self.admin or (self.role == ROLE_SUBMIT and owner == self.name)


def error_outline(error: dict | None) -> dict | None:
    """What of a task's ``error`` someone else's job shows: its kind and type, never its
    message or traceback (they may quote the arguments, or what the task printed)."""
    if not error:
        return error
    return {k: error[k] for k in ("kind", "type") if k in error}


def task_outline(task: dict) -> dict:
    """A task as :meth:`Store.task_rows` gives it, as someone else's job shows it: each
    error outlined (:func:`error_outline`), its earlier attempts' too."""
    out = dict(task, error=error_outline(task.get("error")))
    if task.get("history"):
        out["history"] = [dict(h, error=error_outline(h["error"])) if h.get("error") else h
                          for h in task["history"]]
    return out


MAIN = Identity(MAIN_PERSON, ROLE_ADMIN)
WORKER_IDENTITY = Identity(WORKER_PERSON, ROLE_WORKER)


def digest(token: bytes) -> str:
    """``sha256(token)`` as hex: what the store keeps of a person's token."""
    return hashlib.sha256(token).hexdigest()


class NameTaken(ValueError):
    """The name is someone's already (or differs from theirs only in case)."""


def check_name(name) -> str:
    """``name`` if it is a valid, unreserved person name; ``ValueError`` otherwise."""
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise ValueError(f"a name is 1 to 64 letters, digits and . _ @ - (starting with a "
                         f"letter or digit), not {str(name)[:80]!r}")
    if name.lower() in RESERVED_NAMES:
        raise ValueError(f"{name!r} is reserved for the coordinator's own "
                         f"{'main' if name.lower() == MAIN_PERSON else 'worker'} token")
    return name


def check_role(role) -> str:
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, not {str(role)[:40]!r}")
    return role


def check_max_running(n) -> int | None:
    if n is None:
        return None
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_RUNNING_CAP:
        raise ValueError(f"max_running must be a whole number from 1 to {MAX_RUNNING_CAP}")
    return n


class People:
    """The added tokens, kept in ``store`` and mirrored in memory for the per-request
    lookup. ``on_change(people)`` is called after every add or revoke (the coordinator
    uses it to refresh the per-person caps). Runs on the event loop: no locking."""

    def __init__(self, store, on_change=None):
        self.store = store
        self.on_change = on_change
        self._by_digest: dict[str, Identity] = {}
        self._rows: dict[str, dict] = {}
        for row in store.tokens():
            self._remember(row)

    def _remember(self, row: dict) -> None:
        self._rows[row["name"]] = row
        self._by_digest[row["digest"]] = Identity(row["name"], row["role"], row["max_running"])

    def lookup(self, presented: bytes) -> Identity | None:
        """The person whose token ``presented`` is, or None."""
        return self._by_digest.get(digest(presented))

    def has_digest(self, d: str) -> bool:
        """Whether a token with SHA-256 ``d`` (hex) is still valid (not revoked)."""
        return d in self._by_digest

    def caps(self) -> dict[str, int]:
        """``{name: max_running}`` of the people with a cap."""
        return {n: r["max_running"] for n, r in self._rows.items() if r["max_running"]}

    def list(self) -> list[dict]:
        """``[{"name", "role", "max_running", "created"}]`` by name (never a token or digest)."""
        return [{k: r[k] for k in ("name", "role", "max_running", "created")}
                for _, r in sorted(self._rows.items())]

    def add(self, name: str, role: str, max_running: int | None, token: str) -> dict:
        """Add ``name`` with ``token`` (already drawn by the caller). :class:`NameTaken`
        for a taken name (or one that differs from it only in case); ``ValueError`` for a
        bad name, role or cap, or when :data:`MAX_PEOPLE` are kept."""
        check_name(name)
        check_role(role)
        check_max_running(max_running)
        if name in self._rows:
            raise NameTaken(f"{name!r} already has a token; revoke it first to issue a new one")
        # Names are kept as given, but two that differ only in case would be two people
        # the dashboard, `token list` and /metrics could not tell apart (reserved names
        # are compared without case too).
        alike = next((n for n in self._rows if n.casefold() == name.casefold()), None)
        if alike is not None:
            raise NameTaken(f"{name!r} is too like {alike!r}, who has a token: names are "
                            f"compared without case")
        if len(self._rows) >= MAX_PEOPLE:
            raise ValueError(f"this coordinator keeps at most {MAX_PEOPLE} tokens")
        row = {"name": name, "role": role, "max_running": max_running, "created": time.time(),
               "digest": digest(token.encode("utf-8"))}
        self.store.add_token(**row)
        self._remember(row)
        self._changed()
        return {k: row[k] for k in ("name", "role", "max_running", "created")}

    def revoke(self, name: str) -> str | None:
        """Forget ``name``'s token at once; names are compared without case (as :meth:`add`
        does: ``ALICE`` is alice) when no name is exactly it. Returns the name revoked,
        None if there was none."""
        if name not in self._rows:
            alike = [n for n in self._rows if n.casefold() == name.casefold()]
            name = alike[0] if len(alike) == 1 else name  # (two such, from before: exact only)
        row = self._rows.pop(name, None)
        if row is None:
            return None
        self._by_digest.pop(row["digest"], None)
        self.store.revoke_token(name)
        self._changed()
        return name

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change(self)
