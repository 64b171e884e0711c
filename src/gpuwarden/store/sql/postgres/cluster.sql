-- Named queries of the PostgreSQL store for several hosts (nodes, leases). Each
-- block starts with "-- name: NAME". Loaded by gpuwarden.store.postgres.

-- name: upsert_node
INSERT INTO nodes (name, token_id, state, capabilities, report, enrolled_at, last_seen)
VALUES (%(name)s, %(token_id)s, 'active', %(capabilities)s, '{}', %(now)s, %(now)s)
ON CONFLICT (name) DO UPDATE
   SET token_id = excluded.token_id, state = 'active', capabilities = excluded.capabilities,
       report = '{}', enrolled_at = excluded.enrolled_at, last_seen = excluded.last_seen
RETURNING *;

-- name: get_node
SELECT * FROM nodes WHERE name = %(name)s;

-- name: list_nodes
SELECT * FROM nodes ORDER BY name;

-- name: lock_node
SELECT state FROM nodes WHERE name = %(name)s FOR UPDATE;

-- name: set_node_state
UPDATE nodes SET state = %(state)s
 WHERE name = %(name)s AND state <> %(state)s
   AND (%(sources)s::text[] IS NULL OR state = ANY(%(sources)s::text[]));

-- name: touch_node
UPDATE nodes
   SET report = %(report)s, last_seen = %(now)s,
       state = CASE WHEN state = 'offline' THEN 'active' ELSE state END
 WHERE name = %(name)s
RETURNING *;

-- name: lock_leasable_jobs
-- the queued jobs asked for that have no live lease, locked; one another writer holds
-- is skipped, not waited for (a job leased already is not even locked: its node may be
-- starting it, and that start must not find its row locked)
SELECT j.id FROM jobs j
 WHERE j.id = ANY(%(ids)s::text[]) AND j.state = 'queued' AND NOT j.cancel_requested
   AND NOT j.held AND j.hold_by IS NULL
   AND NOT EXISTS (SELECT 1 FROM leases l
                    WHERE l.job_id = j.id AND l.expires_at > %(now)s)
 FOR UPDATE OF j SKIP LOCKED;

-- name: put_lease
-- an expired lease is replaced; a live one (committed by another writer) is kept
INSERT INTO leases (job_id, node, lease_id, expires_at, leased_at, started, attempt)
VALUES (%(job_id)s, %(node)s, %(lease_id)s, %(expires_at)s, %(now)s, FALSE, NULL)
ON CONFLICT (job_id) DO UPDATE
   SET node = excluded.node, lease_id = excluded.lease_id, expires_at = excluded.expires_at,
       leased_at = excluded.leased_at, started = FALSE, attempt = NULL
 WHERE leases.expires_at <= %(now)s;

-- name: lease_free_jobs
-- a claim in one statement: the queued jobs asked for that have no live lease, locked
-- (one another writer holds is skipped, not waited for; see lock_leasable_jobs), each
-- given the lease (an expired one replaced, a live one kept); the ids leased
WITH free AS (
  SELECT j.id FROM jobs j
   WHERE j.id = ANY(%(ids)s::text[]) AND j.state = 'queued' AND NOT j.cancel_requested
     AND NOT j.held AND j.hold_by IS NULL
     AND NOT EXISTS (SELECT 1 FROM leases l
                      WHERE l.job_id = j.id AND l.expires_at > %(now)s)
   FOR UPDATE OF j SKIP LOCKED
)
INSERT INTO leases (job_id, node, lease_id, expires_at, leased_at, started, attempt)
SELECT free.id, %(node)s, %(lease_id)s, %(expires_at)s, %(now)s, FALSE, NULL FROM free
ON CONFLICT (job_id) DO UPDATE
   SET node = excluded.node, lease_id = excluded.lease_id, expires_at = excluded.expires_at,
       leased_at = excluded.leased_at, started = FALSE, attempt = NULL
 WHERE leases.expires_at <= %(now)s
RETURNING job_id;

-- name: live_lease_counts
SELECT node, COUNT(*) AS n FROM leases WHERE expires_at > %(now)s GROUP BY node;

-- name: claimable_jobs_after
-- the next page of claimable_jobs: the jobs after (after_priority, after_seq) in its order
SELECT j.id, j.type, j.priority, j.seq, j.submitted_at, j.vram_bytes, j.attempts, j.gpus, j.owner, j.source_repo, j.source_commit,
       j.constraints, CASE WHEN j.inputs = '[]'::jsonb THEN NULL ELSE j.input_dir END AS input_dir
  FROM jobs j
 WHERE j.state = 'queued' AND NOT j.cancel_requested AND NOT j.held AND j.hold_by IS NULL
   AND (j.inputs = '[]'::jsonb OR j.input_dir IS NOT NULL)
   AND (j.priority < %(after_priority)s
        OR (j.priority = %(after_priority)s AND j.seq > %(after_seq)s))
   AND NOT EXISTS (SELECT 1 FROM leases l WHERE l.job_id = j.id AND l.expires_at > %(now)s)
 ORDER BY j.priority DESC, j.seq
 LIMIT %(limit)s;

-- name: claimable_jobs
SELECT j.id, j.type, j.priority, j.seq, j.submitted_at, j.vram_bytes, j.attempts, j.gpus, j.owner, j.source_repo, j.source_commit,
       j.constraints, CASE WHEN j.inputs = '[]'::jsonb THEN NULL ELSE j.input_dir END AS input_dir
  FROM jobs j
 WHERE j.state = 'queued' AND NOT j.cancel_requested AND NOT j.held AND j.hold_by IS NULL
   AND (j.inputs = '[]'::jsonb OR j.input_dir IS NOT NULL)
   AND NOT EXISTS (SELECT 1 FROM leases l WHERE l.job_id = j.id AND l.expires_at > %(now)s)
 ORDER BY j.priority DESC, j.seq
 LIMIT %(limit)s;

-- name: renew_leases
UPDATE leases SET expires_at = %(expires_at)s
 WHERE node = %(node)s AND expires_at > %(now)s AND preempt_for IS NULL;

-- name: renew_leases_of
UPDATE leases SET expires_at = %(expires_at)s
 WHERE node = %(node)s AND expires_at > %(now)s AND preempt_for IS NULL
   AND job_id = ANY(%(ids)s::text[]);

-- name: extend_leases
-- a coordinator that just started: every lease lasts at least until expires_at
UPDATE leases SET expires_at = %(expires_at)s WHERE expires_at < %(expires_at)s;

-- name: leases_all
SELECT * FROM leases ORDER BY leased_at, job_id;

-- name: leases_expired
SELECT * FROM leases WHERE expires_at <= %(now)s ORDER BY leased_at, job_id;

-- name: queued_cancel_requests
-- what the sweep cancels: queued jobs with a cancel request whose node holds no live lease
SELECT j.id FROM jobs j
 WHERE j.state = 'queued' AND j.cancel_requested
   AND NOT EXISTS (SELECT 1 FROM leases l WHERE l.job_id = j.id AND l.expires_at > %(now)s)
 ORDER BY j.priority DESC, j.seq
 LIMIT %(limit)s;

-- name: leases_of_node
SELECT * FROM leases WHERE node = %(node)s ORDER BY leased_at, job_id;

-- name: lease_of
SELECT * FROM leases WHERE job_id = %(job_id)s;

-- name: drop_lease
DELETE FROM leases
 WHERE job_id = %(job_id)s AND (%(lease_id)s::text IS NULL OR lease_id = %(lease_id)s::text);

-- name: mark_lease_started
UPDATE leases SET started = %(started)s, attempt = %(attempt)s, preempt_for = NULL
 WHERE job_id = %(job_id)s AND (%(lease_id)s::text IS NULL OR lease_id = %(lease_id)s::text);

-- name: add_lost
INSERT INTO job_lost_on (job_id, node, lost_at) VALUES (%(job_id)s, %(node)s, %(now)s)
ON CONFLICT (job_id, node) DO NOTHING;

-- name: lost_nodes
SELECT node FROM job_lost_on WHERE job_id = %(job_id)s ORDER BY lost_at, node;

-- name: try_lock
SELECT pg_try_advisory_lock(%(key)s) AS got;

-- name: unlock
SELECT pg_advisory_unlock(%(key)s) AS released;

-- name: mark_lease_preempt
-- a running job chosen to yield to for_job: its lease is not renewed from now on,
-- but lasts at least until expires_at (its grace, then time to report its end)
UPDATE leases SET preempt_for = %(for_job)s, expires_at = GREATEST(expires_at, %(expires_at)s)
 WHERE job_id = %(job_id)s AND lease_id = %(lease_id)s AND started AND expires_at > %(now)s
   AND preempt_for IS NULL;

-- name: queued_owners
-- fair share: the owners of queued jobs ('' for local), one index probe each (a skip
-- scan over jobs_queued_owner)
WITH RECURSIVE o(owner) AS (
    SELECT (SELECT COALESCE(j.owner, '') FROM jobs j WHERE j.state = 'queued'
             ORDER BY COALESCE(j.owner, '') LIMIT 1)
    UNION ALL
    SELECT (SELECT COALESCE(j.owner, '') FROM jobs j
             WHERE j.state = 'queued' AND COALESCE(j.owner, '') > o.owner
             ORDER BY COALESCE(j.owner, '') LIMIT 1)
      FROM o WHERE o.owner IS NOT NULL
)
SELECT owner FROM o WHERE owner IS NOT NULL;

-- name: claimable_jobs_of_owner
-- claimable_jobs of one owner ('' for local), in its order (jobs_queued_owner)
SELECT j.id, j.type, j.priority, j.seq, j.submitted_at, j.vram_bytes, j.attempts, j.gpus,
       j.owner, j.source_repo, j.source_commit, j.constraints, CASE WHEN j.inputs = '[]'::jsonb THEN NULL ELSE j.input_dir END AS input_dir
  FROM jobs j
 WHERE j.state = 'queued' AND COALESCE(j.owner, '') = %(owner)s
   AND NOT j.cancel_requested AND NOT j.held AND j.hold_by IS NULL
   AND (j.inputs = '[]'::jsonb OR j.input_dir IS NOT NULL)
   AND NOT EXISTS (SELECT 1 FROM leases l WHERE l.job_id = j.id AND l.expires_at > %(now)s)
 ORDER BY j.priority DESC, j.seq
 LIMIT %(limit)s;

-- name: claimable_jobs_of_owner_after
-- the next page of claimable_jobs_of_owner: after (after_priority, after_seq). Two
-- ranges of jobs_queued_owner, each read in index order as far as the page needs (one
-- condition with OR would let the planner read all of the owner's queued jobs and sort)
SELECT * FROM (
    SELECT j.id, j.type, j.priority, j.seq, j.submitted_at, j.vram_bytes, j.attempts,
               j.gpus, j.owner, j.source_repo, j.source_commit, j.constraints,
               CASE WHEN j.inputs = '[]'::jsonb THEN NULL ELSE j.input_dir END AS input_dir
      FROM jobs j
     WHERE j.state = 'queued' AND COALESCE(j.owner, '') = %(owner)s
           AND NOT j.cancel_requested AND NOT j.held AND j.hold_by IS NULL
           AND (j.inputs = '[]'::jsonb OR j.input_dir IS NOT NULL)
           AND j.priority = %(after_priority)s AND j.seq > %(after_seq)s
           AND NOT EXISTS (SELECT 1 FROM leases l WHERE l.job_id = j.id AND l.expires_at > %(now)s)
     ORDER BY j.seq
     LIMIT %(limit)s
) same_priority
UNION ALL
SELECT * FROM (
    SELECT j.id, j.type, j.priority, j.seq, j.submitted_at, j.vram_bytes, j.attempts,
               j.gpus, j.owner, j.source_repo, j.source_commit, j.constraints,
               CASE WHEN j.inputs = '[]'::jsonb THEN NULL ELSE j.input_dir END AS input_dir
      FROM jobs j
     WHERE j.state = 'queued' AND COALESCE(j.owner, '') = %(owner)s
           AND NOT j.cancel_requested AND NOT j.held AND j.hold_by IS NULL
           AND (j.inputs = '[]'::jsonb OR j.input_dir IS NOT NULL)
           AND j.priority < %(after_priority)s
           AND NOT EXISTS (SELECT 1 FROM leases l WHERE l.job_id = j.id AND l.expires_at > %(now)s)
     ORDER BY j.priority DESC, j.seq
     LIMIT %(limit)s
) lower_priority
ORDER BY priority DESC, seq
LIMIT %(limit)s;

-- name: running_attempts
-- fair share: what each running job has held so far (its owner, type, declared VRAM and
-- its current attempt's start); as many rows as jobs run
SELECT j.owner, j.type, j.vram_bytes, j.gpus, a.started_at
  FROM jobs j JOIN attempts a ON a.job_id = j.id AND a.number = j.attempts
 WHERE j.state = 'running' AND a.ended_at IS NULL
 ORDER BY j.seq;

-- name: open_grant_of_node
-- diagnostic grants (migration 14): the node's open grant, if any
SELECT * FROM node_grants WHERE node = %(node)s AND used_at IS NULL AND revoked_at IS NULL;

-- name: grants_of_job
SELECT * FROM node_grants WHERE job_id = %(job_id)s ORDER BY id;

-- name: open_grants
SELECT * FROM node_grants WHERE used_at IS NULL AND revoked_at IS NULL ORDER BY node;

-- name: used_grant_jobs
-- the jobs that once started on the node under a grant: never offered to it again
SELECT job_id FROM node_grants WHERE node = %(node)s AND used_at IS NOT NULL;

-- name: insert_grant
INSERT INTO node_grants (node, job_id, granted_by, reason, granted_at)
VALUES (%(node)s, %(job_id)s, %(granted_by)s, %(reason)s, %(now)s);

-- name: use_grant
-- consumed by the job's start there, once: a second start finds it used
UPDATE node_grants SET used_at = %(now)s, attempt = %(attempt)s
 WHERE node = %(node)s AND job_id = %(job_id)s AND used_at IS NULL AND revoked_at IS NULL;

-- name: revoke_grants_of_job
UPDATE node_grants SET revoked_at = %(now)s, revoked_reason = %(reason)s
 WHERE job_id = %(job_id)s AND used_at IS NULL AND revoked_at IS NULL;

-- name: revoke_grant_of_node
UPDATE node_grants SET revoked_at = %(now)s, revoked_reason = %(reason)s
 WHERE node = %(node)s AND used_at IS NULL AND revoked_at IS NULL;

-- name: put_service_route
-- a node's report of one of its services: written over the row of the same name
-- only when it is the same job's, or a row of the same node's
INSERT INTO service_routes
    (name, job_id, node, owner, share, state, upstream, credential, since, last_ok, updated_at)
VALUES (%(name)s, %(job_id)s, %(node)s, %(owner)s, %(share)s, %(state)s, %(upstream)s,
        %(credential)s, %(since)s, %(last_ok)s, %(now)s)
ON CONFLICT (name) DO UPDATE SET
    job_id = excluded.job_id, node = excluded.node, owner = excluded.owner,
    share = excluded.share, state = excluded.state, upstream = excluded.upstream,
    credential = excluded.credential, since = excluded.since, last_ok = excluded.last_ok,
    updated_at = excluded.updated_at
 WHERE service_routes.job_id = excluded.job_id OR service_routes.node = excluded.node
    OR service_routes.state = 'stopped';

-- name: drop_node_routes_but
-- the node's routes it no longer reports (an ended one's is kept: stop_service_route)
DELETE FROM service_routes
 WHERE state <> 'stopped' AND node = %(node)s AND NOT (name = ANY(%(names)s::text[]));

-- name: drop_service_route
DELETE FROM service_routes WHERE job_id = %(job_id)s;

-- name: stop_service_route
-- its job's attempt ended: the route is kept as stopped (no upstream, no credential)
UPDATE service_routes SET state = 'stopped', upstream = '', credential = '',
    since = %(now)s, updated_at = %(now)s
 WHERE job_id = %(job_id)s AND state <> 'stopped';

-- name: drop_stopped_routes
-- the stopped routes kept long enough
DELETE FROM service_routes WHERE state = 'stopped' AND since < %(before)s;

-- name: service_routes
SELECT * FROM service_routes ORDER BY name;
