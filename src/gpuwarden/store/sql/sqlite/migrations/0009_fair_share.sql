-- Fair share in VRAM-hours (SPEC.md section 11, "Fair share"): each owner's use in
-- GiB-hours of VRAM held, as of the time it was last brought up to date (it decays
-- with the broker's half-life when read). One row per owner: the broker loads it at
-- start and adds to it as each attempt ends. owner '' is the local CLI / bundles.

CREATE TABLE fair_share (
    owner   TEXT PRIMARY KEY,
    gib_h   REAL NOT NULL,
    as_of   REAL NOT NULL
);
