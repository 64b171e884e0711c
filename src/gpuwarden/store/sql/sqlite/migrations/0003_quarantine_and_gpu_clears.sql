-- A job state for jobs set aside after repeated infrastructure failures, and the
-- queue of operator requests to clear a GPU fault. SQLite cannot change a CHECK
-- constraint in place: the jobs table is rebuilt with the same rows.

CREATE TABLE jobs_new (
    id               TEXT PRIMARY KEY,
    seq              INTEGER NOT NULL UNIQUE,
    type             TEXT NOT NULL,
    state            TEXT NOT NULL
                     CHECK (state IN ('queued', 'running', 'done', 'failed', 'cancelled',
                                      'quarantined')),
    priority         INTEGER NOT NULL DEFAULT 0,
    params           TEXT NOT NULL,
    inputs           TEXT NOT NULL,
    outputs          TEXT NOT NULL,
    vram_bytes       INTEGER,
    spec_hash        TEXT NOT NULL,
    submitted_at     REAL NOT NULL,
    updated_at       REAL NOT NULL,
    attempts         INTEGER NOT NULL DEFAULT 0,
    reason           TEXT NOT NULL DEFAULT '',
    exit_code        INTEGER,
    bundle           TEXT,
    queue_root       TEXT,
    input_dir        TEXT,
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    result           TEXT NOT NULL DEFAULT '{}'
);
INSERT INTO jobs_new SELECT * FROM jobs;
DROP TABLE jobs;
ALTER TABLE jobs_new RENAME TO jobs;
CREATE INDEX jobs_state_order ON jobs (state, priority DESC, seq);

CREATE TABLE gpu_clears (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    gpu_uuid     TEXT NOT NULL,
    requested_at REAL NOT NULL,
    taken_at     REAL
);
