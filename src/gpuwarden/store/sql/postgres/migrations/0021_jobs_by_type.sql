-- The live jobs of one type (the VRAM leases of SPEC.md "VRAM leases": status, top,
-- the dashboard and GET /v1/leases list them) read by an index, not found among
-- every live job. Mirrors sql/sqlite/migrations/0021_jobs_by_type.sql.

CREATE INDEX jobs_type_state ON jobs (type, state, seq);
