"""A request aiohttp's parser refuses (a malformed Content-Length) is answered 400 by aiohttp
and logged in one WARNING line, without a traceback, once ``configure_logging`` (what
``slipstream serve`` and ``slipstream gateway`` call) has installed the filter."""
from __future__ import annotations

import asyncio
import logging
import sys

import pytest

from gateway_helpers import running_gateway
from slipstream.server.cli import configure_logging
from slipstream.server.parse_errors import LOGGER, OneLineParseErrors


@pytest.fixture
def one_line_parse_errors():
    logger = logging.getLogger(LOGGER)
    before = list(logger.filters)
    configure_logging("INFO")
    configure_logging("INFO")  # twice: still one filter
    assert sum(isinstance(f, OneLineParseErrors) for f in logger.filters) == 1
    yield
    logger.filters[:] = before


@pytest.mark.parametrize("header, reason", [
    (b"Content-Length: abc\r\n", "Invalid character in Content-Length"),
    (b"Content-Length: -1\r\n", "Invalid character in Content-Length"),
    (b"Content-Length: 2\r\nContent-Length: 3\r\n", "Duplicate Content-Length"),
])
async def test_a_malformed_content_length_is_a_400_logged_in_one_line(one_line_parse_errors, caplog, header, reason):
    caplog.set_level(logging.INFO, logger=LOGGER)
    async with running_gateway() as (url, _):
        host, port = url.removeprefix("http://").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" + header + b"\r\n{}")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        writer.close()
    assert head.split(b"\r\n")[0].endswith(b"400 Bad Request"), head
    records = [r for r in caplog.records if r.name == LOGGER]
    assert len(records) == 1, [r.getMessage() for r in records]
    record = records[0]
    assert (record.levelname, record.exc_info, record.exc_text) == ("WARNING", None, None)
    assert record.getMessage() == f"Error handling request from 127.0.0.1: {reason} (answered 400)"


def test_other_errors_on_that_logger_keep_their_level_and_traceback():
    try:
        raise RuntimeError("a handler failed")
    except RuntimeError:
        record = logging.LogRecord(LOGGER, logging.ERROR, __file__, 1, "Error handling request from %s",
                                   ("127.0.0.1",), exc_info=sys.exc_info())
    assert OneLineParseErrors().filter(record)
    assert record.levelname == "ERROR" and record.exc_info is not None
