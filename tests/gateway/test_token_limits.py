"""Per-tenant token limits (``--tenant-token-limits``): the bucket itself, and the gateway
refusing a tenant past its limit with 429 and Retry-After while others go on."""
from __future__ import annotations

import asyncio
import contextlib
import json
import time

import aiohttp
import pytest
from aiohttp import web

from gateway_helpers import API_KEY, AUTH, MODEL, chat, fake_pod, leave_stream, metrics, running_gateway, total, \
    until_none_in_flight
from slipstream.api_types import metrics as names
from slipstream.api_types.tenancy import FAIRNESS_ID_HEADER, USAGE_HEADER

from slipstream.api_types.tenancy import parse_tenant_token_limits
from slipstream.server.gateway.token_limits import TokenLimits


def charges(limits: TokenLimits) -> dict[str, float]:
    """Tenant → tokens charged to ``limits`` from now on, net of what was given back (refills
    aside: a large limit refills in milliseconds)."""
    total: dict[str, float] = {}
    charge = limits.charge

    def spy(tenant: str, tokens: float, now: float) -> None:
        total[tenant] = total.get(tenant, 0) + tokens
        charge(tenant, tokens, now)
    limits.charge = spy
    return total


def test_a_bucket_holds_a_minute_of_tokens_and_refills_at_the_limit_per_minute():
    limits = TokenLimits({"batch": 600})  # 10 tokens a second
    assert limits.retry_after("batch", 0.0) is None and limits.remaining("batch", 0.0) == 600
    limits.charge("batch", 900, 0.0)  # one long answer: 300 owed
    assert limits.remaining("batch", 0.0) == -300
    assert limits.retry_after("batch", 0.0) == 30  # 300 tokens at 10 a second
    assert limits.retry_after("batch", 29.0) == 1
    assert limits.retry_after("batch", 30.0) is None  # the debt is paid
    assert limits.remaining("batch", 1000.0) == 600  # an idle tenant banks a minute's worth, no more
    limits.charge("batch", -10_000, 1000.0)  # a refund never lifts it past the limit either
    assert limits.remaining("batch", 1000.0) == 600


def test_a_tenant_not_named_is_never_limited():
    limits = TokenLimits({"batch": 1})
    limits.charge("chat", 10**9, 0.0)
    assert limits.retry_after("chat", 0.0) is None and limits.remaining("chat", 0.0) is None
    assert not TokenLimits(None) and TokenLimits({"a": 1})


def test_token_limits_parse_as_name_and_whole_tokens_per_minute():
    assert parse_tenant_token_limits("team-a=100000, batch=20000") == {"team-a": 100000, "batch": 20000}
    assert parse_tenant_token_limits("") == {}
    for bad in ("a", "a=0", "=1", "a=x", "a=1.5", "a=-3", "a=1,a=2", "a=10000000000", "a=²", "a=1e3"):
        with pytest.raises(ValueError, match="tenant"):
            parse_tenant_token_limits(bad)
    for bad in ({"a": 0}, {"a": 1.5}, {"a": True}):
        with pytest.raises(ValueError, match="tenant_token_limits must be integers >= 1"):
            TokenLimits(bad)


async def test_a_tenant_past_its_limit_gets_429_with_retry_after_and_others_are_served(pods):
    """Through the real gateway and a sim pod: the limited tenant's first request is served and
    charged its usage; the next, with the bucket spent, is refused (OpenAI-shaped 429, the
    bucket's Retry-After, counted in the tenant's rejections); another tenant is served; the
    openai client sees a RateLimitError."""
    import openai

    async with running_gateway(endpoints=(pods["a"].url,), api_key=API_KEY,
                               tenant_token_limits={"batch": 60}) as (url, gateway), \
            aiohttp.ClientSession() as session:
        batch = {**AUTH, FAIRNESS_ID_HEADER: "batch"}
        sent = time.monotonic()
        async with session.post(url + "/v1/chat/completions", json=chat(max_tokens=60, ignore_eos=True),
                                headers=batch) as response:
            usage = (await response.json())["usage"]
        assert response.status == 200
        spent = usage["prompt_tokens"] + usage["completion_tokens"]
        assert spent > 60  # the whole usage is charged, not the estimate: the bucket is in debt
        now = time.monotonic()
        left = gateway.proxy.token_limits.remaining("batch", now)
        # 60 tokens a minute refill 1 a second, only from the charge on (the bucket was full before)
        assert -spent + 60 <= left <= -spent + 60 + (now - sent)
        async with session.post(url + "/v1/chat/completions", json=chat(), headers=batch) as response:
            body = await response.json()
        assert response.status == 429 and body["error"]["code"] == "token_limit"
        assert body["error"]["type"] == "rate_limit_error" and "'batch'" in body["error"]["message"]
        assert 1 <= int(response.headers["Retry-After"]) <= spent  # 1 token a second refills the debt
        async with session.post(url + "/v1/chat/completions", json=chat(),
                                headers={**AUTH, FAIRNESS_ID_HEADER: "chat"}) as response:
            assert response.status == 200  # no limit named, none applied
        async with session.get(url + "/v1/models", headers=batch) as response:
            assert response.status == 200  # only inference requests spend tokens
        samples = await metrics(session, url)
        assert total(samples, names.GATEWAY_TENANT_REJECTIONS, tenant="batch") == 1
        assert total(samples, names.GATEWAY_REJECTIONS + "_total", reason="token_limit") == 1
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0,
                                    default_headers={FAIRNESS_ID_HEADER: "batch"})
        with pytest.raises(openai.RateLimitError):
            await client.chat.completions.create(**chat())
        await client.close()


async def test_a_request_the_gateway_refuses_gives_its_estimate_back(pods):
    """Queue full: nothing was served, so the limited tenant's bucket is as before."""
    async with running_gateway(endpoints=(pods["a"].url,), api_key=API_KEY, max_in_flight=1, max_queue=0,
                               tenant_token_limits={"batch": 10**6}) as (url, gateway), \
            aiohttp.ClientSession() as session:
        headers = {**AUTH, FAIRNESS_ID_HEADER: "batch"}
        first = asyncio.ensure_future(session.post(url + "/v1/chat/completions",
                                                   json=chat(max_tokens=200, ignore_eos=True), headers=headers))
        while not gateway.queue.in_flight_by_tenant().get("batch"):
            await asyncio.sleep(0.01)
        before = gateway.proxy.token_limits.remaining("batch", time.monotonic())
        async with session.post(url + "/v1/chat/completions", json=chat(), headers=headers) as response:
            assert response.status == 429 and (await response.json())["error"]["code"] == "queue_full"
        after = gateway.proxy.token_limits.remaining("batch", time.monotonic())
        assert after >= before  # the refused request's estimate came back (plus a little refill)
        (await first).release()


async def test_a_burst_reserves_what_each_request_may_generate_so_it_cannot_run_past_the_limit(pods):
    """Five requests at once, each allowed 60 tokens, against 50 a minute: the first reserves its
    prompt and 60 and puts the bucket in debt, so the other four are refused, not served."""
    async with running_gateway(endpoints=(pods["a"].url,), api_key=API_KEY,
                               tenant_token_limits={"burst": 50}) as (url, gateway), \
            aiohttp.ClientSession() as session:
        headers = {**AUTH, FAIRNESS_ID_HEADER: "burst"}

        async def one() -> int:
            async with session.post(url + "/v1/chat/completions", json=chat(max_tokens=60), headers=headers) as r:
                await r.read()
                return r.status
        assert sorted(await asyncio.gather(*(one() for _ in range(5)))) == [200, 429, 429, 429, 429]



async def test_a_burst_of_batched_completions_reserves_what_every_prompt_may_generate(pods):
    """``/v1/completions`` with a list of prompts generates ``max_tokens`` for each: four prompts
    allowed 60 tokens each reserve 240, so against 100 a minute the first request of a burst puts
    the bucket in debt and the other four are refused (reserving 60 let a second one through)."""
    async with running_gateway(endpoints=(pods["a"].url,), api_key=API_KEY,
                               tenant_token_limits={"batch": 100}) as (url, gateway), \
            aiohttp.ClientSession() as session:
        headers = {**AUTH, FAIRNESS_ID_HEADER: "batch"}
        body = {"model": MODEL, "prompt": ["one", "two", "three", "four"], "max_tokens": 60}

        async def one() -> int:
            async with session.post(url + "/v1/completions", json=body, headers=headers) as r:
                await r.read()
                return r.status
        assert sorted(await asyncio.gather(*(one() for _ in range(5)))) == [200, 429, 429, 429, 429]

async def test_a_stream_the_client_leaves_is_charged_what_it_was_sent(pods):
    """The reservation (prompt + 400) gives back the output the client never got: what is charged
    is the prompt estimate and about one token per event relayed."""
    async with running_gateway(endpoints=(pods["a"].url,), api_key=API_KEY,
                               tenant_token_limits={"leaver": 10**6}) as (url, gateway), \
            aiohttp.ClientSession() as session:
        spent = charges(gateway.proxy.token_limits)
        await leave_stream(session, url, 20, {**AUTH, FAIRNESS_ID_HEADER: "leaver"})
        await until_none_in_flight(gateway)
        assert 20 <= spent["leaver"] < 400  # not the reservation's 400 output tokens, and not nothing


async def test_a_responses_body_that_echoes_long_metadata_is_charged_its_usage(pods):
    """The Responses API echoes ``metadata`` after ``usage``; 4 KB of it pushed the usage out of
    the body's tail. The pod's usage header is read first; a stream ends with the usage."""
    async with running_gateway(endpoints=(pods["a"].url,), api_key=API_KEY,
                               tenant_token_limits={"echo": 10**6}) as (url, gateway), \
            aiohttp.ClientSession() as session:
        spent = charges(gateway.proxy.token_limits)
        body = {"model": chat()["model"], "input": "Hi", "max_output_tokens": 12,
                "metadata": {f"k{i}": "é" * 500 for i in range(10)}}
        headers = {**AUTH, FAIRNESS_ID_HEADER: "echo"}
        async with session.post(url + "/v1/responses", json=body, headers=headers) as response:
            usage = (await response.json())["usage"]
        assert response.status == 200
        assert spent["echo"] == usage["input_tokens"] + usage["output_tokens"]
        async with session.post(url + "/v1/responses", json={**body, "stream": True}, headers=headers) as response:
            raw = await response.read()
        assert response.status == 200 and raw.rstrip().endswith(b"}")
        assert spent["echo"] == 2 * (usage["input_tokens"] + usage["output_tokens"])


async def test_a_stream_the_client_leaves_counts_its_events_in_the_fair_share_too(pods):
    """The gateway's fairness counter charges the output a left stream was sent (about a token
    per event, as the token limit does): without it a tenant that leaves each stream just before
    its end is charged its prompts only, and goes ahead of tenants that read theirs to the end."""
    async with running_gateway(endpoints=(pods["a"].url,), api_key=API_KEY) as (url, gateway), \
            aiohttp.ClientSession() as session:
        served = gateway.queue.service.served
        # the prompt estimate, charged when the request got its slot
        prompt = await leave_stream(session, url, 20, {**AUTH, FAIRNESS_ID_HEADER: "leaver"},
                                    lambda: served("leaver"))
        await until_none_in_flight(gateway)
        assert served("leaver") >= prompt + 2 * 20, (prompt, served("leaver"))



async def test_a_response_the_client_leaves_mid_body_is_charged_the_usage_its_header_said():
    """A non-streamed answer is whole at the pod when its headers come (with its usage in
    ``x-slipstream-usage``): a client that reads them and leaves during the body was served all
    of it, so its bucket and fair share are charged that usage, not given the output back."""
    usage = {"prompt_tokens": 7, "completion_tokens": 300, "total_tokens": 307}
    stalled, checked = asyncio.Event(), asyncio.Event()

    async def completions(request: web.Request) -> web.StreamResponse:
        if request.path != "/v1/chat/completions":  # the gateway's tokenizer fetch: none here
            return web.json_response({"error": {"message": "not found"}}, status=404)
        response = web.StreamResponse(headers={"Content-Type": "application/json", USAGE_HEADER: json.dumps(usage)})
        response.content_length = 100_000
        await response.prepare(request)
        await response.write(b'{"id": "chatcmpl-1", "choices": [')
        stalled.set()
        with contextlib.suppress(asyncio.TimeoutError):  # the rest of a long body, still on its way
            await asyncio.wait_for(checked.wait(), 30)
        return response

    async with fake_pod("127.0.0.44", completions) as pod, \
            running_gateway(endpoints=(pod,), tenant_token_limits={"leaver": 10**6}) as (url, gateway), \
            aiohttp.ClientSession() as session:
        spent = charges(gateway.proxy.token_limits)
        async with session.post(url + "/v1/chat/completions", json=chat(max_tokens=400),
                                headers={FAIRNESS_ID_HEADER: "leaver"}) as response:
            assert response.status == 200
            await stalled.wait()
            response.close()  # the client leaves
        await until_none_in_flight(gateway)
        assert spent["leaver"] == usage["total_tokens"]
        assert gateway.queue.service.served("leaver") >= 2 * usage["completion_tokens"]
        checked.set()  # the fake pod's handler ends, so its server stops at once
