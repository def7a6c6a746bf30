"""OpenAI's error body, ``{"error": {message, type, param, code}}``, with the ``type`` each HTTP
status gets: one table for the server (:mod:`.api.errors`) and the gateway, which imports
nothing of the server's API or engine."""
from __future__ import annotations

# HTTP status -> OpenAI's error ``type``.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict:
    """The body for ``status``; a status not in the table is a ``server_error`` from 500 up, an
    ``invalid_request_error`` below."""
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error" if status >= 500
                                                             else "invalid_request_error"),
                      "param": param, "code": code}}
