-- Preemption across hosts at the lease boundary (SPEC.md section 16): the lease of a
-- running job a coordinator chose to preempt names the waiting job it yields to. Such
-- a lease is not renewed; the node's report of the attempt's end clears it. Stored,
-- so the choice survives a coordinator's restart.

ALTER TABLE leases ADD COLUMN preempt_for TEXT;
