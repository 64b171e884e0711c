-- gpuwarden schema, version 1 (SQLite)

CREATE TABLE jobs (
    id               TEXT PRIMARY KEY,
    seq              INTEGER NOT NULL UNIQUE,
    type             TEXT NOT NULL,
    state            TEXT NOT NULL
                     CHECK (state IN ('queued', 'running', 'done', 'failed', 'cancelled')),
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
CREATE INDEX jobs_state_order ON jobs (state, priority DESC, seq);

CREATE TABLE attempts (
    job_id     TEXT NOT NULL REFERENCES jobs (id),
    number     INTEGER NOT NULL,
    node       TEXT NOT NULL,
    gpu_uuid   TEXT,
    started_at REAL NOT NULL,
    ended_at   REAL,
    exit_code  INTEGER,
    outcome    TEXT,
    reason     TEXT NOT NULL DEFAULT '',
    stdout     TEXT NOT NULL DEFAULT '',
    stderr     TEXT NOT NULL DEFAULT '',
    pid        INTEGER,
    PRIMARY KEY (job_id, number)
);

CREATE TABLE events (
    id         INTEGER PRIMARY KEY AUTOINCREMENT,
    ts         REAL NOT NULL,
    kind       TEXT NOT NULL,
    job_id     TEXT,
    from_state TEXT,
    to_state   TEXT,
    detail     TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX events_job ON events (job_id, id);

CREATE TABLE bundles (
    queue_root  TEXT NOT NULL,
    name        TEXT NOT NULL,
    job_ids     TEXT NOT NULL,
    received_at REAL NOT NULL,
    finished_at REAL,
    outcome     TEXT,
    result_path TEXT,
    PRIMARY KEY (queue_root, name)
);

CREATE TABLE node_status (
    node       TEXT PRIMARY KEY,
    pid        INTEGER,
    updated_at REAL NOT NULL,
    payload    TEXT NOT NULL
);
