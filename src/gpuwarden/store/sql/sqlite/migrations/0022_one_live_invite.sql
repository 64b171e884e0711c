-- Invites (SPEC.md section 16, "Enrolment"): one live enrolment token a node name,
-- and whether it may enrol a host in the place of a node that is enrolled and not
-- revoked (`gpuwarden node invite NAME --replace`). Of the live enrolment tokens of a
-- node made before this, the newest stands; the others are revoked now. Mirrors
-- sql/postgres/migrations/0022_one_live_invite.sql.

ALTER TABLE tokens ADD COLUMN replace_node INTEGER NOT NULL DEFAULT 0;

UPDATE tokens SET revoked_at = (julianday('now') - 2440587.5) * 86400.0
WHERE role = 'enroll' AND node IS NOT NULL AND revoked_at IS NULL
  AND EXISTS (
      SELECT 1 FROM tokens AS newer
      WHERE newer.role = 'enroll' AND newer.node = tokens.node
        AND newer.revoked_at IS NULL
        AND (newer.created_at > tokens.created_at
             OR (newer.created_at = tokens.created_at AND newer.id > tokens.id))
  );

CREATE UNIQUE INDEX tokens_one_live_invite ON tokens (node)
WHERE role = 'enroll' AND revoked_at IS NULL;
