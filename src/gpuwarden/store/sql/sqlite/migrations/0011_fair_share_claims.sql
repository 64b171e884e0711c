-- Fair share across hosts (SPEC.md section 11, "Fair share"): a coordinator offers
-- queued jobs of equal priority least-used owner first. It reads the queue one
-- owner at a time in (priority, arrival) order and merges the owners by their use;
-- this index serves both the owners of queued jobs (a skip scan: one probe per
-- owner) and each owner's queued jobs in order. owner '' is the local CLI / bundles.
-- Mirrors sql/postgres/migrations/0011_fair_share_claims.sql.

CREATE INDEX jobs_queued_owner ON jobs (COALESCE(owner, ''), priority DESC, seq)
 WHERE state = 'queued';
