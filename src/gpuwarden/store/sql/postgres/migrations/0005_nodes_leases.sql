-- Several hosts: enrolled nodes (agents), leases of queued jobs to nodes, and
-- the nodes a job's attempt was lost with (placement prefers another one).
-- Mirrors sql/sqlite/migrations/0005_nodes_leases.sql.

CREATE TABLE nodes (
    name         TEXT PRIMARY KEY,
    token_id     TEXT,
    state        TEXT NOT NULL DEFAULT 'active'
                 CHECK (state IN ('active', 'draining', 'revoked', 'offline')),
    capabilities JSONB NOT NULL DEFAULT '{}',
    report       JSONB NOT NULL DEFAULT '{}',
    enrolled_at  DOUBLE PRECISION NOT NULL,
    last_seen    DOUBLE PRECISION
);

CREATE TABLE leases (
    job_id     TEXT PRIMARY KEY REFERENCES jobs (id),
    node       TEXT NOT NULL,
    lease_id   TEXT NOT NULL,
    expires_at DOUBLE PRECISION NOT NULL,
    leased_at  DOUBLE PRECISION NOT NULL,
    started    BOOLEAN NOT NULL DEFAULT FALSE,
    attempt    BIGINT
);
CREATE INDEX leases_node ON leases (node, leased_at);
CREATE INDEX leases_expiry ON leases (expires_at);

CREATE TABLE job_lost_on (
    job_id  TEXT NOT NULL REFERENCES jobs (id),
    node    TEXT NOT NULL,
    lost_at DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (job_id, node)
);
