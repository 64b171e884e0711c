-- Services across hosts (SPEC.md section 16, "Services across hosts"): the route
-- of each running service a node reports at its heartbeat, by its name in URLs
-- (/run/<name>/). owner and share are the job row's; since and last_ok are on
-- the coordinator's clock; updated_at is the heartbeat that wrote it. A row goes
-- when its job's attempt ends on the coordinator or its node stops reporting it.
-- Mirrors sql/postgres/migrations/0017_service_routes.sql.

CREATE TABLE service_routes (
    name       TEXT PRIMARY KEY,
    job_id     TEXT NOT NULL,
    node       TEXT NOT NULL,
    owner      TEXT,
    share      TEXT NOT NULL DEFAULT '[]',
    state      TEXT NOT NULL,
    upstream   TEXT NOT NULL,
    credential TEXT NOT NULL,
    since      REAL NOT NULL,
    last_ok    REAL,
    updated_at REAL NOT NULL
);
CREATE INDEX service_routes_node ON service_routes (node);
CREATE INDEX service_routes_job ON service_routes (job_id);
