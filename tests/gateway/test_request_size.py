"""The gateway's request-body limit (``--max-request-bytes``): a body past it, and a
``Content-Length`` that declares one, get a 413 in OpenAI's shape; the declared one at once,
before the gateway waits for a body that may never come."""
from __future__ import annotations

import asyncio
import json
import logging

import aiohttp

from gateway_helpers import chat, raw_post, running_gateway

LIMIT = 4096


async def test_a_body_past_the_limit_is_a_413_and_logged(caplog):
    caplog.set_level(logging.INFO, logger="slipstream.gateway")
    async with running_gateway(max_request_bytes=LIMIT) as (url, _), aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/chat/completions", json=chat("x" * 2 * LIMIT)) as response:
            assert response.status == 413
            error = (await response.json())["error"]
    assert error["code"] == "request_too_large"
    # the server's words for the same limit (request_size.too_large_message), not aiohttp's bare text
    assert error["message"].startswith("Request body too large: ") and error["message"].endswith(
        ". Send a smaller request."), error["message"]
    assert any(r.getMessage().startswith("POST /v1/chat/completions -> 413 ") for r in caplog.records)


async def test_a_declared_body_past_the_limit_is_a_413_before_the_body_is_read():
    async with running_gateway(max_request_bytes=LIMIT) as (url, _):
        reader, writer = await raw_post(url, b"Content-Length: 999999999999\r\n", b"{}")
        # Read first, the gateway would wait for the rest of the body: the wait_for would time out.
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:")))
        body = await asyncio.wait_for(reader.readexactly(length), 10)
        writer.close()
        assert head.startswith(b"HTTP/1.1 413"), head
        error = json.loads(body)["error"]
        assert error["code"] == "request_too_large"
        assert error["message"] == (f"Request body too large: Content-Length 999999999999 exceeds the limit of "
                                    f"{LIMIT} bytes. Send a smaller request.")


async def test_expect_100_continue_past_the_limit_gets_the_413_instead():
    async with running_gateway(max_request_bytes=LIMIT) as (url, _):
        reader, writer = await raw_post(url, b"Expect: 100-continue\r\nContent-Length: %d\r\n" % (LIMIT + 1))
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        writer.close()
        assert head.startswith(b"HTTP/1.1 413"), head
