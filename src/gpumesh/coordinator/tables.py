"""The store's SQLite tables, the columns added to them since, and their indexes (see
:mod:`.store`, which runs every statement on them).

Written as the ``CREATE ... IF NOT EXISTS`` a start-up runs: a new data directory gets
them, an existing one keeps its rows and gets what it lacks (``MIGRATIONS``), and loses the
indexes this version no longer keeps.
"""

from __future__ import annotations

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id          TEXT PRIMARY KEY,
    name        TEXT NOT NULL,
    kind        TEXT NOT NULL,            -- 'function' | 'script'
    fn_hash     TEXT,                     -- sha256 of the function / script blob
    meta        TEXT NOT NULL,            -- JSON: timeout, requirements, caller info
    n_tasks     INTEGER NOT NULL,
    created     REAL NOT NULL,
    state       TEXT NOT NULL,            -- 'active' | 'finished' | 'cancelled'
    released    INTEGER NOT NULL DEFAULT 0,
    finished    REAL                      -- when the state left 'active'
);
CREATE TABLE IF NOT EXISTS tasks (
    id          TEXT PRIMARY KEY,
    job_id      TEXT NOT NULL,
    idx         INTEGER NOT NULL,
    state       TEXT NOT NULL,            -- 'pending' | 'leased' | 'done' | 'failed' | 'cancelled'
    attempts    INTEGER NOT NULL DEFAULT 0,
    cost        REAL NOT NULL DEFAULT 1.0,
    lease_id    TEXT,
    worker_id   TEXT,
    args        BLOB,                     -- inline payload, or NULL when args_file is set
    args_file   TEXT,
    result      BLOB,
    result_file TEXT,
    error       TEXT,                     -- JSON describing a failure
    seq         INTEGER,                  -- order in which results became final, per job
    finished    REAL,
    history     TEXT,                     -- JSON lines: attempts that ended without a result
    UNIQUE (job_id, idx)
);
CREATE TABLE IF NOT EXISTS blobs (
    hash        TEXT PRIMARY KEY,
    size        INTEGER NOT NULL,
    created     REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS tokens (         -- people's own tokens (see coordinator.people)
    name        TEXT PRIMARY KEY,
    role        TEXT NOT NULL,            -- 'admin' | 'submit' | 'view' | 'worker'
    digest      TEXT NOT NULL UNIQUE,     -- sha256 of the token, hex; never the token
    max_running INTEGER,                  -- cap on the person's running tasks (NULL: none)
    created     REAL NOT NULL
);
"""

#: Columns added after the first schema: (table, column, SQL type). Added in place on
#: start-up, so a data directory written by an older gpumesh keeps working.
MIGRATIONS = [("jobs", "finished", "REAL"), ("tasks", "history", "TEXT"),
              ("jobs", "owner", "TEXT"),      # the person who submitted it (NULL: before people)
              ("tasks", "started", "REAL"),   # when its current attempt was leased
              ("tasks", "gpu", "INTEGER")]    # 1 when that attempt ran on a GPU slot

#: ``jobs_created`` is the order job listings page in (``GET /v1/jobs?before=``, the
#: dashboard's older jobs): one entry per job, written once at its submit.
#:
#: Every index on ``tasks`` is written by each lease and result of a task: an entry moved
#: or added, and its page in the commit. So ``tasks`` keeps only the ones a request reads
#: through: its ``id`` and ``(job_id, idx)`` keys (the schema's) and ``tasks_seq`` (a
#: caller's results page). Start-up and the usage figures, which read open or recently
#: finished tasks, find them through their jobs instead (:meth:`Store.open_tasks`,
#: :func:`.usage.task_time`); the indexes they used before, ``tasks_open`` (on ``state``) and
#: ``tasks_finished``, took 4 of the 5 index entries a task's lease and result write
#: (the lease moved its ``state`` entry, the result removed it and added a ``finished``
#: one; ``tasks_seq`` gets the fifth: docs/performance.md, "Tenth session"), and are
#: dropped from a data directory that has them.
INDEXES = """
CREATE INDEX IF NOT EXISTS tasks_seq ON tasks (job_id, seq) WHERE seq IS NOT NULL;
CREATE INDEX IF NOT EXISTS jobs_finished ON jobs (finished) WHERE finished IS NOT NULL;
CREATE INDEX IF NOT EXISTS jobs_created ON jobs (created, id);
DROP INDEX IF EXISTS tasks_open;
DROP INDEX IF EXISTS tasks_finished;
"""

#: Ids per ``IN (...)`` query: well under SQLite's smallest limit on a statement's
#: parameters (999 before SQLite 3.32).
ARGS_PER_QUERY = 500

#: Active and unreleased jobs: the only ones whose tasks start-up loads (see
#: :mod:`.recovery`), and the only ones that can hold a pending or leased task.
UNRELEASED_JOBS = "SELECT id FROM jobs WHERE state='active' OR released=0"
