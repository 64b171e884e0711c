-- Measured VRAM footprints per job type: raised by measurement, never lowered by it.

CREATE TABLE footprints (
    type        TEXT PRIMARY KEY,
    bytes       BIGINT NOT NULL,
    job_id      TEXT,
    updated_at  DOUBLE PRECISION NOT NULL
);
