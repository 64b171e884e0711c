-- Several hosts: enrolled nodes (agents), leases of queued jobs to nodes, and
-- the nodes a job's attempt was lost with (placement prefers another one).

CREATE TABLE nodes (
    name         TEXT PRIMARY KEY,
    token_id     TEXT,
    state        TEXT NOT NULL DEFAULT 'active'
                 CHECK (state IN ('active', 'draining', 'revoked', 'offline')),
    capabilities TEXT NOT NULL DEFAULT '{}',
    report       TEXT NOT NULL DEFAULT '{}',
    enrolled_at  REAL NOT NULL,
    last_seen    REAL
);

CREATE TABLE leases (
    job_id     TEXT PRIMARY KEY REFERENCES jobs (id),
    node       TEXT NOT NULL,
    lease_id   TEXT NOT NULL,
    expires_at REAL NOT NULL,
    leased_at  REAL NOT NULL,
    started    INTEGER NOT NULL DEFAULT 0,
    attempt    INTEGER
);
CREATE INDEX leases_node ON leases (node, leased_at);
CREATE INDEX leases_expiry ON leases (expires_at);

CREATE TABLE job_lost_on (
    job_id  TEXT NOT NULL REFERENCES jobs (id),
    node    TEXT NOT NULL,
    lost_at REAL NOT NULL,
    PRIMARY KEY (job_id, node)
);
