"""The error of an InferenceService spec that cannot be served (shared by spec.py and
model_spec.py)."""
from __future__ import annotations


class SpecError(ValueError):
    """An InferenceService that cannot be served as written.

    ``reason`` is a CamelCase word for the condition and the Event; the message says what was
    wrong and what to do. Retrying does not help: the user has to change the object.
    """

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message
