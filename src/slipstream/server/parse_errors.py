"""Requests that aiohttp's HTTP parser refuses: logged as one line each, and a body it cannot
read answered as a 400.

A malformed request line or header (a non-numeric or negative ``Content-Length``, two of them, a
header line too long) is answered by aiohttp itself with a plain-text 400 before any middleware
or handler runs, and logged on ``aiohttp.server`` at ERROR with the parser's traceback: one
client could fill the server's and the gateway's logs with tracebacks of its own making.
:class:`OneLineParseErrors` turns each such record into one WARNING line that names the client
and the parser's reason (its first line only: the rest quotes the client's bytes). Other errors
on that logger keep their level and traceback.

A body aiohttp cannot decode (a ``Content-Encoding: gzip`` body that is not gzip, a malformed
chunk) is found only when a handler reads it, as ``web.RequestPayloadError``: the server's and
the gateway's error middlewares answer it with an OpenAI-shaped 400 whose message is
:func:`payload_error_message`, instead of a 500 and two tracebacks.
"""
from __future__ import annotations

import logging

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage

LOGGER = "aiohttp.server"
PAYLOAD_ERROR_CODE = "invalid_request_body"  # the 400's error code for a body aiohttp could not read


def first_reason(message: str) -> str:
    """The first line of an aiohttp parser message, without its ``NNN, message:`` lead, a
    trailing colon, or the client's bytes it quotes (``b'...'``)."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if lines and lines[0].endswith("message:"):
        lines = lines[1:]
    reason = lines[0] if lines else "malformed request"
    for quote in ("b'", 'b"'):
        reason = reason.split(quote, 1)[0]
    return reason.strip().rstrip(":").strip() or "malformed request"


def payload_error_message(exc: web.RequestPayloadError) -> str:
    """The 400's message for a request body aiohttp could not read."""
    return f"The request body could not be read: {first_reason(str(exc))}."


class OneLineParseErrors(logging.Filter):
    """A filter for :data:`LOGGER`: a record carrying a ``BadHttpMessage`` (aiohttp's 400 for a
    request it cannot parse) becomes ``WARNING "<aiohttp's message>: <reason> (answered 400)"``
    without the traceback; one carrying a ``RequestPayloadError`` (a body already refused by the
    error middleware, read again as aiohttp discards it) a DEBUG line."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, web.RequestPayloadError):
            # The same unreadable body met again while aiohttp discards the rest of it, after the
            # error middleware answered 400 and logged it: one line, at DEBUG only.
            _one_line(record, logging.DEBUG, f"{first_reason(str(exc))} (already answered 400)")
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        if isinstance(exc, BadHttpMessage):
            reason = first_reason(exc.message or type(exc).__name__)
            _one_line(record, logging.WARNING, f"{reason} (answered {exc.code})")
        return True


def _one_line(record: logging.LogRecord, level: int, reason: str) -> None:
    """Rewrite ``record`` as ``"<its message>: <reason>"`` at ``level``, without its traceback."""
    record.msg, record.args = "%s: %s", (record.getMessage(), reason)
    record.levelno, record.levelname = level, logging.getLevelName(level)
    record.exc_info = record.exc_text = None


def log_parse_errors_as_one_line() -> None:
    """Install :class:`OneLineParseErrors` on :data:`LOGGER` (once)."""
    logger = logging.getLogger(LOGGER)
    if not any(isinstance(f, OneLineParseErrors) for f in logger.filters):
        logger.addFilter(OneLineParseErrors())
