-- Diagnostic grants (SPEC.md section 16): an Owner lets one exact queued job start
-- on a draining node. Consumed (used_at) by that job's start there, in the start's
-- transaction; revoked (revoked_at) by a cancel of the job. At most one open grant
-- per node. Mirrors sql/sqlite/migrations/0014_node_grants.sql.

CREATE TABLE node_grants (
    id             BIGSERIAL PRIMARY KEY,
    node           TEXT NOT NULL,
    job_id         TEXT NOT NULL REFERENCES jobs (id),
    granted_by     TEXT,
    reason         TEXT NOT NULL,
    granted_at     DOUBLE PRECISION NOT NULL,
    used_at        DOUBLE PRECISION,
    attempt        INTEGER,
    revoked_at     DOUBLE PRECISION,
    revoked_reason TEXT
);
CREATE UNIQUE INDEX node_grants_open ON node_grants (node)
    WHERE used_at IS NULL AND revoked_at IS NULL;
CREATE INDEX node_grants_job ON node_grants (job_id);
