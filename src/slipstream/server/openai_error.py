"""OpenAI's error body, ``{"error": {message, type, param, code}}``, with the ``type`` each HTTP
status gets, and the words for aiohttp's refusals of a request body: one place for the server
(:mod:`.api.errors`) and the gateway, which imports nothing of the server's API or engine."""
from __future__ import annotations

from aiohttp import hdrs, web

from .content_coding import UNSUPPORTED_CODING_CODE
from .request_size import TOO_LARGE_CODE, too_large_message

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


def http_error_parts(exc: web.HTTPException) -> tuple[str, str | None, dict[str, str]]:
    """The message, error code and headers to answer one of aiohttp's HTTP errors with: a 413 in
    :func:`~.request_size.too_large_message`'s words, a 415 (:mod:`.content_coding`) with its
    ``Accept-Encoding``; any other in its own text, without a code. The headers are a new dict."""
    if exc.status == 413:
        return too_large_message(exc), TOO_LARGE_CODE, {}
    if exc.status == 415:
        accepted = exc.headers[hdrs.ACCEPT_ENCODING]
        return exc.text or exc.reason, UNSUPPORTED_CODING_CODE, {hdrs.ACCEPT_ENCODING: accepted}
    return exc.text or exc.reason, None, {}
