"""The HTTP API: tokens and roles (``auth``), limits (``limits``), the app (``app``).

Nothing is imported here: ``gpuwarden.api.auth`` is used by the CLI, which must
not pay for loading fastapi (``gpuwarden.api.app``) on every command."""
