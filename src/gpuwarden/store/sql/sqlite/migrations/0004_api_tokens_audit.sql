-- The HTTP API: the token that submitted a job (its owner), API tokens (only the
-- SHA-256 of each secret), the audit log, and idempotency keys of submissions.

ALTER TABLE jobs ADD COLUMN owner TEXT;
CREATE INDEX jobs_owner ON jobs (owner, seq);

CREATE TABLE tokens (
    id          TEXT PRIMARY KEY,
    name        TEXT NOT NULL,
    role        TEXT NOT NULL
                CHECK (role IN ('owner', 'operator', 'submitter', 'node', 'enroll')),
    secret_hash TEXT NOT NULL,
    created_at  REAL NOT NULL,
    created_by  TEXT NOT NULL,
    expires_at  REAL,
    revoked_at  REAL,
    node        TEXT
);

CREATE TABLE audit (
    id         INTEGER PRIMARY KEY AUTOINCREMENT,
    ts         REAL NOT NULL,
    actor      TEXT NOT NULL,
    actor_name TEXT NOT NULL,
    role       TEXT NOT NULL,
    action     TEXT NOT NULL,
    target     TEXT NOT NULL DEFAULT '',
    outcome    TEXT NOT NULL,
    detail     TEXT NOT NULL DEFAULT '{}'
);

CREATE TABLE idempotency (
    token_id   TEXT NOT NULL,
    key        TEXT NOT NULL,
    body_hash  TEXT NOT NULL,
    job_ids    TEXT NOT NULL,
    created_at REAL NOT NULL,
    PRIMARY KEY (token_id, key)
);
