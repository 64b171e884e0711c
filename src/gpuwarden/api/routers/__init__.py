"""One router per concern: ``jobs`` (clients' jobs), ``admin`` (tokens and the
audit log), ``status`` (node status, job types, health). Node and agent endpoints
go in a router of their own (``nodes``), included in ``gpuwarden.api.app``; each
of its routes names an action that has a row in ``gpuwarden.api.auth.MATRIX``."""
