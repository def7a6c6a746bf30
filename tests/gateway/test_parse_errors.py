"""Requests aiohttp cannot read, at the gateway: one its parser refuses (a malformed
Content-Length) is answered 400 by aiohttp and logged in one WARNING line, without a traceback,
once ``configure_logging`` (what ``slipstream serve`` and ``slipstream gateway`` call) has
installed the filter; a body its Content-Encoding does not decode is a 400 in OpenAI's shape;
one it does decode reaches the pod decoded, without the header; a coding aiohttp does not decode
is a 415 that never reaches a pod."""
from __future__ import annotations

import asyncio
import gzip
import json
import logging
import sys
import zlib

import aiohttp
import pytest
from aiohttp import web

from gateway_helpers import MODEL, chat, fake_pod, raw_post, running_gateway
from slipstream.server.cli import configure_logging
from slipstream.server.content_coding import DECODED_CODINGS
from slipstream.server.parse_errors import LOGGER, OneLineParseErrors, first_reason


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
        reader, writer = await raw_post(url, header, b"{}")
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


def test_the_reason_keeps_no_client_bytes():
    assert first_reason("Got more than 8190 bytes when reading: b'aaaa'.") == "Got more than 8190 bytes when reading"
    assert first_reason("400, message:\n  Can not decode content-encoding: gzip") == \
        "Can not decode content-encoding: gzip"
    assert first_reason("") == "malformed request"


async def echo(request: web.Request) -> web.Response:
    """A pod that answers a POST with what it received: the Content-Encoding header and the JSON
    body (and has no KV-event stream)."""
    if request.method != "POST":
        raise web.HTTPNotFound()
    return web.json_response({"id": "x", "object": "chat.completion", "created": 0, "model": MODEL,
                              "choices": [], "received": await request.json(),
                              "encoding": request.headers.get("Content-Encoding")})


@pytest.mark.parametrize("encoding, compress", [("gzip", gzip.compress), ("deflate", zlib.compress)])
async def test_a_compressed_body_reaches_the_pod_decoded(encoding, compress):
    async with fake_pod("127.0.0.44", echo) as pod, running_gateway(endpoints=(pod,)) as (url, _), \
            aiohttp.ClientSession() as session:
        body = chat("hello")
        async with session.post(url + "/v1/chat/completions", data=compress(json.dumps(body).encode()),
                                headers={"Content-Encoding": encoding, "Content-Type": "application/json"}) as r:
            assert r.status == 200, await r.text()
            answer = await r.json()
    assert (answer["received"], answer["encoding"]) == (body, None)


async def test_a_body_its_content_encoding_does_not_decode_is_a_400_logged_in_one_line(one_line_parse_errors,
                                                                                      caplog):
    caplog.set_level(logging.INFO)
    async with fake_pod("127.0.0.44", echo) as pod, running_gateway(endpoints=(pod,)) as (url, _), \
            aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/chat/completions", data=json.dumps(chat("hello")).encode(),
                                headers={"Content-Encoding": "gzip", "Content-Type": "application/json"}) as r:
            assert r.status == 400
            assert r.headers["Connection"] == "close"  # aiohttp drops the connection after it
            error = (await r.json())["error"]
    assert error["code"] == "invalid_request_body"
    assert error["message"] == "The request body could not be read: Can not decode content-encoding: gzip."
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert any("-> 400 The request body could not be read" in r.getMessage() for r in caplog.records)


async def test_a_content_encoding_not_decoded_here_is_a_415_and_never_reaches_a_pod(caplog):
    caplog.set_level(logging.INFO)
    received = []

    async def pod_app(request: web.Request) -> web.Response:
        received.append(request.path)
        return await echo(request)

    async with fake_pod("127.0.0.44", pod_app) as pod, running_gateway(endpoints=(pod,)) as (url, _), \
            aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/chat/completions", data=json.dumps(chat("hello")).encode(),
                                headers={"Content-Encoding": "compress", "Content-Type": "application/json",
                                         "X-Request-Id": "r-415"}) as r:
            assert r.status == 415
            assert (r.headers["Accept-Encoding"], r.headers["X-Request-Id"]) == (", ".join(DECODED_CODINGS), "r-415")
            error = (await r.json())["error"]
        # a request without a body passes whatever it declares
        async with session.get(url + "/v1/models", headers={"Content-Encoding": "compress"}) as r:
            assert r.status != 415
    assert (error["code"], error["type"]) == ("unsupported_content_encoding", "invalid_request_error")
    assert error["message"] == ("Content-Encoding 'compress' is not accepted: send the body uncompressed or in one "
                                f"of {', '.join(DECODED_CODINGS)}.")
    assert "/v1/chat/completions" not in received
    assert any("-> 415 Content-Encoding 'compress'" in r.getMessage() for r in caplog.records)
