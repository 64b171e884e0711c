-- Job control (SPEC.md section 1, "Job control"): a person's hold, kept apart from
-- the dependencies' `held` (0007) so that neither releases the other: who holds the
-- job (NULL: nobody); a queued job only, cleared by every transition like `held`.
-- And the attempts a requeue left behind: its retries count from the attempt after
-- them (its attempt numbers go on, so nothing of the earlier run is overwritten).
-- Mirrors sql/sqlite/migrations/0020_job_control.sql.

ALTER TABLE jobs ADD COLUMN hold_by TEXT;
ALTER TABLE jobs ADD COLUMN requeued_after INTEGER NOT NULL DEFAULT 0;
CREATE INDEX jobs_hold_by ON jobs (seq) WHERE hold_by IS NOT NULL;
