"""Named timings and size limits, in one place.

Units are in the names: ``_S`` seconds, ``_BYTES`` bytes (powers of two: 1 MiB = 2**20).
Environment variables that override a value are named next to it.
"""

from __future__ import annotations

import os

MiB = 2**20

# --- network -------------------------------------------------------------------------
#: Default coordinator port (``gpumesh serve --port``).
DEFAULT_PORT = 8000
#: Seconds a client waits for a TCP connection to the coordinator.
CONNECT_TIMEOUT_S = 3.0
#: Seconds a client waits for an ordinary (non-long-poll) answer.
READ_TIMEOUT_S = 30.0
#: Seconds the routing probe (``GET /v1/health``) may take before the mesh counts as down.
PROBE_TIMEOUT_S = 2.0
#: Seconds a healthy probe result is trusted before the next call probes again.
PROBE_CACHE_S = 5.0
#: Seconds a failed probe is trusted: calls meanwhile run locally without probing again.
PROBE_DOWN_CACHE_S = 2.0
#: Longest long-poll the coordinator holds open (lease requests and result waits).
LONG_POLL_MAX_S = 30.0
#: Long-poll the clients ask for; below LONG_POLL_MAX_S so proxies don't cut them.
LONG_POLL_S = 20.0

# --- liveness ------------------------------------------------------------------------
#: Seconds between worker heartbeats.
HEARTBEAT_INTERVAL_S = 2.0
#: Seconds without a heartbeat after which a worker is declared dead and its leases
#: are re-queued. Override with ``GPUMESH_WORKER_TTL``.
WORKER_TTL_S = float(os.environ.get("GPUMESH_WORKER_TTL", "10"))
#: Seconds between keep-alive lines on a worker's pulse connection (keeps NAT and proxy
#: state alive; liveness itself comes from the connection and the heartbeats).
SESSION_PING_S = 15.0
#: How often the coordinator sweeps for dead workers and expired leases.
SWEEP_INTERVAL_S = 0.5
#: Attempts a task gets when the worker running it is lost (not when the task raises).
#: Override with ``GPUMESH_MAX_ATTEMPTS``.
MAX_ATTEMPTS = int(os.environ.get("GPUMESH_MAX_ATTEMPTS", "3"))
#: Most re-runs ``@accelerate(retries=N, retry_on=...)`` may ask for after the function
#: raised, and most exception types one ``retry_on`` may name.
MAX_RETRIES = 10
MAX_RETRY_TYPES = 32

# --- dead connections ---------------------------------------------------------------
#: TCP keepalive on every client connection: a peer that vanished without a FIN (cable
#: pulled, laptop lid closed) is noticed after IDLE + INTERVAL * COUNT seconds even while
#: a long-poll is waiting, instead of after the long-poll's read timeout.
TCP_KEEPIDLE_S = 5
TCP_KEEPINTVL_S = 2
TCP_KEEPCNT = 3

# --- reconnect (bounded exponential backoff with full jitter) -----------------------
BACKOFF_BASE_S = 0.2
BACKOFF_MAX_S = 2.0
#: How long a caller keeps retrying an unreachable coordinator while it waits for
#: results of an accepted job before raising MeshUnavailable.
CALLER_RECONNECT_S = float(os.environ.get("GPUMESH_RECONNECT_TIMEOUT", "300"))

#: Seconds a caller waits for a worker to (re)join while none that can run its tasks is
#: alive and its call has no ``timeout=``; then the call raises WorkerLost (and its job is
#: cancelled). A call with ``timeout=T`` waits T seconds instead. Override with
#: ``GPUMESH_NO_WORKER_TIMEOUT``.
NO_WORKER_WAIT_S = float(os.environ.get("GPUMESH_NO_WORKER_TIMEOUT", "600"))

#: Hours a finished job (its tasks, payloads and results) is kept before it is deleted.
#: Override with ``GPUMESH_RETENTION_HOURS``.
RETENTION_S = float(os.environ.get("GPUMESH_RETENTION_HOURS", "24")) * 3600
#: How often the coordinator deletes what is past retention (``GPUMESH_PURGE_INTERVAL``).
PURGE_INTERVAL_S = float(os.environ.get("GPUMESH_PURGE_INTERVAL", "60"))

# --- sizes ---------------------------------------------------------------------------
#: Largest request body the coordinator accepts (a job submit, a blob, a result).
MAX_BODY_BYTES = int(os.environ.get("GPUMESH_MAX_BODY_MB", "2048")) * MiB
#: Payloads up to this size are kept in SQLite rows; larger ones as files beside it.
INLINE_BLOB_BYTES = 256 * 1024
#: A function blob up to this size travels inside the submit request itself.
INLINE_FUNCTION_BYTES = 256 * 1024
#: A caller releases the jobs it collected within this many seconds of each other in one
#: request, at most RELEASE_BATCH_MAX at a time (see client/mesh.py's _Janitor).
RELEASE_BATCH_S = 0.2
RELEASE_BATCH_MAX = 500
#: Most tasks one ``.map`` submit may carry.
MAX_TASKS_PER_JOB = 1_000_000
#: Result-page budget: a results long-poll answers with at most this many bytes
#: (always at least one result, whatever its size).
RESULT_PAGE_BYTES = 64 * MiB
#: Most results in one results page.
RESULT_PAGE_COUNT = 2000

#: Largest body of one output post (a worker sends what a task printed in pieces).
OUTPUT_BODY_BYTES = 4 * MiB
#: Seconds between a worker's output posts while tasks print.
OUTPUT_FLUSH_S = 0.2

# --- worker --------------------------------------------------------------------------
#: Warm per-function processes a worker keeps (least recently used beyond this exit).
MAX_WARM_FUNCTIONS = 4
#: Seconds a function's warm processes (its function host and the task process forked or
#: started ahead for it) live after its last task; then they exit, and a worker that
#: keeps none any more stops its zygote and generic spare too (its idle memory goes back
#: to what it was before its first task). Override with ``GPUMESH_WARM_IDLE``.
WARM_IDLE_S = float(os.environ.get("GPUMESH_WARM_IDLE", "60"))

# --- security (see SECURITY.md and docs/threat-model.md) ----------------------------
#: Shortest token ``gpumesh serve`` accepts from a user (characters). Generated tokens
#: are 43 characters (256 bits); a chosen one shorter than this is refused.
MIN_TOKEN_CHARS = 16
#: Longest ``Authorization`` token the coordinator looks at (characters); longer ones
#: are refused without hashing.
MAX_TOKEN_CHARS = 1024
#: Failed authentications one client address may make within AUTH_FAIL_WINDOW_S before
#: it is locked out. A few typos never lock anyone out.
AUTH_FAIL_MAX = 10
#: Seconds over which failed authentications of one address are counted (sliding window).
AUTH_FAIL_WINDOW_S = 60.0
#: Seconds a locked-out address gets ``429 locked_out`` for every request (right token or
#: not: a lockout that still checked tokens would keep answering a guesser).
AUTH_LOCKOUT_S = 300.0
#: Client addresses whose failures are tracked at once (oldest forgotten beyond this).
AUTH_TRACKED_ADDRESSES = 10_000
#: Loopback clients are exempt from the lockout while the coordinator is bound to
#: loopback and no proxy header is present. ``GPUMESH_LOOPBACK_EXEMPT=0`` turns the
#: exemption off (e.g. a loopback coordinator exposed through an SSH or TCP tunnel).
AUTH_LOOPBACK_EXEMPT = os.environ.get("GPUMESH_LOOPBACK_EXEMPT", "1") != "0"
#: Clock difference to a coordinator (seconds) that ``gpumesh doctor`` warns about: traces
#: and logs of the two machines no longer line up.
CLOCK_SKEW_WARN_S = 5.0
#: ... and that it fails on: TLS certificates start to look not yet valid or expired.
CLOCK_SKEW_FAIL_S = 300.0
#: ``X-Forwarded-For`` hops read (from the right) behind trusted proxies; a longer chain
#: is cut here, so a huge header costs no more than this.
MAX_FORWARDED_HOPS = 32
#: Seconds a new connection may take to send a complete request head (request line and
#: headers), and a kept-alive one to finish the head of its next request once begun;
#: slower clients are disconnected. (A TLS handshake is bounded separately by asyncio's
#: 60 s handshake timeout; neither ever blocks other connections.)
#: Override with ``GPUMESH_HEAD_TIMEOUT`` (s).
REQUEST_HEAD_TIMEOUT_S = float(os.environ.get("GPUMESH_HEAD_TIMEOUT", "30"))
#: Largest JSON request body (register, heartbeat, lease), bytes.
#: Override with ``GPUMESH_MAX_JSON_KB``.
MAX_JSON_BODY_BYTES = int(os.environ.get("GPUMESH_MAX_JSON_KB", "1024")) * 1024
#: Longest string field in JSON metadata (hostname, job name, ...), characters.
MAX_STRING_CHARS = 4096
#: Largest nested JSON value in metadata (a task error, a worker's GPU list), bytes of JSON.
MAX_META_JSON_BYTES = 256 * 1024
#: Most task ids one heartbeat may list.
MAX_HEARTBEAT_TASKS = 65_536

#: Payloads at least this big change hands as files when caller or worker shares the
#: coordinator's machine and user (see gpumesh.handoff); smaller ones ride in the body.
HANDOFF_MIN_BYTES = 1 * MiB
#: Files in the handoff directory older than this were never claimed (their sender
#: died between writing and sending): the coordinator deletes them.
HANDOFF_TTL_S = 600.0
