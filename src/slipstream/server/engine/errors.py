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

    def renamed(self, param: str) -> InvalidRequest:
        """The same refusal reported under the caller's name for the field (an API maps
        ``SamplingParams.logprobs`` to chat's ``top_logprobs``)."""
        return InvalidRequest(str(self), param, self.code)


class OutOfRange(InvalidRequest):
    """A value outside its field's range, as data: the field, what it must be, what it was.

    Args:
        param: the field (``temperature``).
        requirement: the rule, phrased to follow the field's name (``must be in [0, 2]``).
        value: the value given.
    """

    def __init__(self, param: str, requirement: str, value: object):
        super().__init__(f"{param} {requirement}, got {value}", param)
        self.requirement = requirement
        self.value = value

    def renamed(self, param: str) -> OutOfRange:
        return OutOfRange(param, self.requirement, self.value)


class RequestRejected(InvalidRequest):
    """A request that can never run (too long for the model or the cache).

    ``code`` is OpenAI-style (``context_length_exceeded``), ``param`` the offending field.
    """

    def __init__(self, message: str, code: str, param: str | None = None):
        super().__init__(message, param, code)
