-- Service jobs (SPEC.md, "Service jobs"): a service type's job's name in URLs
-- (NULL: its id), who besides its owner may reach it (a JSON list of token ids
-- or role names), and who asked to stop it (`gpuwarden stop`; NULL: nobody).
-- Mirrors sql/sqlite/migrations/0016_job_service.sql.

ALTER TABLE jobs ADD COLUMN service TEXT;
ALTER TABLE jobs ADD COLUMN share TEXT NOT NULL DEFAULT '[]';
ALTER TABLE jobs ADD COLUMN stop_requested_by TEXT;
