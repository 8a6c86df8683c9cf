"""Why an engine could not do a job, as exceptions a caller can act on (the HTTP face maps them to
statuses: http_errors.http_error)."""
from __future__ import annotations


class EngineError(Exception):
    """A job that could not be done, for a reason a caller can act on."""
    retry_after_s: float | None = None

    def __init__(self, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.message, self.retry_after_s = message, retry_after_s


class Overloaded(EngineError):
    """The queue is full: retry later."""


class Unavailable(EngineError):
    """Failed to load, or shutting down."""


class Loading(Unavailable):
    """Still loading: retry shortly."""


class DeadlineExceeded(EngineError):
    """The job did not finish before its deadline."""


class Cancelled(EngineError):
    """The job was cancelled by its submitter."""


class ModelFailure(EngineError):
    """The model raised while running a job: a bug, not the caller's fault."""
