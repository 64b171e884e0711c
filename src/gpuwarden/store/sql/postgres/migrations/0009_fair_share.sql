-- Fair share in VRAM-hours (SPEC.md section 11, "Fair share"): each owner's use in
-- GiB-hours of VRAM held, as of the time it was last brought up to date (it decays
-- with the broker's half-life when read). Mirrors sql/sqlite/migrations/0009_fair_share.sql.

CREATE TABLE fair_share (
    owner   TEXT PRIMARY KEY,
    gib_h   DOUBLE PRECISION NOT NULL,
    as_of   DOUBLE PRECISION NOT NULL
);
