-- Fair share across hosts (SPEC.md section 11, "Fair share"): the owners of queued
-- jobs (a skip scan) and each owner's queued jobs in (priority, arrival) order, which
-- a coordinator merges least-used owner first. Mirrors
-- sql/sqlite/migrations/0011_fair_share_claims.sql.

CREATE INDEX jobs_queued_owner ON jobs ((COALESCE(owner, '')), priority DESC, seq)
 WHERE state = 'queued';
