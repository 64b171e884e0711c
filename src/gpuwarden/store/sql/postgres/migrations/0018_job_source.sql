-- Jobs from a pinned commit (SPEC.md, "Jobs from a pinned commit"): the
-- repository URL and the full commit id a job's module comes from (NULL: a
-- module the node has). Mirrors sql/sqlite/migrations/0018_job_source.sql.

ALTER TABLE jobs ADD COLUMN source_repo TEXT;
ALTER TABLE jobs ADD COLUMN source_commit TEXT;
