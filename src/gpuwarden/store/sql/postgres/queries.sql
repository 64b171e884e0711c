-- Named queries for the PostgreSQL store. Each block starts with "-- name: NAME".
-- Parameters are psycopg's %(name)s placeholders. Every statement that changes a
-- job first locks its row (lock_job, or lock_job_to_start with SKIP LOCKED).

-- name: insert_job
INSERT INTO jobs (id, type, state, priority, params, inputs, outputs, vram_bytes,
                  spec_hash, submitted_at, updated_at, bundle, queue_root, input_dir, owner,
                  constraints, depends_on, held)
VALUES (%(id)s, %(type)s, 'queued', %(priority)s, %(params)s, %(inputs)s, %(outputs)s,
        %(vram_bytes)s, %(spec_hash)s, %(now)s, %(now)s, %(bundle)s, %(queue_root)s,
        %(input_dir)s, %(owner)s, %(constraints)s, %(depends_on)s, %(held)s);

-- name: job_ids_existing
SELECT id FROM jobs WHERE id = ANY(%(ids)s::text[]);

-- name: jobs_by_ids
SELECT * FROM jobs WHERE id = ANY(%(ids)s::text[]) ORDER BY seq;

-- name: get_job
SELECT * FROM jobs WHERE id = %(id)s;

-- name: lock_job
SELECT * FROM jobs WHERE id = %(id)s FOR UPDATE;

-- name: lock_job_to_start
SELECT * FROM jobs WHERE id = %(id)s FOR UPDATE SKIP LOCKED;

-- name: list_jobs
SELECT * FROM jobs ORDER BY seq DESC LIMIT %(limit)s;

-- name: list_jobs_in_states
SELECT * FROM jobs WHERE state = ANY(%(states)s::text[]) ORDER BY seq DESC LIMIT %(limit)s;

-- name: list_jobs_of_owner
SELECT * FROM jobs WHERE owner = %(owner)s ORDER BY seq DESC LIMIT %(limit)s;

-- name: list_jobs_of_owner_in_states
SELECT * FROM jobs
 WHERE owner = %(owner)s AND state = ANY(%(states)s::text[])
 ORDER BY seq DESC LIMIT %(limit)s;

-- name: live_jobs_of_type
-- queued or running, newest first, by the index of 0021 (type, state, seq)
SELECT * FROM jobs WHERE type = %(type)s AND state IN ('queued', 'running') ORDER BY seq DESC;

-- name: queued_jobs
SELECT * FROM jobs WHERE state = 'queued' ORDER BY priority DESC, seq LIMIT %(limit)s;

-- name: terminal_count
SELECT count(*) AS n FROM jobs
 WHERE id = ANY(%(ids)s::text[]) AND state IN ('done', 'failed', 'cancelled', 'quarantined');

-- name: queue_entries
-- the queued jobs that may be planned: not held for their dependencies, nor by a person
SELECT id, type, priority, seq, vram_bytes, cancel_requested, est_s, owner, gpus,
       ram_cap_bytes, ram_floor_bytes, ram_start_min_bytes, constraints->>'gpu' AS gpu_pin FROM jobs
 WHERE state = 'queued' AND NOT held AND hold_by IS NULL;

-- name: queued_count
-- index-only counts (a held job is always queued: every transition clears held and
-- hold_by); the last reads the few jobs a person holds
SELECT (SELECT COUNT(*) FROM jobs WHERE state = 'queued')
     - (SELECT COUNT(*) FROM jobs WHERE held)
     - (SELECT COUNT(*) FROM jobs WHERE hold_by IS NOT NULL AND NOT held) AS n;

-- name: queue_entries_of
SELECT id, type, priority, seq, vram_bytes, cancel_requested, est_s, owner, gpus,
       ram_cap_bytes, ram_floor_bytes, ram_start_min_bytes, constraints->>'gpu' AS gpu_pin FROM jobs
 WHERE state = 'queued' AND NOT held AND hold_by IS NULL AND id = ANY(%(ids)s::text[]);

-- name: running_jobs
SELECT * FROM jobs WHERE state = 'running' ORDER BY seq;

-- name: count_by_state
SELECT state, COUNT(*) AS n FROM jobs GROUP BY state;

-- name: transition_job
UPDATE jobs
   SET state = %(target)s, updated_at = %(now)s, reason = %(reason)s,
       stop_requested_by = NULL,
       exit_code = COALESCE(%(exit_code)s::bigint, exit_code),
       result = COALESCE(%(result)s::jsonb, result),
       cancel_requested = CASE WHEN %(target)s = 'queued' THEN cancel_requested ELSE FALSE END,
       held = FALSE, hold_by = NULL
 WHERE id = %(id)s AND state = ANY(%(sources)s::text[]);

-- name: start_job
UPDATE jobs SET state = 'running', updated_at = %(now)s, attempts = attempts + 1, reason = ''
 WHERE id = %(id)s AND state = 'queued' AND NOT cancel_requested AND NOT held
   AND hold_by IS NULL;

-- name: insert_attempt
INSERT INTO attempts (job_id, number, node, gpu_uuid, started_at)
VALUES (%(job_id)s, %(number)s, %(node)s, %(gpu_uuid)s, %(now)s);

-- name: set_attempt_pid
UPDATE attempts SET pid = %(pid)s WHERE job_id = %(job_id)s AND number = %(number)s;

-- name: finish_attempt
UPDATE attempts
   SET ended_at = %(now)s, exit_code = %(exit_code)s, outcome = %(outcome)s,
       reason = %(reason)s, stdout = %(stdout)s, stderr = %(stderr)s
 WHERE job_id = %(job_id)s AND number = %(number)s AND ended_at IS NULL
   AND number = (SELECT attempts FROM jobs WHERE id = %(job_id)s AND state = 'running');

-- name: attempts
SELECT * FROM attempts WHERE job_id = %(job_id)s ORDER BY number;

-- name: mark_cancel_requested
UPDATE jobs SET cancel_requested = TRUE, updated_at = %(now)s
 WHERE id = %(id)s AND state = 'running';

-- name: lock_log
-- Taken before a row is added to the events or the audit log and held to the end
-- of the transaction: ids are handed out in commit order, so a reader following a
-- log by id (events(after_id=...)) never skips a row that commits late.
SELECT pg_advisory_xact_lock(%(key)s);

-- name: insert_event
INSERT INTO events (ts, kind, job_id, from_state, to_state, detail)
VALUES (%(ts)s, %(kind)s, %(job_id)s, %(from_state)s, %(to_state)s, %(detail)s)
RETURNING id;

-- name: insert_event_locked
-- lock_log and insert_event in one statement (one round trip): the lock is taken
-- (the materialized CTE is read) before the row, and so its id, is made
WITH l AS MATERIALIZED (SELECT pg_advisory_xact_lock(%(key)s))
INSERT INTO events (ts, kind, job_id, from_state, to_state, detail)
SELECT %(ts)s::double precision, %(kind)s::text, %(job_id)s::text, %(from_state)s::text,
       %(to_state)s::text, %(detail)s::jsonb
  FROM l
RETURNING id;

-- name: last_event_id
SELECT COALESCE(MAX(id), 0) AS id FROM events;

-- name: events_all
SELECT * FROM events WHERE id > %(after_id)s ORDER BY id LIMIT %(limit)s;

-- name: events_for_job
SELECT * FROM events WHERE job_id = %(job_id)s AND id > %(after_id)s ORDER BY id
 LIMIT %(limit)s;

-- name: insert_bundle
INSERT INTO bundles (queue_root, name, job_ids, received_at)
VALUES (%(queue_root)s, %(name)s, %(job_ids)s, %(now)s);

-- name: insert_rejected_bundle
INSERT INTO bundles (queue_root, name, job_ids, received_at, finished_at, outcome, result_path)
VALUES (%(queue_root)s, %(name)s, '[]', %(now)s, %(now)s, 'rejected', %(result_path)s)
ON CONFLICT (queue_root, name) DO NOTHING;

-- name: get_bundle
SELECT * FROM bundles WHERE queue_root = %(queue_root)s AND name = %(name)s;

-- name: open_bundles
SELECT * FROM bundles WHERE finished_at IS NULL ORDER BY received_at, name;

-- name: finish_bundle
UPDATE bundles SET finished_at = %(now)s, outcome = %(outcome)s, result_path = %(result_path)s
 WHERE queue_root = %(queue_root)s AND name = %(name)s;

-- name: put_node_status
INSERT INTO node_status (node, pid, updated_at, payload)
VALUES (%(node)s, %(pid)s, %(updated_at)s, %(payload)s)
ON CONFLICT (node) DO UPDATE
   SET pid = excluded.pid, updated_at = excluded.updated_at, payload = excluded.payload;

-- name: node_statuses
SELECT * FROM node_status ORDER BY node;

-- name: footprints
SELECT * FROM footprints ORDER BY type;

-- name: recent_run_times
SELECT j.type AS type, a.ended_at - a.started_at AS seconds
  FROM attempts a JOIN jobs j ON j.id = a.job_id
 WHERE a.outcome = 'succeeded' AND a.ended_at IS NOT NULL
 ORDER BY a.ended_at DESC
 LIMIT %(limit)s;

-- name: attempt_spans
SELECT a.job_id AS job_id, a.number AS number, a.gpu_uuid AS gpu_uuid,
       a.started_at AS started_at, a.ended_at AS ended_at, a.outcome AS outcome,
       j.type AS type, j.owner AS owner, j.submitted_at AS submitted_at
  FROM attempts a JOIN jobs j ON j.id = a.job_id
 WHERE a.ended_at IS NULL OR a.ended_at >= %(since)s
 ORDER BY a.started_at DESC
 LIMIT %(limit)s;

-- name: request_gpu_clear
INSERT INTO gpu_clears (gpu_uuid, requested_at, requested_by, reason)
VALUES (%(gpu_uuid)s, %(now)s, %(by)s, %(reason)s);

-- name: pending_gpu_clears
-- SKIP LOCKED: two brokers taking requests at once each take a request at most once
-- between them, and neither waits for the other.
SELECT id, gpu_uuid, requested_by, reason FROM gpu_clears WHERE taken_at IS NULL ORDER BY id FOR UPDATE SKIP LOCKED;

-- name: take_gpu_clear
UPDATE gpu_clears SET taken_at = %(now)s WHERE id = %(id)s AND taken_at IS NULL;

-- name: lock_footprint
SELECT bytes FROM footprints WHERE type = %(type)s FOR UPDATE;

-- name: raise_footprint
INSERT INTO footprints (type, bytes, job_id, updated_at)
VALUES (%(type)s, %(bytes)s, %(job_id)s, %(now)s)
ON CONFLICT (type) DO UPDATE
   SET bytes = excluded.bytes, job_id = excluded.job_id, updated_at = excluded.updated_at
 WHERE excluded.bytes > footprints.bytes;

-- name: get_idempotency
SELECT * FROM idempotency WHERE token_id = %(token_id)s AND key = %(key)s;

-- name: insert_idempotency
INSERT INTO idempotency (token_id, key, body_hash, job_ids, created_at)
VALUES (%(token_id)s, %(key)s, %(body_hash)s, %(job_ids)s, %(now)s);

-- name: insert_token
INSERT INTO tokens (id, name, role, secret_hash, created_at, created_by, expires_at, node,
                    replace_node)
VALUES (%(id)s, %(name)s, %(role)s, %(secret_hash)s, %(now)s, %(created_by)s,
        %(expires_at)s, %(node)s, %(replace_node)s)
RETURNING *;

-- name: lock_invites
-- the invites of one node are made one at a time (with revoke_invites, one stays live)
SELECT pg_advisory_xact_lock(hashtextextended('gpuwarden invites of ' || %(node)s, 0));

-- name: revoke_invites
-- a node's live enrolment tokens, before a new one is made (one live invite a node;
-- the unique index tokens_one_live_invite holds it)
UPDATE tokens SET revoked_at = %(now)s
WHERE role = 'enroll' AND node = %(node)s AND revoked_at IS NULL;

-- name: get_token
SELECT * FROM tokens WHERE id = %(id)s;

-- name: list_tokens
SELECT * FROM tokens ORDER BY created_at, id;

-- name: revoke_token
UPDATE tokens SET revoked_at = %(now)s WHERE id = %(id)s AND revoked_at IS NULL;

-- name: insert_audit
INSERT INTO audit (ts, actor, actor_name, role, action, target, outcome, detail)
VALUES (%(ts)s, %(actor)s, %(actor_name)s, %(role)s, %(action)s, %(target)s, %(outcome)s,
        %(detail)s)
RETURNING id;

-- name: insert_audit_locked
-- lock_log and insert_audit in one statement (see insert_event_locked)
WITH l AS MATERIALIZED (SELECT pg_advisory_xact_lock(%(key)s))
INSERT INTO audit (ts, actor, actor_name, role, action, target, outcome, detail)
SELECT %(ts)s::double precision, %(actor)s::text, %(actor_name)s::text, %(role)s::text,
       %(action)s::text, %(target)s::text, %(outcome)s::text, %(detail)s::jsonb
  FROM l
RETURNING id;

-- name: audit_rows
SELECT * FROM audit WHERE id > %(after_id)s ORDER BY id LIMIT %(limit)s;

-- name: schema_version
SELECT COALESCE(MAX(version), 0) AS v FROM schema_migrations;

-- name: insert_dep
INSERT INTO job_deps (job_id, kind, dep_id) VALUES (%(job_id)s, %(kind)s, %(dep_id)s);

-- name: lock_job_states
-- the stored jobs of a submission's dependencies, locked (in id order) so that none
-- of them ends, and looks for its dependents, before the submission commits
SELECT id, state FROM jobs WHERE id = ANY(%(ids)s::text[]) ORDER BY id FOR UPDATE;

-- name: lock_dependents
-- the held jobs that name this one, locked: what its end may release or fail
SELECT j.id FROM job_deps d JOIN jobs j ON j.id = d.job_id
 WHERE d.dep_id = %(id)s AND j.state = 'queued' AND j.held
 ORDER BY j.seq
 FOR UPDATE OF j;

-- name: deps_of
SELECT d.kind, d.dep_id, j.state FROM job_deps d JOIN jobs j ON j.id = d.dep_id
 WHERE d.job_id = %(id)s
 ORDER BY d.dep_id, d.kind;

-- name: release_job
UPDATE jobs SET held = FALSE, updated_at = %(now)s
 WHERE id = %(id)s AND state = 'queued' AND held;

-- name: held_jobs
SELECT id FROM jobs WHERE held AND state = 'queued' ORDER BY seq;

-- name: set_job_ram
UPDATE jobs SET ram_cap_bytes = %(cap)s, ram_floor_bytes = %(floor)s, ram_start_min_bytes = %(start_min)s
 WHERE id = %(id)s;

-- name: set_job_service
UPDATE jobs SET service = %(service)s, share = %(share)s WHERE id = %(id)s;

-- name: mark_stop_requested
UPDATE jobs SET stop_requested_by = %(by)s, updated_at = %(now)s
 WHERE id = %(id)s AND state = 'running' AND stop_requested_by IS NULL;

-- name: set_job_gpus
UPDATE jobs SET gpus = %(gpus)s WHERE id = %(id)s;

-- name: set_job_est_s
UPDATE jobs SET est_s = %(est_s)s WHERE id = %(id)s;

-- name: type_profiles
SELECT * FROM type_profiles ORDER BY type;

-- name: set_attempt_ram_peak
UPDATE attempts SET ram_peak_bytes = %(bytes)s
 WHERE job_id = %(job_id)s AND number = %(number)s;

-- name: raise_ram_peak
INSERT INTO type_profiles (type, ram_peak_bytes, job_id, updated_at)
VALUES (%(type)s, %(bytes)s, %(job_id)s, %(now)s)
ON CONFLICT (type) DO UPDATE
   SET ram_peak_bytes = excluded.ram_peak_bytes, job_id = excluded.job_id,
       updated_at = excluded.updated_at
 WHERE excluded.ram_peak_bytes > type_profiles.ram_peak_bytes;

-- name: fair_share
SELECT owner, gib_h, as_of FROM fair_share ORDER BY owner;

-- name: lock_fair_share
SELECT gib_h, as_of FROM fair_share WHERE owner = %(owner)s FOR UPDATE;

-- name: put_fair_share
INSERT INTO fair_share (owner, gib_h, as_of) VALUES (%(owner)s, %(gib_h)s, %(as_of)s)
ON CONFLICT (owner) DO UPDATE SET gib_h = excluded.gib_h, as_of = excluded.as_of;

-- name: owner_counts
-- fair share (`gpuwarden share`): each owner's queued and running jobs
SELECT owner, state, COUNT(*) AS n FROM jobs
 WHERE state IN ('queued', 'running') GROUP BY owner, state;

-- name: latch_gpu_fault
-- at most one open latch per node and GPU (the partial unique index backs it up)
INSERT INTO gpu_faults (node, gpu_uuid, xid, reason, latched_at)
SELECT %(node)s::text, %(gpu_uuid)s::text, %(xid)s::integer, %(reason)s::text, %(now)s::double precision
 WHERE NOT EXISTS (SELECT 1 FROM gpu_faults
                    WHERE node = %(node)s AND gpu_uuid = %(gpu_uuid)s AND cleared_at IS NULL);

-- name: clear_gpu_fault
UPDATE gpu_faults SET cleared_at = %(now)s, cleared_by = %(by)s, clear_reason = %(reason)s
 WHERE node = %(node)s AND gpu_uuid = %(gpu_uuid)s AND cleared_at IS NULL;

-- name: gpu_faults
SELECT id, node, gpu_uuid, xid, reason, latched_at, cleared_at, cleared_by, clear_reason
  FROM gpu_faults
 WHERE (%(node)s::text IS NULL OR node = %(node)s)
   AND (%(gpu_uuid)s::text IS NULL OR gpu_uuid = %(gpu_uuid)s)
   AND (%(open_only)s::integer = 0 OR cleared_at IS NULL)
 ORDER BY id;

-- name: set_job_source
UPDATE jobs SET source_repo = %(repo)s, source_commit = %(commit)s WHERE id = %(id)s;

-- name: set_job_command
UPDATE jobs SET command = %(command)s WHERE id = %(id)s;

-- Job control (migration 0020; SPEC.md section 1, "Job control")

-- name: hold_job
UPDATE jobs SET hold_by = %(by)s, updated_at = %(now)s
 WHERE id = %(id)s AND state = 'queued' AND hold_by IS NULL;

-- name: release_hold
UPDATE jobs SET hold_by = NULL, updated_at = %(now)s
 WHERE id = %(id)s AND state = 'queued' AND hold_by IS NOT NULL;

-- name: requeue_job
-- back to the queue, same id and spec; what its end recorded is cleared here and kept
-- in its `requeued` event; its retries count from the attempt after requeued_after
UPDATE jobs
   SET state = 'queued', updated_at = %(now)s, reason = %(reason)s, exit_code = NULL,
       result = '{}'::jsonb, cancel_requested = FALSE, stop_requested_by = NULL,
       held = %(held)s, hold_by = NULL, requeued_after = attempts
 WHERE id = %(id)s AND state = ANY(%(sources)s::text[]);

-- name: set_priority
UPDATE jobs SET priority = %(priority)s, updated_at = %(now)s
 WHERE id = %(id)s AND state = 'queued';

-- name: live_lease_node
-- the node a queued job is leased to, if its lease is live (a hold must wait for it)
SELECT node FROM leases WHERE job_id = %(id)s AND expires_at > %(now)s;
