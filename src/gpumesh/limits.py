"""Named timings, size limits and settings, in one place: the settings table.

Every value here is declared once, as a :class:`Setting` in :data:`SETTINGS`: its name (the
attribute of this module), its value, its unit, a one-line meaning and, where users may
override it, the ``GPUMESH_*`` environment variable. Units are in the names too: ``_S``
seconds, ``_BYTES`` bytes (powers of two: 1 MiB = 2**20).

**Reading a variable.** :func:`setting` is the one place a ``GPUMESH_*`` setting is read
from the environment, parsed and checked: ``setting("GPUMESH_OUTPUT")`` reads it now;
the attributes of this module that a variable overrides (``WORKER_TTL_S``, ...) were read
once, when this module was imported, so a process sees the value it started with. An
empty variable counts as unset. A value that does not parse raises :class:`SettingError`
(a ``ValueError``) naming the variable and what it expects; on/off switches have no bad
values (each switch's meaning says which text changes it).

**Variables that are not settings** (:data:`OTHER_VARIABLES`) are listed with the reason,
read where they are used, and documented in the same table of docs/cli.md: credentials
(kept out of any table that holds or prints values, and wiped from the environment once
read), markers one gpumesh process sets for another it starts, a testing hook, and a
variable whose reading is click's.

**What stays outside.** A value only one module uses, that no user tunes and no other
process has to agree with (a poll interval inside one loop, a cache size of one class, a
placement weight), stays next to its use with its own comment: moving it here would only
separate it from the code it tunes. Everything a coordinator, worker and caller must agree
on (a batch size one side sends and the other accepts, a limit both sides check) is here.

docs/cli.md's "Environment variables" table is checked against :func:`env_rows` (the name,
default, unit, users and meaning of each variable) by tests/unit/test_env_table.py.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")

MiB = 2**20


class SettingError(ValueError):
    """A ``GPUMESH_*`` variable holds text its setting cannot take; the message names the
    variable, the text, and what it expects."""


@dataclass(frozen=True)
class Setting:
    """One value of the settings table.

    ``name``: the attribute of :mod:`gpumesh.limits` holding the value, or, for a setting
    that is only ever read at its use (``value`` None), the variable itself.
    ``value``: the value while no variable overrides it, in ``unit`` (``s``, ``bytes``,
    ``count``, ``chars``, ...). ``meaning``: one line.
    ``env``: the variable that overrides it, if any; ``env_default``, ``env_unit``: the
    variable's default and unit as docs/cli.md writes them; ``used_by``: which commands
    read it; ``parse``: text of the variable -> value (raises ``ValueError`` with what it
    expects)."""

    name: str
    value: Any
    unit: str
    meaning: str
    env: str | None = None
    env_default: str = ""
    env_unit: str = ""
    used_by: str = ""
    parse: Callable[[str], Any] | None = None

    def read(self, environ: Mapping[str, str] | None = None) -> Any:
        """The value ``environ`` (default ``os.environ``) gives this setting now: its
        variable parsed, or ``value`` when the variable is unset or empty. Raises
        :class:`SettingError` for text that does not parse."""
        if self.env is None:
            return self.value
        raw = (os.environ if environ is None else environ).get(self.env, "")
        if raw == "":
            return self.value
        assert self.parse is not None, self.name
        try:
            return self.parse(raw)
        except ValueError as e:
            raise SettingError(f"{self.env}={raw!r}: expected {e}") from None


@dataclass(frozen=True)
class Variable:
    """A ``GPUMESH_*`` (or third-party) variable that is not a setting: documented in
    docs/cli.md like one, read where it is used. ``why``: why it is not in the table."""

    env: str
    env_default: str
    env_unit: str
    used_by: str
    meaning: str
    why: str


#: The settings table: name -> Setting, in declaration order.
SETTINGS: dict[str, Setting] = {}
_BY_ENV: dict[str, Setting] = {}


def _declare(s: Setting) -> Setting:
    assert s.name not in SETTINGS, f"{s.name} declared twice"
    SETTINGS[s.name] = s
    if s.env:
        assert s.env not in _BY_ENV, f"{s.env} declared twice"
        _BY_ENV[s.env] = s
    return s


def _const(name: str, value: T, unit: str, meaning: str) -> T:
    """Declare a value no variable overrides; returns it for the module attribute."""
    _declare(Setting(name, value, unit, meaning))
    return value


def _env(name: str, env: str, parse: Callable[[str], Any], env_default: str, env_unit: str,
         used_by: str, meaning: str, unit: str = "") -> Any:
    """Declare a setting its variable overrides; returns the value read now (at import) for
    the module attribute ``name``. ``env_default`` goes through ``parse`` too, so the
    default is written once, in the variable's own unit."""
    s = _declare(Setting(name, parse(env_default), unit or env_unit, meaning, env, env_default,
                         env_unit, used_by, parse))
    return s.read()


def _use(env: str, parse: Callable[[str], Any], default: Any, env_default: str, env_unit: str,
         used_by: str, meaning: str) -> None:
    """Declare a setting read only at its use, with :func:`setting` (``default``: the value
    while the variable is unset, e.g. None for "not set")."""
    unit = env_unit or ("on/off" if isinstance(default, bool) or parse is _tristate else "text")
    _declare(Setting(env, default, unit, meaning, env, env_default, env_unit, used_by, parse))


def setting(env: str, environ: Mapping[str, str] | None = None) -> Any:
    """The current value of the setting whose variable is ``env`` (e.g.
    ``"GPUMESH_NO_WORKER_TIMEOUT"``), read from ``environ`` (default ``os.environ``) now.
    Raises KeyError for a variable that is not a setting, SettingError for a bad value."""
    try:
        s = _BY_ENV[env]
    except KeyError:
        raise KeyError(f"{env} is not in gpumesh.limits' settings table") from None
    return s.read(environ)


# --- how a variable's text is read ------------------------------------------------------
# Each parser takes the variable's (non-empty) text and returns the value in the unit of
# the attribute, or raises ValueError whose message says what is expected.

def _number(what: str, scale: float = 1.0, *, integer: bool = False, minimum: float = 0.0,
            to_int: bool = False) -> Callable[[str], Any]:
    """A number of ``what`` (e.g. "seconds") >= ``minimum``, times ``scale``.
    ``integer``: the text must be a whole number; ``to_int``: the scaled value is rounded
    down to an int (sizes in bytes)."""
    kind = "a whole number" if integer else "a number"

    def parse(text: str) -> Any:
        try:
            n = int(text) if integer else float(text)
        except ValueError:
            raise ValueError(f"{kind} of {what} (at least {minimum:g})") from None
        if math.isnan(n) or n < minimum:
            raise ValueError(f"{kind} of {what} (at least {minimum:g})")
        if integer and scale == 1:
            return n
        scaled = n * scale
        return int(scaled) if to_int or integer else scaled

    return parse


SECONDS = _number("seconds")


def _off_if(word: str) -> Callable[[str], bool]:
    """An on/off switch that is on unless the text is exactly ``word``: any other text
    keeps it on, as it always has."""
    return lambda text: text != word


def _off_words(*words: str) -> Callable[[str], bool]:
    """An on/off switch that is on unless the text, trimmed and lower-cased, is one of
    ``words``."""
    return lambda text: text.strip().lower() not in words


def _on_if(word: str) -> Callable[[str], bool]:
    """An on/off switch that is off unless the text is exactly ``word``."""
    return lambda text: text == word


def _tristate(text: str) -> bool | None:
    """``1`` forces on, ``0`` forces off, anything else leaves the choice to the code."""
    return {"1": True, "0": False}.get(text)


def _choice(*names: str) -> Callable[[str], str]:
    """One of ``names`` (compared upper-cased)."""
    def parse(text: str) -> str:
        if text.upper() not in names:
            raise ValueError(" or ".join(names))
        return text.upper()
    return parse


def _text(text: str) -> str:
    return text


def _csv(text: str) -> list[str]:
    """Comma-separated items; empty ones are dropped (each item is checked where it is used)."""
    return [v for v in text.split(",") if v.strip()]


DAY_S = _const("DAY_S", 86400.0, "s", "a day (usage windows of the dashboard and the metrics)")

# --- network -------------------------------------------------------------------------
DEFAULT_PORT = _const("DEFAULT_PORT", 8000, "port", "default coordinator port (`gpumesh serve --port`)")
CONNECT_TIMEOUT_S = _const("CONNECT_TIMEOUT_S", 3.0, "s",
                           "a client waits this long for a TCP connection to the coordinator")
READ_TIMEOUT_S = _const("READ_TIMEOUT_S", 30.0, "s",
                        "a client waits this long for an ordinary (non-long-poll) answer")
PROBE_TIMEOUT_S = _const("PROBE_TIMEOUT_S", 2.0, "s",
                         "the routing probe (`GET protocol.HEALTH`) may take this long before the "
                         "mesh counts as down")
PROBE_CACHE_S = _const("PROBE_CACHE_S", 5.0, "s",
                       "a healthy probe, or a call the coordinator answered, is trusted this long "
                       "before the next call probes again")
PROBE_DOWN_CACHE_S = _const("PROBE_DOWN_CACHE_S", 2.0, "s",
                            "a failed probe is trusted this long: calls meanwhile run locally "
                            "without probing again")
LONG_POLL_MAX_S = _const("LONG_POLL_MAX_S", 30.0, "s",
                         "longest long-poll the coordinator holds open (lease requests, result waits)")
LONG_POLL_S = _const("LONG_POLL_S", 20.0, "s",
                     "long-poll the clients ask for; below LONG_POLL_MAX_S so proxies don't cut them")

# --- liveness ------------------------------------------------------------------------
HEARTBEAT_INTERVAL_S = _const("HEARTBEAT_INTERVAL_S", 2.0, "s", "time between worker heartbeats")
WORKER_TTL_S: float = _env(
    "WORKER_TTL_S", "GPUMESH_WORKER_TTL", SECONDS, "10", "s", "`serve`",
    "a worker silent this long is declared dead and its tasks are re-queued")
SESSION_PING_S = _const("SESSION_PING_S", 15.0, "s",
                        "time between keep-alive lines on a worker's pulse connection (keeps NAT and "
                        "proxy state alive; liveness comes from the connection and the heartbeats)")
SWEEP_INTERVAL_S = _const("SWEEP_INTERVAL_S", 0.5, "s",
                          "how often the coordinator sweeps for dead workers and expired leases")
MAX_ATTEMPTS: int = _env(
    "MAX_ATTEMPTS", "GPUMESH_MAX_ATTEMPTS", _number("attempts", integer=True, minimum=1), "3",
    "attempts", "`serve`",
    "how often a task is started when the workers running it are lost or its process crashes "
    "(a task that raises is not retried)")
MAX_RETRIES = _const("MAX_RETRIES", 10, "count",
                     "most re-runs `@accelerate(retries=N, retry_on=...)` may ask for after the "
                     "function raised")
MAX_RETRY_TYPES = _const("MAX_RETRY_TYPES", 32, "count", "most exception types one `retry_on` may name")

# --- dead connections ---------------------------------------------------------------
# TCP keepalive on every client connection: a peer that vanished without a FIN (cable
# pulled, laptop lid closed) is noticed after IDLE + INTERVAL * COUNT seconds even while a
# long-poll is waiting, instead of after the long-poll's read timeout.
TCP_KEEPIDLE_S = _const("TCP_KEEPIDLE_S", 5, "s", "TCP keepalive: idle time before the first probe")
TCP_KEEPINTVL_S = _const("TCP_KEEPINTVL_S", 2, "s", "TCP keepalive: time between probes")
TCP_KEEPCNT = _const("TCP_KEEPCNT", 3, "count", "TCP keepalive: unanswered probes before the peer is dead")

# --- reconnect (bounded exponential backoff with full jitter) -----------------------
BACKOFF_BASE_S = _const("BACKOFF_BASE_S", 0.2, "s", "first reconnect backoff (doubles each try)")
BACKOFF_MAX_S = _const("BACKOFF_MAX_S", 2.0, "s", "longest reconnect backoff")
# A first join that never reached its coordinator (a wrong URL or port, or one that is not
# started yet) backs off further: a joined worker's coordinator is back soon, a wrong
# address never is.
JOIN_BACKOFF_MAX_S = _const("JOIN_BACKOFF_MAX_S", 30.0, "s",
                            "longest backoff of a first join that has not reached its coordinator")
JOIN_PATIENCE_S = _const("JOIN_PATIENCE_S", 30.0, "s",
                         "how long a first join keeps the reconnect pace (a coordinator started "
                         "alongside it is joined within BACKOFF_MAX_S of coming up) before the "
                         "longer backoff")
JOIN_HINT_AFTER = _const("JOIN_HINT_AFTER", 3, "count",
                         "failed first-join tries before join points at `gpumesh doctor URL`")
CALLER_RECONNECT_S: float = _env(
    "CALLER_RECONNECT_S", "GPUMESH_RECONNECT_TIMEOUT", SECONDS, "300", "s", "callers",
    "how long a caller waiting for an accepted job keeps retrying an unreachable coordinator "
    "before it raises `MeshUnavailable`")
CALLER_TIMEOUT_S: float = _env(
    "CALLER_TIMEOUT_S", "GPUMESH_CALLER_TIMEOUT", SECONDS, "360", "s", "`serve`",
    "how long a function job's caller may go unheard (no poll, no keepalive) before the "
    "coordinator cancels and releases the job (30 s for a caller on the coordinator's own "
    "machine whose process has exited); after a restart, how long a recovered "
    "function job's tasks wait for their caller to come back. Keep it above callers' "
    "`GPUMESH_RECONNECT_TIMEOUT`")
KEEPALIVE_MAX_S = _const("KEEPALIVE_MAX_S", 30.0, "s",
                         "longest interval between a caller's keepalives of its open jobs "
                         "(a quarter of the coordinator's CALLER_TIMEOUT_S when that is less)")
NO_WORKER_WAIT_S: float = _env(
    "NO_WORKER_WAIT_S", "GPUMESH_NO_WORKER_TIMEOUT", SECONDS, "600", "s", "callers",
    "how long a call without `timeout=` waits for a worker to (re)join while none that can run "
    "it is alive, then raises `WorkerLost` and cancels its job (a call with `timeout=T` waits "
    "T seconds instead)")
RETENTION_S: float = _env(
    "RETENTION_S", "GPUMESH_RETENTION_HOURS", _number("hours", 3600.0), "24", "h", "`serve`",
    "how long a finished job (tasks, payloads, results, output) is kept", unit="s")
CHECKPOINT_S = _const("CHECKPOINT_S", 1.0, "s",
                      "how often the coordinator copies its write-ahead log into the database, "
                      "on a thread of its own (coordinator/checkpoint.py)")
PURGE_INTERVAL_S: float = _env(
    "PURGE_INTERVAL_S", "GPUMESH_PURGE_INTERVAL", SECONDS, "60", "s", "`serve`",
    "how often what is past retention is deleted")
PURGE_SLICE_S = _const("PURGE_SLICE_S", 0.05, "s",
                       "a purge deletes jobs in batches sized to take about this long each, and "
                       "lets the event loop serve requests and heartbeats between two batches")
PURGE_BATCH_MAX = _const("PURGE_BATCH_MAX", 500, "count",
                         "most jobs (or function blobs) one purge batch deletes in one transaction")
TASK_SLICE_ROWS = _const("TASK_SLICE_ROWS", 4096, "count",
                         "a job of more tasks is released (and a purge's batch starts) this many task "
                         "rows per transaction, the event loop served between two: one commit of a "
                         "million rows held it for seconds (benchmarks/purge_stall.py)")

# --- sizes ---------------------------------------------------------------------------
MAX_BODY_BYTES: int = _env(
    "MAX_BODY_BYTES", "GPUMESH_MAX_BODY_MB", _number("MiB", MiB, integer=True), "2048", "MiB",
    "`serve`", "largest request body (a submit, a payload, a result)", unit="bytes")
INLINE_BLOB_BYTES = _const("INLINE_BLOB_BYTES", 256 * 1024, "bytes",
                           "payloads up to this size are kept in SQLite rows; larger ones as files beside it")
INLINE_FUNCTION_BYTES = _const("INLINE_FUNCTION_BYTES", 256 * 1024, "bytes",
                               "a function blob up to this size travels inside the submit request itself")
RELEASE_BATCH_S = _const("RELEASE_BATCH_S", 0.2, "s",
                         "a caller releases the jobs it collected within this long of each other in "
                         "one request (client/native.py's Janitor)")
RELEASE_ATTEMPTS = _const("RELEASE_ATTEMPTS", 3, "count",
                          "sends a caller tries for one batch of releases before it leaves those jobs' "
                          "payloads to retention")
RELEASE_BATCH_MAX = _const("RELEASE_BATCH_MAX", 500, "count",
                           "most jobs a caller releases in one request (at most MAX_RELEASE_JOBS)")
MAX_RELEASE_JOBS = _const("MAX_RELEASE_JOBS", 1000, "count",
                          "most job ids one `POST protocol.JOBS_RELEASE` takes")
MAX_TASKS_PER_JOB = _const("MAX_TASKS_PER_JOB", 1_000_000, "count", "most tasks one `.map` submit may carry")
RESULT_PAGE_BYTES = _const("RESULT_PAGE_BYTES", 64 * MiB, "bytes",
                           "a results long-poll answers with at most this many bytes (always at least "
                           "one result, whatever its size)")
RESULT_PAGE_COUNT = _const("RESULT_PAGE_COUNT", 2000, "count", "most results in one results page")
OUTPUT_BODY_BYTES = _const("OUTPUT_BODY_BYTES", 4 * MiB, "bytes",
                           "largest body of one output post (a worker sends what a task printed in pieces)")
OUTPUT_FLUSH_S = _const("OUTPUT_FLUSH_S", 0.2, "s", "time between a worker's output posts while tasks print")
SPOOL_CAP_BYTES = _const("SPOOL_CAP_BYTES", 16 * MiB, "bytes",
                          "a task's output file (each stream) on the lending machine's disk is "
                          "emptied once it is past this size and all of it was read: the 16 MiB "
                          "a worker forwards of each stream (README), so that nothing it "
                          "forwards is ever emptied away first")
ERROR_TAIL_BYTES = _const("ERROR_TAIL_BYTES", 4096, "bytes",
                          "how much of the end of a failed task's stderr (a script's stderr or "
                          "stdout) travels with its error")

# --- worker --------------------------------------------------------------------------
MAX_SLOTS = _const("MAX_SLOTS", 1024, "count",
                   "most CPU slots one worker offers (`join --cpu-slots`, `serve --slots`, "
                   "`GPUMesh.add_worker(slots=)`)")
MAX_WARM_FUNCTIONS = _const("MAX_WARM_FUNCTIONS", 4, "count",
                            "warm per-function processes a worker keeps (the least recently "
                            "used idle ones beyond this exit; one a task or a job's kept "
                            "process uses never does, so more may run while more are in use)")
# A worker that keeps no warm process any more stops its zygote and generic spare too, so
# its idle memory goes back to what it was before its first task.
WARM_IDLE_S: float = _env(
    "WARM_IDLE_S", "GPUMESH_WARM_IDLE", SECONDS, "60", "s", "`join`",
    "a function's warm processes (its host, the task process started ahead for it) exit after "
    "this long without a task of it; a worker with none left stops its zygote too")

# --- what a worker reports and a job may ask for (worker, caller and coordinator check
# --- the same limits) ---------------------------------------------------------------
MAX_PACKAGES = _const("MAX_PACKAGES", 5000, "count", "most installed distributions a worker may report")
MAX_NAME_CHARS = _const("MAX_NAME_CHARS", 200, "chars", "longest distribution name a worker reports")
MAX_VERSION_CHARS = _const("MAX_VERSION_CHARS", 100, "chars", "longest version string a worker reports")
MAX_REQUIREMENTS = _const("MAX_REQUIREMENTS", 64, "count", "most requirements one `requires=` may list")
MAX_REQUIREMENT_CHARS = _const("MAX_REQUIREMENT_CHARS", 200, "chars", "longest requirement in `requires=`")

# --- security (see SECURITY.md and docs/threat-model.md) ----------------------------
MIN_TOKEN_CHARS = _const("MIN_TOKEN_CHARS", 16, "chars",
                         "shortest token `gpumesh serve` accepts from a user (generated ones are "
                         "43 characters, 256 bits)")
MAX_TOKEN_CHARS = _const("MAX_TOKEN_CHARS", 1024, "chars",
                         "longest `Authorization` token the coordinator looks at; longer ones are "
                         "refused without hashing")
AUTH_FAIL_MAX = _const("AUTH_FAIL_MAX", 10, "count",
                       "failed authentications one client address may make within "
                       "AUTH_FAIL_WINDOW_S before it is locked out (a few typos never lock anyone out)")
AUTH_FAIL_WINDOW_S = _const("AUTH_FAIL_WINDOW_S", 60.0, "s",
                            "sliding window over which one address's failed authentications are counted")
AUTH_LOCKOUT_S = _const("AUTH_LOCKOUT_S", 300.0, "s",
                        "a locked-out address gets `429 locked_out` this long for every request "
                        "(right token or not: a lockout that still checked tokens would keep "
                        "answering a guesser)")
AUTH_TRACKED_ADDRESSES = _const("AUTH_TRACKED_ADDRESSES", 10_000, "count",
                                "client addresses whose failures are tracked at once (oldest forgotten first)")
AUTH_LOOPBACK_EXEMPT: bool = _env(
    "AUTH_LOOPBACK_EXEMPT", "GPUMESH_LOOPBACK_EXEMPT", _off_if("0"), "1", "", "`serve`",
    "`0`: loopback clients can be locked out after refused tokens too (set it when a loopback "
    "coordinator is exposed through an SSH or TCP tunnel)", unit="on/off")
CLOCK_SKEW_WARN_S = _const("CLOCK_SKEW_WARN_S", 5.0, "s",
                           "clock difference to a coordinator `gpumesh doctor` warns about (traces "
                           "and logs of the two machines no longer line up)")
CLOCK_SKEW_FAIL_S = _const("CLOCK_SKEW_FAIL_S", 300.0, "s",
                           "... and fails on (TLS certificates start to look not yet valid or expired)")
MAX_FORWARDED_HOPS = _const("MAX_FORWARDED_HOPS", 32, "count",
                            "`X-Forwarded-For` hops read (from the right) behind trusted proxies; a "
                            "longer chain is cut here, so a huge header costs no more than this")
# A TLS handshake is bounded separately by asyncio's 60 s handshake timeout; neither ever
# blocks other connections.
REQUEST_HEAD_TIMEOUT_S: float = _env(
    "REQUEST_HEAD_TIMEOUT_S", "GPUMESH_HEAD_TIMEOUT", SECONDS, "30", "s", "`serve`",
    "time a connection has to send a complete request head before it is closed")
REQUEST_BODY_IDLE_S: float = _env(
    "REQUEST_BODY_IDLE_S", "GPUMESH_BODY_TIMEOUT", SECONDS, "60", "s", "`serve`",
    "time a request body may send no bytes before its connection is closed")
MAX_CONNECTIONS: int = _env(
    "MAX_CONNECTIONS", "GPUMESH_MAX_CONNECTIONS", _number("connections", integer=True), "0",
    "connections", "`serve`", "open connections at most; one more is closed at once "
    "(0: half the process's open-file limit)")
MAX_JSON_BODY_BYTES: int = _env(
    "MAX_JSON_BODY_BYTES", "GPUMESH_MAX_JSON_KB", _number("KiB", 1024, integer=True), "1024",
    "KiB", "`serve`", "largest JSON request body (register, heartbeat, lease)", unit="bytes")
MAX_STRING_CHARS = _const("MAX_STRING_CHARS", 4096, "chars",
                          "longest string field in JSON metadata (hostname, job name, ...)")
MAX_META_JSON_BYTES = _const("MAX_META_JSON_BYTES", 256 * 1024, "bytes",
                             "largest nested JSON value in metadata (a task error, a worker's GPU list)")
MAX_HEARTBEAT_TASKS = _const("MAX_HEARTBEAT_TASKS", 65_536, "count", "most task ids one heartbeat may list")

#: Every payload the store keeps as a file (over INLINE_BLOB_BYTES) is sent as one when the
#: sender shares the coordinator's machine: the file is written once, by the sender (over a
#: pooled one), instead of crossing a socket and the HTTP body and then being written by the
#: coordinator. It was 1 MiB (set before the pool); lowered, a 512 KiB result took 0.82-0.86
#: of the time (docs/performance.md, "Eleventh session: results of 64 KiB to 1 MiB").
HANDOFF_MIN_BYTES = _const("HANDOFF_MIN_BYTES", INLINE_BLOB_BYTES + 1, "bytes",
                           "payloads at least this big (every one the store keeps as a file) change "
                           "hands as files when caller or worker shares the coordinator's machine "
                           "and user (gpumesh.handoff), and travel in memory files between a worker's "
                           "agent and its task processes")
HANDOFF_TTL_S = _const("HANDOFF_TTL_S", 600.0, "s",
                       "handoff files older than this were never claimed (their sender died between "
                       "writing and sending): the coordinator deletes them")
HANDOFF_POOL_BYTES = _const("HANDOFF_POOL_BYTES", 512 * MiB, "bytes",
                            "released payload files the coordinator keeps for senders to write over "
                            "(their pages already in memory: gpumesh.handoff, 'pool'); at most 1/16 "
                            "of the machine's memory")
HANDOFF_POOL_IDLE_S = _const("HANDOFF_POOL_IDLE_S", 30.0, "s",
                             "a pooled file no sender took for this long is deleted (its memory "
                             "goes back to the machine)")

# --- LAN discovery -------------------------------------------------------------------
DISCOVERY_BROWSE_S = _const("DISCOVERY_BROWSE_S", 3.0, "s",
                            "a one-shot LAN browse (`join` without a URL, `radar --once/--json`) "
                            "listens this long for coordinators")

# --- settings read where they are used (limits.setting(VARIABLE)) -------------------
_use("GPUMESH_URL", _text, None, "the saved config, else `http://127.0.0.1:8000`", "URL",
     "callers, CLI", "the coordinator (`http://`/`https://`, or `dask://`, `tcp://`, `ray://` "
     "for the engines)")
_use("GPUMESH_FINGERPRINT", _text, None, "the saved config", "`SHA256:HEX`", "callers, `join`",
     "TLS certificate pin")
_use("GPUMESH_CONFIG", _text, None, "`~/.gpumesh/config.json`", "path", "all",
     "the config file `serve` writes and everything else reads")
_use("GPUMESH_HOST", _text, "127.0.0.1", "`127.0.0.1`", "address", "`serve`",
     "address to bind (as `--host`)")
_use("GPUMESH_HOST_IP", _text, None, "the detected LAN address", "address", "`serve`",
     "the address other machines reach this coordinator at (as `--host-ip`)")
_use("GPUMESH_TRUSTED_PROXIES", _csv, [], "unset", "CIDRs, comma-separated", "`serve`",
     "as `--trusted-proxy`: reverse proxies whose `X-Forwarded-For` names the client")
_use("GPUMESH_DISCOVERY", _off_words("0", "false", "no", "off"), True, "on", "",
     "`serve`, `join`, `radar`", "`0` (or `false`/`no`/`off`): no LAN discovery at all: nothing "
     "is announced or browsed, no mDNS socket is opened")
_use("GPUMESH_OUTPUT", _off_if("0"), True, "`1`", "", "callers",
     "`0`: do not print what remote tasks print")
_use("GPUMESH_PROGRESS", _tristate, None, "on a terminal or in a notebook", "",
     "callers, `submit --wait`", "`0`: progress bars off; `1`: forced on (where stderr is "
     "no terminal, such as a pipe or a log file: a plain `[gpumesh] ...` line every 10 s "
     "while the counts move, and the last state)")
_use("GPUMESH_LOCAL", _on_if("1"), False, "unset", "", "callers",
     "`1`: run every call in this process")
_use("GPUMESH_SHIP_LOCAL", _off_if("0"), True, "`1`", "", "callers",
     "`0`: do not send the caller's own modules (not installed, not the standard library) "
     "with its functions by value; they go by reference, and workers must have them "
     "(gpumesh/localcode.py)")
_use("GPUMESH_STRICT_RESULTS", _on_if("1"), False, "unset", "", "callers",
     "`1`: accept only JSON results, never unpickle")
_use("GPUMESH_SYNC", _choice("NORMAL", "FULL"), "NORMAL", "`NORMAL`", "", "`serve`",
     "`FULL`: fsync the job store on every commit")
# The runtime's name is checked by worker/procs.choose_runtime, which checks `--runtime`
# with the same words.
_use("GPUMESH_RUNTIME", _text, None, "`fork` on Linux, `spawn` elsewhere", "",
     "`join`, `serve`'s self-worker", "`fork` or `spawn`: the task runtime when `join "
     "--runtime` is not given (docs/architecture.md, \"Inside a worker\")")
_use("GPUMESH_HANDOFF", _off_if("0"), True, "`1`", "", "callers, `join`",
     "`0`: this process never hands big payloads off as files, even on the coordinator's "
     "machine; set it for callers and workers alike to turn the handoff off everywhere (see "
     "docs/architecture.md, \"Same-machine handoff\")")
_use("GPUMESH_ENV_DIR", _text, None, "`~/.cache/gpumesh/envs`", "path", "`join --allow-installs`",
     "where the environments built for `requires=` tasks are cached")
_CACHE_MIB = _number("MiB", MiB, to_int=True)
_use("GPUMESH_ENV_CACHE_MB", _CACHE_MIB, _CACHE_MIB("5120"), "`5120`", "MiB",
     "`join --allow-installs`", "cap of that cache; the least recently used environments are "
     "evicted first")
_use("GPUMESH_FN_CACHE_MB", _CACHE_MIB, _CACHE_MIB("1024"), "`1024`", "MiB", "`join`",
     "cap of a worker's cache of function blobs (in its temporary directory); the least "
     "recently used are deleted first, never one a running task or a starting process "
     "needs, and one no task used for `GPUMESH_WARM_IDLE` goes too")
_use("GPUMESH_TRACE", _text, None, "unset", "path", "all",
     "append a line `<CLOCK_MONOTONIC ns> <pid> <label>` to this file at each hop of a call "
     "(`gpumesh/tracing.py`; the labels of one call, in order, are `tracing.CALL_HOPS`). For "
     "measuring, not for production. `benchmarks/critical_path.py` starts its own traced "
     "cluster and prints the median time of each hop of sequential no-op calls")

# --- variables that are not settings -----------------------------------------------
_SECRET = ("a credential: read where it is used and then wiped from the environment "
           "(cli/secrecy.py) and from every task's (worker/runner.SCRUBBED_ENV), so it "
           "never sits in a table of values")
#: Documented in docs/cli.md with the settings, read where they are used.
OTHER_VARIABLES: dict[str, Variable] = {v.env: v for v in (
    Variable("GPUMESH_TOKEN", "the saved config", "", "callers, CLI, `serve`, `join`",
             "the coordinator's token; `serve` makes one when it is unset", _SECRET),
    Variable("GPUMESH_WORKER_TOKEN", "unset", "", "`serve`, `join`", "the worker-only token",
             _SECRET),
    Variable("GPUMESH_METRICS_TOKEN", "unset", "", "`serve`",
             "a token that may read `/metrics` only", _SECRET),
    Variable("NGROK_AUTHTOKEN", "unset", "", "`serve --public`",
             "the ngrok authtoken the tunnel uses", "ngrok's own credential, named by ngrok"),
    Variable("GPUMESH_LOG_JSON", "unset", "", "all", "`1`: as `--log-json`",
             "click reads it as `--log-json`'s envvar, so the flag and the variable are one "
             "option with click's reading of on/off"),
    Variable("GPUMESH_IN_TASK", "set to `1` inside tasks", "", "tasks",
             "a task knows it runs on the mesh (decorated calls inside it run inline)",
             "a marker the worker sets for the task processes it starts"),
    Variable("GPUMESH_SCRIPT", "set to `1` inside script tasks", "", "script tasks",
             "a script knows it runs as a `gpumesh submit` task",
             "a marker the worker sets for the scripts it runs"),
    Variable("GPUMESH_EXIT_WITH_PARENT", "unset", "", "`join`",
             "internal: `serve` sets `1` for its self-worker, which then exits with the "
             "coordinator", "a marker `serve` passes to the worker it starts"),
    Variable("GPUMESH_FAKE_GPUS", "unset", "JSON or `@path`", "workers",
             "testing hook only: a JSON list of fake GPUs replaces NVML's (never set it "
             "outside tests)", "a testing hook, parsed where the fake GPUs are built "
             "(worker/device.py)"),
)}
assert not set(OTHER_VARIABLES) & set(_BY_ENV)


def env_rows() -> dict[str, tuple[str, str, str, str]]:
    """Every documented variable -> (default, unit, used by, meaning) as docs/cli.md's
    "Environment variables" table writes them: the settings with a variable, then
    :data:`OTHER_VARIABLES`."""
    rows = {s.env: (_cell_default(s.env_default), s.env_unit, s.used_by, s.meaning)
            for s in _BY_ENV.values() if s.env}
    rows.update({v.env: (v.env_default, v.env_unit, v.used_by, v.meaning)
                 for v in OTHER_VARIABLES.values()})
    return rows


def _cell_default(text: str) -> str:
    """A bare number is written as code in the table (``10`` -> ```10```)."""
    try:
        float(text)
    except ValueError:
        return text
    return f"`{text}`"
