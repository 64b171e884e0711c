"""One error hierarchy for gpuwarden.

Every class's docstring is its default message. Errors that reach a person say
what was wrong and, where it helps, what to do; the CLI prints them without a
traceback.
"""

from __future__ import annotations


class GpuwardenError(Exception):
    """Something went wrong in gpuwarden."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())

    @property
    def message(self) -> str:
        return str(self.args[0])


class UserError(GpuwardenError):
    """The request was not valid. A user's mistake: printed without a traceback."""


class ConfigError(UserError):
    """The configuration is not valid."""


class ModuleError(UserError):
    """A module's module.toml is not valid."""


class ValidationError(UserError):
    """A job's specification is not valid."""


class BundleError(UserError):
    """A bundle could not be read."""


class QueueRootError(UserError):
    """A queue root is missing or not writable."""


class UnknownJobError(UserError):
    """No job with that id."""


class JobControlError(UserError):
    """The job is not in a state where this can be done to it."""


class NotAllowedError(UserError):
    """The caller's role may not ask for this value (HTTP 403)."""


class StateDirLockedError(UserError):
    """Another broker already owns this state directory."""


class StoreUnavailable(GpuwardenError):
    """The store cannot be reached now (its database server is down, restarting or
    unreachable): the same request may succeed later."""

    def __init__(
        self, message: str | None = None, *, retry_after_s: float = 2.0, detail: str = ""
    ) -> None:
        super().__init__(message)
        #: how long a client should wait before it tries again (seconds)
        self.retry_after_s = retry_after_s
        #: what the server's log is told (where the store is, the driver's words)
        self.detail = detail


class TransitionError(GpuwardenError):
    """A job state change that the transition table forbids, or that lost a race."""


class GpuProbeError(GpuwardenError):
    """The GPU probe could not read the devices."""


class SimOutOfMemoryError(GpuwardenError):
    """CUDA out of memory (simulated GPU)."""
