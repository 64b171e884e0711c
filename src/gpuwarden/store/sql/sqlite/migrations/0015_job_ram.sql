-- Host RAM admission (SPEC.md section 11, "Host RAM"): what a job asks of the
-- host's RAM, in bytes, 0 when it asks nothing: its cap (ram_gib, enforced by the
-- kernel), the floor that must stay available beside it (ram_floor_gib) and the
-- MemAvailable it needs right before it starts (ram_start_min_gib). Mirrors
-- sql/postgres/migrations/0015_job_ram.sql.

ALTER TABLE jobs ADD COLUMN ram_cap_bytes INTEGER NOT NULL DEFAULT 0;
ALTER TABLE jobs ADD COLUMN ram_floor_bytes INTEGER NOT NULL DEFAULT 0;
ALTER TABLE jobs ADD COLUMN ram_start_min_bytes INTEGER NOT NULL DEFAULT 0;
