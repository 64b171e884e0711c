"""The HTTP API: tokens and roles (``auth``), limits (``limits``), the app (``app``)."""

from gpuwarden.api.app import create_app

__all__ = ["create_app"]
