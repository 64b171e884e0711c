-- Job dependencies (SPEC.md section 1, "Dependencies"): the edges, indexed by the
-- job depended on (what a job's end looks up), the job's own list as it was
-- submitted, and the held flag: queued but not to be planned or claimed while
-- a dependency does not hold yet.

ALTER TABLE jobs ADD COLUMN depends_on TEXT NOT NULL DEFAULT '[]';
ALTER TABLE jobs ADD COLUMN held INTEGER NOT NULL DEFAULT 0;

CREATE TABLE job_deps (
    job_id TEXT NOT NULL REFERENCES jobs (id),
    kind   TEXT NOT NULL CHECK (kind IN ('afterok', 'afterany', 'afternotok')),
    dep_id TEXT NOT NULL REFERENCES jobs (id),
    PRIMARY KEY (job_id, kind, dep_id)
);
CREATE INDEX job_deps_dep ON job_deps (dep_id);
CREATE INDEX jobs_held ON jobs (seq) WHERE held = 1;
