-- Measured profiles of job types (SPEC.md section 11, "Profiles"): the RAM peak of
-- each attempt, the largest per type (raised, never lowered), and the run time a
-- job's submitter may declare (est_s, used for backfill until its type has a
-- measured one). Mirrors sql/sqlite/migrations/0008_type_profiles.sql.

ALTER TABLE jobs ADD COLUMN est_s DOUBLE PRECISION;
ALTER TABLE attempts ADD COLUMN ram_peak_bytes BIGINT;

CREATE TABLE type_profiles (
    type            TEXT PRIMARY KEY,
    ram_peak_bytes  BIGINT NOT NULL,
    job_id          TEXT,
    updated_at      DOUBLE PRECISION NOT NULL
);
