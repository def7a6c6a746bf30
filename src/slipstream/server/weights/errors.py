"""The loader's error, in a module of its own so that what only fetches weights (``slipstream
download``, :mod:`.fetch`) imports no torch."""
from __future__ import annotations


class ModelLoadError(ValueError):
    """The model could not be loaded; the message names the file and the problem."""


REASONS = ("Unauthorized", "GatedRepo", "NotFound", "RevisionNotFound", "Unreachable", "RateLimited", "InvalidURI",
           "InvalidEndpoint", "NotCached", "ChecksumMismatch", "CacheNotWritable", "Interrupted", "Unexpected")


class ModelSourceError(ModelLoadError):
    """A model could not be fetched. ``status``: the HTTP status (None without one); ``reason``: one
    of :data:`REASONS`, what the operator puts in the InferenceService's condition;
    ``retry_after``: seconds the server asked to wait before trying again (a 429's
    ``Retry-After``), or None."""

    def __init__(self, message: str, *, reason: str, status: int | None = None, retry_after: float | None = None):
        super().__init__(message)
        self.reason, self.status, self.retry_after = reason, status, retry_after
