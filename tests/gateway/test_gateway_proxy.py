"""The gateway as a reverse proxy in front of real sim pods: the OpenAI client through it,
headers, auth, request ids, client disconnects, and how round-robin and least-loaded spread."""
from __future__ import annotations

import asyncio
import time

import aiohttp
import openai
import pytest

from gateway_helpers import API_KEY, AUTH, MODEL, chat, metrics, running_gateway, total

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


async def test_openai_client_streams_and_completes_through_the_gateway(pods):
    async with running_gateway(endpoints=(pods["a"].url,), policy="least-loaded") as (url, _):
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
        models = await client.models.list()
        assert [m.id for m in models.data] == [MODEL]
        whole = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=6)
        assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 6
        stream = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                      max_tokens=6, stream=True)
        chunks = [chunk async for chunk in stream]
        assert chunks[-1].choices[0].finish_reason == "length"
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
        completion = await client.completions.create(model=MODEL, prompt="once upon", max_tokens=4)
        assert completion.usage.completion_tokens == 4
        await client.close()


async def test_stream_arrives_chunk_by_chunk_not_buffered(pods):
    """The first event reaches the client long before a 100-token stream ends (~1.3 s)."""
    async with running_gateway(endpoints=(pods["a"].url,), policy="least-loaded") as (url, _), \
            aiohttp.ClientSession(headers=AUTH) as session:
        start = time.monotonic()
        async with session.post(url + "/v1/chat/completions", json=chat(max_tokens=100, stream=True)) as response:
            assert response.headers["Content-Type"].startswith("text/event-stream")
            first = await response.content.readline()
            first_at = time.monotonic() - start
            rest = await response.read()
        total_time = time.monotonic() - start
        assert first.startswith(b"data: {")
        assert rest.rstrip().endswith(b"data: [DONE]")
        assert first_at < total_time / 3, (first_at, total_time)


async def test_authorization_passes_through_and_the_pod_enforces_its_key(pods):
    async with running_gateway(endpoints=(pods["a"].url,), policy="round-robin") as (url, _):
        wrong = openai.AsyncOpenAI(base_url=url + "/v1", api_key="not-the-key", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await wrong.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        right = openai.AsyncOpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
        answer = await right.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=2)
        assert answer.usage.completion_tokens == 2
        async with aiohttp.ClientSession() as session:  # no Authorization header at all
            async with session.get(url + "/v1/models") as response:
                assert response.status == 401
                assert response.headers["WWW-Authenticate"] == "Bearer"
                assert (await response.json())["error"]["code"] == "invalid_api_key"
        await wrong.close()
        await right.close()


async def test_request_id_is_kept_or_generated_and_returned(pods):
    async with running_gateway(endpoints=(pods["a"].url,), policy="round-robin") as (url, _), \
            aiohttp.ClientSession(headers=AUTH) as session:
        async with session.post(url + "/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 1},
                                headers={"X-Request-Id": "req-42"}) as response:
            assert response.status == 200 and response.headers["X-Request-Id"] == "req-42"
        one_token = {"model": MODEL, "prompt": "a", "max_tokens": 1}
        async with session.post(url + "/v1/completions", json=one_token) as response:
            generated = response.headers["X-Request-Id"]
            assert response.status == 200 and len(generated) == 32
        # pod errors come back as they are, in OpenAI's shape
        async with session.post(url + "/v1/completions", json={**one_token, "max_tokens": 0}) as response:
            assert response.status == 400
            assert set((await response.json())["error"]) == {"message", "type", "param", "code"}


async def test_gateway_answers_its_own_probes_and_metrics(pods):
    async with running_gateway(endpoints=(pods["a"].url,), policy="round-robin") as (url, _), \
            aiohttp.ClientSession(headers=AUTH) as session:
        for path in ("/health", "/ready"):
            async with session.get(url + path) as response:
                assert response.status == 200
        samples = await metrics(session, url)
        assert total(samples, "slipstream:gateway_endpoint_routable", endpoint=pods["a"].url) == 1
        assert total(samples, "slipstream:gateway_requests_waiting") == 0
        # the pod's own series are not the gateway's
        assert total(samples, "slipstream:num_requests_running") == 0
        assert not any(name == "slipstream:num_requests_running" for name, _ in samples)


async def test_client_disconnect_aborts_the_request_on_the_pod_and_frees_its_blocks(pods):
    pod = pods["b"].url
    async with running_gateway(endpoints=(pod,), policy="least-loaded") as (url, gateway), \
            aiohttp.ClientSession(headers=AUTH) as session:
        before = await metrics(session, pod)
        client = aiohttp.ClientSession(headers=AUTH)
        response = await client.post(url + "/v1/chat/completions",
                                     json=chat("a long story " * 40, max_tokens=2000, stream=True))
        for _ in range(3):
            assert (await response.content.readline()) is not None
        during = await metrics(session, pod)
        assert total(during, "slipstream:num_requests_running") == 1
        assert total(during, "slipstream:kv_cache_usage_perc") > 0
        response.close()
        await client.close()
        deadline = time.monotonic() + 3
        while True:
            after = await metrics(session, pod)
            if (total(after, "slipstream:num_requests_running") == 0
                    and total(after, "slipstream:kv_cache_usage_perc") == 0):
                break
            assert time.monotonic() < deadline, "the pod kept the request after the client left"
            await asyncio.sleep(0.05)
        aborted = "slipstream:request_success_total"
        assert total(after, aborted, finished_reason="abort") == total(before, aborted, finished_reason="abort") + 1
        await asyncio.sleep(0.1)
        assert gateway.endpoints.get(pod).in_flight == 0


async def test_bodies_the_gateway_cannot_parse_reach_the_pod_which_answers_the_400(pods):
    """Not JSON, not an object, or nested past the parser's depth: routed by load, and the pod's
    own OpenAI-shaped 400 comes back (the gateway never answers 500 for a client's body)."""
    async with running_gateway(endpoints=(pods["a"].url,), policy="prefix") as (url, _), \
            aiohttp.ClientSession(headers={**AUTH, "Content-Type": "application/json"}) as session:
        for body in (b"{not json", b"[1, 2]", b"[" * 100_000 + b"]" * 100_000):
            async with session.post(url + "/v1/completions", data=body) as response:
                assert response.status == 400, body[:20]
                assert (await response.json())["error"]["type"] == "invalid_request_error"


async def test_round_robin_alternates_between_pods(pods):
    urls = (pods["a"].url, pods["b"].url)
    async with running_gateway(endpoints=urls, policy="round-robin") as (url, _), \
            aiohttp.ClientSession(headers=AUTH) as session:
        before = {u: await metrics(session, u) for u in urls}
        for i in range(10):
            async with session.post(url + "/v1/completions",
                                    json={"model": MODEL, "prompt": f"p{i}", "max_tokens": 1}) as response:
                assert response.status == 200
        served = {u: total(await metrics(session, u), "slipstream:request_success_total")
                  - total(before[u], "slipstream:request_success_total") for u in urls}
        assert served == {urls[0]: 5, urls[1]: 5}
        samples = await metrics(session, url)
        assert total(samples, "slipstream:gateway_routing_decisions_total", policy="round-robin",
                     reason="round-robin") == 10


async def test_least_loaded_spreads_concurrent_requests_evenly(pods):
    urls = (pods["a"].url, pods["b"].url)
    async with running_gateway(endpoints=urls, policy="least-loaded") as (url, _), \
            aiohttp.ClientSession(headers=AUTH) as session:
        before = {u: await metrics(session, u) for u in urls}

        async def one(i: int) -> int:
            async with session.post(url + "/v1/completions",
                                    json={"model": MODEL, "prompt": f"q{i}", "max_tokens": 20}) as response:
                return response.status

        assert await asyncio.gather(*(one(i) for i in range(8))) == [200] * 8
        served = {u: total(await metrics(session, u), "slipstream:request_success_total")
                  - total(before[u], "slipstream:request_success_total") for u in urls}
        assert served == {urls[0]: 4, urls[1]: 4}
        samples = await metrics(session, url)
        assert total(samples, "slipstream:gateway_routing_decisions_total", policy="least-loaded") == 8
        assert total(samples, "slipstream:gateway_endpoint_in_flight") == 0


async def test_kv_events_policy_sends_a_repeated_prompt_to_the_pod_that_holds_its_prefix(pods):
    """The default policy, wired: the pods' KV events fill the index, the prompt hasher names the
    prompt's blocks, and the second request with the same long prompt is a prefix hit."""
    urls = (pods["a"].url, pods["b"].url)
    prompt = " ".join(f"word{i}" for i in range(300))
    async with running_gateway(endpoints=urls, api_key=API_KEY) as (url, gateway), \
            aiohttp.ClientSession(headers=AUTH) as session:
        assert gateway.router.policy == "kv-events"
        async with session.post(url + "/v1/completions",
                                json={"model": MODEL, "prompt": prompt, "max_tokens": 1}) as response:
            assert response.status == 200
        first = await metrics(session, url)
        if total(first, "slipstream:gateway_prefix_blocks_requested_total") == 0:  # tokenizer still loading
            async with session.post(url + "/v1/completions",
                                    json={"model": MODEL, "prompt": prompt, "max_tokens": 1}) as response:
                assert response.status == 200
        deadline = time.monotonic() + 5
        while not any(gateway.block_index.blocks_of(u) for u in urls):
            assert time.monotonic() < deadline, "no KV events reached the gateway's index"
            await asyncio.sleep(0.02)
        async with session.post(url + "/v1/completions",
                                json={"model": MODEL, "prompt": prompt, "max_tokens": 1}) as response:
            assert response.status == 200
        samples = await metrics(session, url)
        assert total(samples, "slipstream:gateway_routing_decisions_total", policy="kv-events",
                     reason="prefix-hit") >= 1
        assert total(samples, "slipstream:gateway_prefix_blocks_matched_total") > 0
