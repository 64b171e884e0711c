-- Measured profiles of job types (SPEC.md section 11, "Profiles"): the RAM peak of
-- each attempt, the largest per type (raised, never lowered), and the run time a
-- job's submitter may declare (est_s, used for backfill until its type has a
-- measured one).

ALTER TABLE jobs ADD COLUMN est_s REAL;
ALTER TABLE attempts ADD COLUMN ram_peak_bytes INTEGER;

CREATE TABLE type_profiles (
    type            TEXT PRIMARY KEY,
    ram_peak_bytes  INTEGER NOT NULL,
    job_id          TEXT,
    updated_at      REAL NOT NULL
);
