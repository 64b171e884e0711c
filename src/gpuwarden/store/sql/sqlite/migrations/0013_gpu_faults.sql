-- A critical Xid latches its GPU (SPEC.md section 2, "GPU health (Xid)"): the latch
-- is kept here, so that it survives a broker restart, until `gpuwarden gpu clear`
-- ends it, with who cleared it and why. Rows are kept (the history); at most one
-- latch per node and GPU is open (cleared_at null). A clear request now says who
-- asked and why.

ALTER TABLE gpu_clears ADD COLUMN requested_by TEXT NOT NULL DEFAULT '';
ALTER TABLE gpu_clears ADD COLUMN reason TEXT NOT NULL DEFAULT '';

CREATE TABLE gpu_faults (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    node         TEXT NOT NULL,
    gpu_uuid     TEXT NOT NULL,
    xid          INTEGER NOT NULL,
    reason       TEXT NOT NULL,
    latched_at   REAL NOT NULL,
    cleared_at   REAL,
    cleared_by   TEXT,
    clear_reason TEXT
);
CREATE UNIQUE INDEX gpu_faults_open ON gpu_faults (node, gpu_uuid) WHERE cleared_at IS NULL;
