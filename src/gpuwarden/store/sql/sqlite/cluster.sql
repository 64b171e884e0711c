-- Named queries of the SQLite store for several hosts (nodes, leases). Each block
-- starts with "-- name: NAME". Loaded by gpuwarden.store.sqlite.

-- name: upsert_node
INSERT INTO nodes (name, token_id, state, capabilities, report, enrolled_at, last_seen)
VALUES (:name, :token_id, 'active', :capabilities, '{}', :now, :now)
ON CONFLICT (name) DO UPDATE
   SET token_id = excluded.token_id, state = 'active', capabilities = excluded.capabilities,
       report = '{}', enrolled_at = excluded.enrolled_at, last_seen = excluded.last_seen;

-- name: get_node
SELECT * FROM nodes WHERE name = :name;

-- name: list_nodes
SELECT * FROM nodes ORDER BY name;

-- name: lock_node
SELECT state FROM nodes WHERE name = :name;

-- name: set_node_state
UPDATE nodes SET state = :state
 WHERE name = :name AND state <> :state
   AND (:sources IS NULL OR state IN (SELECT value FROM json_each(:sources)));

-- name: touch_node
UPDATE nodes
   SET report = :report, last_seen = :now,
       state = CASE WHEN state = 'offline' THEN 'active' ELSE state END
 WHERE name = :name;

-- name: lock_leasable_jobs
-- the queued jobs asked for that have no live lease (a plain read: see queries.sql)
SELECT j.id FROM jobs j LEFT JOIN leases l ON l.job_id = j.id
 WHERE j.id IN (SELECT value FROM json_each(:ids))
   AND j.state = 'queued' AND j.cancel_requested = 0 AND j.held = 0 AND j.hold_by IS NULL
   AND (l.job_id IS NULL OR l.expires_at <= :now);

-- name: put_lease
INSERT INTO leases (job_id, node, lease_id, expires_at, leased_at, started, attempt)
VALUES (:job_id, :node, :lease_id, :expires_at, :now, 0, NULL)
ON CONFLICT (job_id) DO UPDATE
   SET node = excluded.node, lease_id = excluded.lease_id, expires_at = excluded.expires_at,
       leased_at = excluded.leased_at, started = 0, attempt = NULL;

-- name: live_lease_counts
SELECT node, COUNT(*) AS n FROM leases WHERE expires_at > :now GROUP BY node;

-- name: claimable_jobs_after
-- the next page of claimable_jobs: the jobs after (after_priority, after_seq) in its order
SELECT j.id, j.type, j.priority, j.seq, j.submitted_at, j.vram_bytes, j.attempts, j.gpus, j.owner, j.source_repo, j.source_commit,
       j.constraints, CASE WHEN j.inputs = '[]' THEN NULL ELSE j.input_dir END AS input_dir
  FROM jobs j
 WHERE j.state = 'queued' AND j.cancel_requested = 0 AND j.held = 0 AND j.hold_by IS NULL
   AND (j.inputs = '[]' OR j.input_dir IS NOT NULL)
   AND (j.priority < :after_priority OR (j.priority = :after_priority AND j.seq > :after_seq))
   AND NOT EXISTS (SELECT 1 FROM leases l WHERE l.job_id = j.id AND l.expires_at > :now)
 ORDER BY j.priority DESC, j.seq
 LIMIT :limit;

-- name: claimable_jobs
SELECT j.id, j.type, j.priority, j.seq, j.submitted_at, j.vram_bytes, j.attempts, j.gpus, j.owner, j.source_repo, j.source_commit,
       j.constraints, CASE WHEN j.inputs = '[]' THEN NULL ELSE j.input_dir END AS input_dir
  FROM jobs j
 WHERE j.state = 'queued' AND j.cancel_requested = 0 AND j.held = 0 AND j.hold_by IS NULL
   AND (j.inputs = '[]' OR j.input_dir IS NOT NULL)
   AND NOT EXISTS (SELECT 1 FROM leases l WHERE l.job_id = j.id AND l.expires_at > :now)
 ORDER BY j.priority DESC, j.seq
 LIMIT :limit;

-- name: renew_leases
UPDATE leases SET expires_at = :expires_at
 WHERE node = :node AND expires_at > :now AND preempt_for IS NULL;

-- name: renew_leases_of
UPDATE leases SET expires_at = :expires_at
 WHERE node = :node AND expires_at > :now AND preempt_for IS NULL
   AND job_id IN (SELECT value FROM json_each(:ids));

-- name: extend_leases
-- a coordinator that just started: every lease lasts at least until expires_at
UPDATE leases SET expires_at = :expires_at WHERE expires_at < :expires_at;

-- name: leases_all
SELECT * FROM leases ORDER BY leased_at, job_id;

-- name: leases_expired
SELECT * FROM leases WHERE expires_at <= :now ORDER BY leased_at, job_id;

-- name: queued_cancel_requests
-- what the sweep cancels: queued jobs with a cancel request whose node holds no live lease
SELECT j.id FROM jobs j
 WHERE j.state = 'queued' AND j.cancel_requested = 1
   AND NOT EXISTS (SELECT 1 FROM leases l WHERE l.job_id = j.id AND l.expires_at > :now)
 ORDER BY j.priority DESC, j.seq
 LIMIT :limit;

-- name: leases_of_node
SELECT * FROM leases WHERE node = :node ORDER BY leased_at, job_id;

-- name: lease_of
SELECT * FROM leases WHERE job_id = :job_id;

-- name: drop_lease
DELETE FROM leases WHERE job_id = :job_id AND (:lease_id IS NULL OR lease_id = :lease_id);

-- name: mark_lease_started
UPDATE leases SET started = :started, attempt = :attempt, preempt_for = NULL
 WHERE job_id = :job_id AND (:lease_id IS NULL OR lease_id = :lease_id);

-- name: add_lost
INSERT INTO job_lost_on (job_id, node, lost_at) VALUES (:job_id, :node, :now)
ON CONFLICT (job_id, node) DO NOTHING;

-- name: lost_nodes
SELECT node FROM job_lost_on WHERE job_id = :job_id ORDER BY lost_at, node;

-- name: mark_lease_preempt
-- a running job chosen to yield to :for_job: its lease is not renewed from now on,
-- but lasts at least until :expires_at (its grace, then time to report its end)
UPDATE leases SET preempt_for = :for_job, expires_at = MAX(expires_at, :expires_at)
 WHERE job_id = :job_id AND lease_id = :lease_id AND started AND expires_at > :now
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
       j.owner, j.source_repo, j.source_commit, j.constraints, CASE WHEN j.inputs = '[]' THEN NULL ELSE j.input_dir END AS input_dir
  FROM jobs j
 WHERE j.state = 'queued' AND COALESCE(j.owner, '') = :owner
   AND j.cancel_requested = 0 AND j.held = 0 AND j.hold_by IS NULL
   AND (j.inputs = '[]' OR j.input_dir IS NOT NULL)
   AND NOT EXISTS (SELECT 1 FROM leases l WHERE l.job_id = j.id AND l.expires_at > :now)
 ORDER BY j.priority DESC, j.seq
 LIMIT :limit;

-- name: claimable_jobs_of_owner_after
-- the next page of claimable_jobs_of_owner: after (after_priority, after_seq). Two
-- ranges of jobs_queued_owner, each read in index order as far as the page needs (one
-- condition with OR would let the planner read all of the owner's queued jobs and sort)
SELECT * FROM (
    SELECT j.id, j.type, j.priority, j.seq, j.submitted_at, j.vram_bytes, j.attempts,
               j.gpus, j.owner, j.source_repo, j.source_commit, j.constraints,
               CASE WHEN j.inputs = '[]' THEN NULL ELSE j.input_dir END AS input_dir
      FROM jobs j
     WHERE j.state = 'queued' AND COALESCE(j.owner, '') = :owner
           AND j.cancel_requested = 0 AND j.held = 0 AND j.hold_by IS NULL
           AND (j.inputs = '[]' OR j.input_dir IS NOT NULL)
           AND j.priority = :after_priority AND j.seq > :after_seq
           AND NOT EXISTS (SELECT 1 FROM leases l WHERE l.job_id = j.id AND l.expires_at > :now)
     ORDER BY j.seq
     LIMIT :limit
) same_priority
UNION ALL
SELECT * FROM (
    SELECT j.id, j.type, j.priority, j.seq, j.submitted_at, j.vram_bytes, j.attempts,
               j.gpus, j.owner, j.source_repo, j.source_commit, j.constraints,
               CASE WHEN j.inputs = '[]' THEN NULL ELSE j.input_dir END AS input_dir
      FROM jobs j
     WHERE j.state = 'queued' AND COALESCE(j.owner, '') = :owner
           AND j.cancel_requested = 0 AND j.held = 0 AND j.hold_by IS NULL
           AND (j.inputs = '[]' OR j.input_dir IS NOT NULL)
           AND j.priority < :after_priority
           AND NOT EXISTS (SELECT 1 FROM leases l WHERE l.job_id = j.id AND l.expires_at > :now)
     ORDER BY j.priority DESC, j.seq
     LIMIT :limit
) lower_priority
ORDER BY priority DESC, seq
LIMIT :limit;

-- name: running_attempts
-- fair share: what each running job has held so far (its owner, type, declared VRAM and
-- its current attempt's start); as many rows as jobs run
SELECT j.owner, j.type, j.vram_bytes, j.gpus, a.started_at
  FROM jobs j JOIN attempts a ON a.job_id = j.id AND a.number = j.attempts
 WHERE j.state = 'running' AND a.ended_at IS NULL
 ORDER BY j.seq;

-- name: open_grant_of_node
-- diagnostic grants (migration 14): the node's open grant, if any
SELECT * FROM node_grants WHERE node = :node AND used_at IS NULL AND revoked_at IS NULL;

-- name: grants_of_job
SELECT * FROM node_grants WHERE job_id = :job_id ORDER BY id;

-- name: open_grants
SELECT * FROM node_grants WHERE used_at IS NULL AND revoked_at IS NULL ORDER BY node;

-- name: used_grant_jobs
-- the jobs that once started on the node under a grant: never offered to it again
SELECT job_id FROM node_grants WHERE node = :node AND used_at IS NOT NULL;

-- name: insert_grant
INSERT INTO node_grants (node, job_id, granted_by, reason, granted_at)
VALUES (:node, :job_id, :granted_by, :reason, :now);

-- name: use_grant
-- consumed by the job's start there, once: a second start finds it used
UPDATE node_grants SET used_at = :now, attempt = :attempt
 WHERE node = :node AND job_id = :job_id AND used_at IS NULL AND revoked_at IS NULL;

-- name: revoke_grants_of_job
UPDATE node_grants SET revoked_at = :now, revoked_reason = :reason
 WHERE job_id = :job_id AND used_at IS NULL AND revoked_at IS NULL;

-- name: revoke_grant_of_node
UPDATE node_grants SET revoked_at = :now, revoked_reason = :reason
 WHERE node = :node AND used_at IS NULL AND revoked_at IS NULL;

-- name: put_service_route
-- a node's report of one of its services: written over the row of the same name
-- only when it is the same job's, or a row of the same node's
INSERT INTO service_routes
    (name, job_id, node, owner, share, state, upstream, credential, since, last_ok, updated_at)
VALUES (:name, :job_id, :node, :owner, :share, :state, :upstream, :credential, :since,
        :last_ok, :now)
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
 WHERE state <> 'stopped' AND node = :node AND name NOT IN (SELECT value FROM json_each(:names));

-- name: drop_service_route
DELETE FROM service_routes WHERE job_id = :job_id;

-- name: stop_service_route
-- its job's attempt ended: the route is kept as stopped (no upstream, no credential)
UPDATE service_routes SET state = 'stopped', upstream = '', credential = '',
    since = :now, updated_at = :now
 WHERE job_id = :job_id AND state <> 'stopped';

-- name: drop_stopped_routes
-- the stopped routes kept long enough
DELETE FROM service_routes WHERE state = 'stopped' AND since < :before;

-- name: service_routes
SELECT * FROM service_routes ORDER BY name;
