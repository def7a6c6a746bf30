"""Many clients at once, some of them leaving midway: every request aborted or finished, every block freed."""
from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from .harness import Http, assert_engine_idle, engine_idle, wait_until


async def _stream(session: aiohttp.ClientSession, url: str, body: dict, leave_after: int | None) -> dict:
    """Read one SSE stream; with ``leave_after``, drop the connection after that many content chunks."""
    async with session.post(url, json=body) as r:
        assert r.status == 200, await r.text()
        chunks, done = 0, False
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            payload = json.loads(line[6:])
            assert "error" not in payload, payload
            if payload["choices"] and payload["choices"][0]["delta"].get("content"):
                chunks += 1
            if leave_after is not None and chunks >= leave_after:
                r.close()  # the client goes away mid-stream
                return {"left": True, "chunks": chunks, "done": False}
        return {"left": False, "chunks": chunks, "done": done}


@pytest.mark.slow
async def test_32_streaming_clients_a_third_leaving_midway_free_every_block(server):
    url = server.v1 + "/chat/completions"
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=300)) as session:
        tasks = []
        for i in range(32):
            body = {"messages": [{"role": "user", "content": f"Write a poem about the number {i}."}],
                    "max_tokens": 12, "ignore_eos": True, "stream": True, "temperature": 0.7, "seed": i}
            tasks.append(_stream(session, url, body, leave_after=3 if i % 3 == 0 else None))
        results = await asyncio.gather(*tasks)
    left = [r for r in results if r["left"]]
    finished = [r for r in results if not r["left"]]
    assert len(left) == 11 and len(finished) == 21
    assert all(r["done"] and r["chunks"] >= 1 for r in finished)
    assert await asyncio.to_thread(wait_until, lambda: engine_idle(server.llm), 10.0), server.llm.stats()
    metrics = (await asyncio.to_thread(Http(server.url).get, "/metrics")).text
    assert 'slipstream:num_requests_running{model_name="%s"} 0.0' % server.state.model_name in metrics
    assert 'slipstream:kv_cache_usage_perc{model_name="%s"} 0.0' % server.state.model_name in metrics
    aborted = [line for line in metrics.splitlines()
               if line.startswith("slipstream:request_success_total") and 'finished_reason="abort"' in line]
    assert aborted and float(aborted[0].split()[-1]) >= 11, aborted  # every client that left is counted


async def test_client_leaving_a_long_stream_aborts_it_at_once(server):
    url = server.v1 + "/completions"
    body = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession() as session:
        async with session.post(url, json=body) as r:
            assert r.status == 200
            async for raw in r.content:
                if raw.startswith(b"data: {"):
                    break
            assert server.llm.stats().num_running == 1
            r.close()
            left_at = time.monotonic()
    # 400 tokens would take many seconds; an abort frees everything within a step or two.
    assert await asyncio.to_thread(wait_until, lambda: engine_idle(server.llm), 3.0), server.llm.stats()
    assert time.monotonic() - left_at < 3.0


async def test_client_leaving_a_non_streaming_request_aborts_it(server):
    url = server.v1 + "/completions"
    body = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True}
    async with aiohttp.ClientSession() as session:
        request = asyncio.create_task(session.post(url, json=body))
        assert await asyncio.to_thread(wait_until, lambda: server.llm.stats().num_running == 1, 10.0)
        request.cancel()  # closes the connection before any response
        await asyncio.gather(request, return_exceptions=True)
    assert await asyncio.to_thread(wait_until, lambda: engine_idle(server.llm), 3.0), server.llm.stats()
    assert_engine_idle(server.llm)
