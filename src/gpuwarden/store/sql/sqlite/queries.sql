-- Named queries for the SQLite store. Each block starts with "-- name: NAME".
-- A query named lock_* is a plain read here: a writer holds SQLite's one write lock
-- (BEGIN IMMEDIATE) from its first statement, so no other writer can change the row.

-- name: next_seq
SELECT COALESCE(MAX(seq), 0) + 1 FROM jobs;

-- name: insert_job
INSERT INTO jobs (id, seq, type, state, priority, params, inputs, outputs, vram_bytes,
                  spec_hash, submitted_at, updated_at, bundle, queue_root, input_dir, owner,
                  constraints, depends_on, held)
VALUES (:id, :seq, :type, 'queued', :priority, :params, :inputs, :outputs, :vram_bytes,
        :spec_hash, :now, :now, :bundle, :queue_root, :input_dir, :owner, :constraints,
        :depends_on, :held);

-- name: job_ids_existing
SELECT id FROM jobs WHERE id IN (SELECT value FROM json_each(:ids));

-- name: jobs_by_ids
SELECT * FROM jobs WHERE id IN (SELECT value FROM json_each(:ids)) ORDER BY seq;

-- name: get_job
SELECT * FROM jobs WHERE id = :id;

-- name: lock_job
SELECT * FROM jobs WHERE id = :id;

-- name: lock_job_to_start
SELECT * FROM jobs WHERE id = :id;

-- name: list_jobs
SELECT * FROM jobs ORDER BY seq DESC LIMIT :limit;

-- name: list_jobs_in_states
SELECT * FROM jobs WHERE state IN (SELECT value FROM json_each(:states))
ORDER BY seq DESC LIMIT :limit;

-- name: live_jobs_of_type
-- queued or running, newest first, by the index of 0021 (type, state, seq)
SELECT * FROM jobs WHERE type = :type AND state IN ('queued', 'running') ORDER BY seq DESC;

-- name: queued_jobs
SELECT * FROM jobs WHERE state = 'queued' ORDER BY priority DESC, seq LIMIT :limit;

-- name: terminal_count
SELECT count(*) AS n FROM jobs
 WHERE id IN (SELECT value FROM json_each(:ids))
   AND state IN ('done', 'failed', 'cancelled', 'quarantined');

-- name: queue_entries
-- the queued jobs that may be planned: not held for their dependencies, nor by a person
SELECT id, type, priority, seq, vram_bytes, cancel_requested, est_s, owner, gpus,
       ram_cap_bytes, ram_floor_bytes, ram_start_min_bytes, json_extract(constraints, '$.gpu') AS gpu_pin FROM jobs
 WHERE state = 'queued' AND held = 0 AND hold_by IS NULL;

-- name: queued_count
-- index-only counts (a held job is always queued: every transition clears held and
-- hold_by); the last reads the few jobs a person holds
SELECT (SELECT COUNT(*) FROM jobs WHERE state = 'queued')
     - (SELECT COUNT(*) FROM jobs WHERE held = 1)
     - (SELECT COUNT(*) FROM jobs WHERE hold_by IS NOT NULL AND held = 0) AS n;

-- name: queue_entries_of
SELECT id, type, priority, seq, vram_bytes, cancel_requested, est_s, owner, gpus,
       ram_cap_bytes, ram_floor_bytes, ram_start_min_bytes, json_extract(constraints, '$.gpu') AS gpu_pin FROM jobs
 WHERE state = 'queued' AND held = 0 AND hold_by IS NULL
   AND id IN (SELECT value FROM json_each(:ids));

-- name: running_jobs
SELECT * FROM jobs WHERE state = 'running' ORDER BY seq;

-- name: count_by_state
SELECT state, COUNT(*) AS n FROM jobs GROUP BY state;

-- name: transition_job
UPDATE jobs
   SET state = :target, updated_at = :now, reason = :reason,
       stop_requested_by = NULL,
       exit_code = COALESCE(:exit_code, exit_code),
       result = COALESCE(:result, result),
       cancel_requested = CASE WHEN :target = 'queued' THEN cancel_requested ELSE 0 END,
       held = 0, hold_by = NULL
 WHERE id = :id AND state IN (SELECT value FROM json_each(:sources));

-- name: start_job
UPDATE jobs SET state = 'running', updated_at = :now, attempts = attempts + 1, reason = ''
 WHERE id = :id AND state = 'queued' AND cancel_requested = 0 AND held = 0 AND hold_by IS NULL;

-- name: insert_attempt
INSERT INTO attempts (job_id, number, node, gpu_uuid, started_at)
VALUES (:job_id, :number, :node, :gpu_uuid, :now);

-- name: set_attempt_pid
UPDATE attempts SET pid = :pid WHERE job_id = :job_id AND number = :number;

-- name: finish_attempt
UPDATE attempts
   SET ended_at = :now, exit_code = :exit_code, outcome = :outcome, reason = :reason,
       stdout = :stdout, stderr = :stderr
 WHERE job_id = :job_id AND number = :number AND ended_at IS NULL
   AND number = (SELECT attempts FROM jobs WHERE id = :job_id AND state = 'running');

-- name: attempts
SELECT * FROM attempts WHERE job_id = :job_id ORDER BY number;

-- name: mark_cancel_requested
UPDATE jobs SET cancel_requested = 1, updated_at = :now
 WHERE id = :id AND state = 'running';

-- name: insert_event
INSERT INTO events (ts, kind, job_id, from_state, to_state, detail)
VALUES (:ts, :kind, :job_id, :from_state, :to_state, :detail);

-- name: last_event_id
SELECT COALESCE(MAX(id), 0) AS id FROM events;

-- name: events_all
SELECT * FROM events WHERE id > :after_id ORDER BY id LIMIT :limit;

-- name: events_for_job
SELECT * FROM events WHERE job_id = :job_id AND id > :after_id ORDER BY id LIMIT :limit;

-- name: insert_bundle
INSERT INTO bundles (queue_root, name, job_ids, received_at)
VALUES (:queue_root, :name, :job_ids, :now);

-- name: insert_rejected_bundle
INSERT INTO bundles (queue_root, name, job_ids, received_at, finished_at, outcome, result_path)
VALUES (:queue_root, :name, '[]', :now, :now, 'rejected', :result_path)
ON CONFLICT (queue_root, name) DO NOTHING;

-- name: get_bundle
SELECT * FROM bundles WHERE queue_root = :queue_root AND name = :name;

-- name: open_bundles
SELECT * FROM bundles WHERE finished_at IS NULL ORDER BY received_at, name;

-- name: finish_bundle
UPDATE bundles SET finished_at = :now, outcome = :outcome, result_path = :result_path
 WHERE queue_root = :queue_root AND name = :name;

-- name: put_node_status
INSERT INTO node_status (node, pid, updated_at, payload)
VALUES (:node, :pid, :updated_at, :payload)
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
 LIMIT :limit;

-- name: attempt_spans
SELECT a.job_id AS job_id, a.number AS number, a.gpu_uuid AS gpu_uuid,
       a.started_at AS started_at, a.ended_at AS ended_at, a.outcome AS outcome,
       j.type AS type, j.owner AS owner, j.submitted_at AS submitted_at
  FROM attempts a JOIN jobs j ON j.id = a.job_id
 WHERE a.ended_at IS NULL OR a.ended_at >= :since
 ORDER BY a.started_at DESC
 LIMIT :limit;

-- name: request_gpu_clear
INSERT INTO gpu_clears (gpu_uuid, requested_at, requested_by, reason)
VALUES (:gpu_uuid, :now, :by, :reason);

-- name: pending_gpu_clears
SELECT id, gpu_uuid, requested_by, reason FROM gpu_clears WHERE taken_at IS NULL ORDER BY id;

-- name: take_gpu_clear
UPDATE gpu_clears SET taken_at = :now WHERE id = :id AND taken_at IS NULL;

-- name: lock_footprint
SELECT bytes FROM footprints WHERE type = :type;

-- name: raise_footprint
INSERT INTO footprints (type, bytes, job_id, updated_at)
VALUES (:type, :bytes, :job_id, :now)
ON CONFLICT (type) DO UPDATE
   SET bytes = excluded.bytes, job_id = excluded.job_id, updated_at = excluded.updated_at
 WHERE excluded.bytes > footprints.bytes;

-- name: list_jobs_of_owner
SELECT * FROM jobs WHERE owner = :owner ORDER BY seq DESC LIMIT :limit;

-- name: list_jobs_of_owner_in_states
SELECT * FROM jobs
 WHERE owner = :owner AND state IN (SELECT value FROM json_each(:states))
 ORDER BY seq DESC LIMIT :limit;

-- name: get_idempotency
SELECT * FROM idempotency WHERE token_id = :token_id AND key = :key;

-- name: insert_idempotency
INSERT INTO idempotency (token_id, key, body_hash, job_ids, created_at)
VALUES (:token_id, :key, :body_hash, :job_ids, :now);

-- name: insert_token
INSERT INTO tokens (id, name, role, secret_hash, created_at, created_by, expires_at, node,
                    replace_node)
VALUES (:id, :name, :role, :secret_hash, :now, :created_by, :expires_at, :node,
        :replace_node);

-- name: lock_invites
-- the invites of one node are made one at a time: a writer holds the database already
SELECT 1;

-- name: revoke_invites
-- a node's live enrolment tokens, before a new one is made (one live invite a node;
-- the unique index tokens_one_live_invite holds it)
UPDATE tokens SET revoked_at = :now
WHERE role = 'enroll' AND node = :node AND revoked_at IS NULL;

-- name: get_token
SELECT * FROM tokens WHERE id = :id;

-- name: list_tokens
SELECT * FROM tokens ORDER BY created_at, id;

-- name: revoke_token
UPDATE tokens SET revoked_at = :now WHERE id = :id AND revoked_at IS NULL;

-- name: insert_audit
INSERT INTO audit (ts, actor, actor_name, role, action, target, outcome, detail)
VALUES (:ts, :actor, :actor_name, :role, :action, :target, :outcome, :detail);

-- name: audit_rows
SELECT * FROM audit WHERE id > :after_id ORDER BY id LIMIT :limit;

-- name: schema_version
SELECT COALESCE(MAX(version), 0) AS v FROM schema_migrations;

-- name: insert_dep
INSERT INTO job_deps (job_id, kind, dep_id) VALUES (:job_id, :kind, :dep_id);

-- name: lock_job_states
-- the stored jobs of a submission's dependencies (a plain read: see the top)
SELECT id, state FROM jobs WHERE id IN (SELECT value FROM json_each(:ids)) ORDER BY id;

-- name: lock_dependents
-- the held jobs that name this one: what its end may release or fail
SELECT j.id FROM job_deps d JOIN jobs j ON j.id = d.job_id
 WHERE d.dep_id = :id AND j.state = 'queued' AND j.held = 1
 ORDER BY j.seq;

-- name: deps_of
SELECT d.kind, d.dep_id, j.state FROM job_deps d JOIN jobs j ON j.id = d.dep_id
 WHERE d.job_id = :id
 ORDER BY d.dep_id, d.kind;

-- name: release_job
UPDATE jobs SET held = 0, updated_at = :now WHERE id = :id AND state = 'queued' AND held = 1;

-- name: held_jobs
SELECT id FROM jobs WHERE held = 1 AND state = 'queued' ORDER BY seq;

-- name: set_job_ram
UPDATE jobs SET ram_cap_bytes = :cap, ram_floor_bytes = :floor, ram_start_min_bytes = :start_min
 WHERE id = :id;

-- name: set_job_service
UPDATE jobs SET service = :service, share = :share WHERE id = :id;

-- name: mark_stop_requested
UPDATE jobs SET stop_requested_by = :by, updated_at = :now
 WHERE id = :id AND state = 'running' AND stop_requested_by IS NULL;

-- name: set_job_gpus
UPDATE jobs SET gpus = :gpus WHERE id = :id;

-- name: set_job_est_s
UPDATE jobs SET est_s = :est_s WHERE id = :id;

-- name: type_profiles
SELECT * FROM type_profiles ORDER BY type;

-- name: set_attempt_ram_peak
UPDATE attempts SET ram_peak_bytes = :bytes
 WHERE job_id = :job_id AND number = :number;

-- name: raise_ram_peak
INSERT INTO type_profiles (type, ram_peak_bytes, job_id, updated_at)
VALUES (:type, :bytes, :job_id, :now)
ON CONFLICT (type) DO UPDATE
   SET ram_peak_bytes = excluded.ram_peak_bytes, job_id = excluded.job_id,
       updated_at = excluded.updated_at
 WHERE excluded.ram_peak_bytes > type_profiles.ram_peak_bytes;

-- name: fair_share
SELECT owner, gib_h, as_of FROM fair_share ORDER BY owner;

-- name: lock_fair_share
SELECT gib_h, as_of FROM fair_share WHERE owner = :owner;

-- name: put_fair_share
INSERT INTO fair_share (owner, gib_h, as_of) VALUES (:owner, :gib_h, :as_of)
ON CONFLICT (owner) DO UPDATE SET gib_h = excluded.gib_h, as_of = excluded.as_of;

-- name: owner_counts
-- fair share (`gpuwarden share`): each owner's queued and running jobs
SELECT owner, state, COUNT(*) AS n FROM jobs
 WHERE state IN ('queued', 'running') GROUP BY owner, state;

-- name: latch_gpu_fault
-- at most one open latch per node and GPU (the partial unique index backs it up)
INSERT INTO gpu_faults (node, gpu_uuid, xid, reason, latched_at)
SELECT :node, :gpu_uuid, :xid, :reason, :now
 WHERE NOT EXISTS (SELECT 1 FROM gpu_faults
                    WHERE node = :node AND gpu_uuid = :gpu_uuid AND cleared_at IS NULL);

-- name: clear_gpu_fault
UPDATE gpu_faults SET cleared_at = :now, cleared_by = :by, clear_reason = :reason
 WHERE node = :node AND gpu_uuid = :gpu_uuid AND cleared_at IS NULL;

-- name: gpu_faults
SELECT id, node, gpu_uuid, xid, reason, latched_at, cleared_at, cleared_by, clear_reason
  FROM gpu_faults
 WHERE (:node IS NULL OR node = :node)
   AND (:gpu_uuid IS NULL OR gpu_uuid = :gpu_uuid)
   AND (:open_only = 0 OR cleared_at IS NULL)
 ORDER BY id;

-- name: set_job_source
UPDATE jobs SET source_repo = :repo, source_commit = :commit WHERE id = :id;

-- name: set_job_command
UPDATE jobs SET command = :command WHERE id = :id;

-- Job control (migration 0020; SPEC.md section 1, "Job control")

-- name: hold_job
UPDATE jobs SET hold_by = :by, updated_at = :now
 WHERE id = :id AND state = 'queued' AND hold_by IS NULL;

-- name: release_hold
UPDATE jobs SET hold_by = NULL, updated_at = :now
 WHERE id = :id AND state = 'queued' AND hold_by IS NOT NULL;

-- name: requeue_job
-- back to the queue, same id and spec; what its end recorded is cleared here and kept
-- in its `requeued` event; its retries count from the attempt after requeued_after
UPDATE jobs
   SET state = 'queued', updated_at = :now, reason = :reason, exit_code = NULL,
       result = '{}', cancel_requested = 0, stop_requested_by = NULL, held = :held,
       hold_by = NULL, requeued_after = attempts
 WHERE id = :id AND state IN (SELECT value FROM json_each(:sources));

-- name: set_priority
UPDATE jobs SET priority = :priority, updated_at = :now WHERE id = :id AND state = 'queued';

-- name: live_lease_node
-- the node a queued job is leased to, if its lease is live (a hold must wait for it)
SELECT node FROM leases WHERE job_id = :id AND expires_at > :now;
