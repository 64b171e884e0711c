-- What a job asks of the host it runs on (placement across nodes): a JSON object
-- with min_gpu_vram_gib, gpu_model, labels, node (SPEC.md section 4).
-- Mirrors sql/sqlite/migrations/0006_job_constraints.sql.

ALTER TABLE jobs ADD COLUMN constraints JSONB NOT NULL DEFAULT '{}';
