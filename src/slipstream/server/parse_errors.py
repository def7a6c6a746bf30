"""Requests that aiohttp's HTTP parser refuses, logged as one line each.

A malformed request line or header (a non-numeric or negative ``Content-Length``, two of them, a
header line too long) is answered by aiohttp itself with a plain-text 400 before any middleware
or handler runs, and logged on ``aiohttp.server`` at ERROR with the parser's traceback: one
client could fill the server's and the gateway's logs with tracebacks of its own making.
:class:`OneLineParseErrors` turns each such record into one WARNING line that names the client
and the parser's reason (its first line only: the rest quotes the client's bytes). Other errors
on that logger keep their level and traceback.
"""
from __future__ import annotations

import logging

from aiohttp.http_exceptions import BadHttpMessage

LOGGER = "aiohttp.server"


class OneLineParseErrors(logging.Filter):
    """A filter for :data:`LOGGER`: a record carrying a ``BadHttpMessage`` (aiohttp's 400 for a
    request it cannot parse) becomes ``WARNING "<aiohttp's message>: <reason> (answered 400)"``
    without the traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, BadHttpMessage):
            reason = (exc.message or type(exc).__name__).strip().splitlines()[0].rstrip(":")
            record.msg, record.args = "%s: %s (answered %d)", (record.getMessage(), reason, exc.code)
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.exc_info = record.exc_text = None
        return True


def log_parse_errors_as_one_line() -> None:
    """Install :class:`OneLineParseErrors` on :data:`LOGGER` (once)."""
    logger = logging.getLogger(LOGGER)
    if not any(isinstance(f, OneLineParseErrors) for f in logger.filters):
        logger.addFilter(OneLineParseErrors())
