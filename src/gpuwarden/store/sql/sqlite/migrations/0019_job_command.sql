-- Command jobs (SPEC.md, "Command jobs"): a command job's command (argv, working
-- directory, environment, the user it runs as) as JSON; NULL: a job of a module's
-- type. Mirrors the other dialect's 0019_job_command.sql.

ALTER TABLE jobs ADD COLUMN command TEXT;
