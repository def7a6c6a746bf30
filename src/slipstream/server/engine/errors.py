"""Why the engine refuses a request, as data: the field (``param``) and an OpenAI-style ``code``.

The API layer turns these into 400s without reading the message; the message is for people.
"""
from __future__ import annotations


class InvalidRequest(ValueError):
    """A request the engine will not queue.

    Args:
        message: what was wrong and what to do.
        param: the offending field in the API's terms (``prompt``, ``max_tokens``, ``logit_bias``, ...).
        code: machine-readable reason where one helps (``context_length_exceeded``), else None.
    """

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


class RequestRejected(InvalidRequest):
    """A request that can never run (too long for the model or the cache).

    ``code`` is OpenAI-style (``context_length_exceeded``), ``param`` the offending field.
    """

    def __init__(self, message: str, code: str, param: str | None = None):
        super().__init__(message, param, code)
