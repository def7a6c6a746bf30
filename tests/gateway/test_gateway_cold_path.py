"""The gateway's cold path: requests wait in it while no endpoint can take them (scale from zero,
every pod full), its own 503/429 past the deadline or a full queue, retries before the first
byte (a killed pod, a draining one), an in-band error after it, and a silent endpoint that
never holds up routing."""
from __future__ import annotations

import asyncio
import contextlib
import time

import aiohttp
import openai
import pytest
from aiohttp import web

from gateway_helpers import API_KEY, AUTH, MODEL, chat, fake_pod, metrics, running_gateway, total

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
SUCCESS = "slipstream:request_success_total"


async def wait_until(predicate, timeout: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def post(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, dict, dict]:
    async with session.post(url + "/v1/chat/completions", json=body) as response:
        return response.status, dict(response.headers), await response.json()


async def test_ready_with_zero_endpoints_and_waiting_requests_all_succeed_once_one_is_added(pods):
    async with running_gateway(endpoints=()) as (url, gateway), aiohttp.ClientSession(headers=AUTH) as session:
        async with session.get(url + "/ready") as response:
            assert response.status == 200
        tasks = [asyncio.create_task(post(session, url, chat(f"hi {i}", max_tokens=4))) for i in range(12)]
        await wait_until(lambda: gateway.queue.waiting == 12, what="12 requests waiting")
        samples = await metrics(session, url)
        assert total(samples, "slipstream:gateway_requests_waiting") == 12  # the autoscaler's demand at zero
        gateway.endpoints.set_endpoints([pods["a"].url])
        results = await asyncio.gather(*tasks)
        assert [status for status, _, _ in results] == [200] * 12
        assert all(body["usage"]["completion_tokens"] == 4 for _, _, body in results)
        assert gateway.queue.waiting == 0


async def test_past_the_deadline_the_gateway_answers_503_with_retry_after_in_openai_shape():
    async with running_gateway(endpoints=(), queue_timeout=0.3, retry_after=7) as (url, gateway), \
            aiohttp.ClientSession() as session:
        start = time.monotonic()
        status, headers, body = await post(session, url, chat())
        assert status == 503 and time.monotonic() - start >= 0.3
        assert headers["Retry-After"] == "7"
        assert body["error"]["type"] == "service_unavailable_error" and body["error"]["code"] == "deadline"
        assert set(body["error"]) == {"message", "type", "param", "code"}
        assert gateway.queue.waiting == 0
        assert total(await metrics(session, url), "slipstream:gateway_rejections_total", reason="deadline") == 1


async def test_a_full_queue_answers_429_at_once_and_leaving_waiters_free_their_places():
    async with running_gateway(endpoints=(), max_queue=2, queue_timeout=30) as (url, gateway), \
            aiohttp.ClientSession() as session:
        waiting = [asyncio.create_task(post(session, url, chat())) for _ in range(2)]
        await wait_until(lambda: gateway.queue.waiting == 2, what="2 requests waiting")
        status, headers, body = await post(session, url, chat())
        assert status == 429 and headers["Retry-After"] == "5"
        assert body["error"]["type"] == "rate_limit_error" and body["error"]["code"] == "queue_full"
        for task in waiting:  # the clients go away: their places are freed
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        await wait_until(lambda: gateway.queue.waiting == 0, what="the queue to empty")


@contextlib.asynccontextmanager
async def holding_endpoint():
    """An in-process 'pod' that answers each chat request only when the test releases it (a
    real pod may finish a short request before the next one is counted). Yields (url, the
    prompts in the order they arrived, release(prompt))."""
    arrived: list[str] = []
    gates: dict[str, asyncio.Event] = {}

    async def completions(request: web.Request) -> web.Response:
        prompt = (await request.json())["messages"][0]["content"]
        arrived.append(prompt)
        await gates.setdefault(prompt, asyncio.Event()).wait()
        return web.json_response({
            "id": f"chatcmpl-{prompt}", "object": "chat.completion", "created": 0, "model": MODEL,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

    async with fake_pod("127.0.0.43", completions) as url:
        try:
            yield url, arrived, lambda p: gates.setdefault(p, asyncio.Event()).set()
        finally:
            for gate in gates.values():
                gate.set()


async def test_a_full_endpoint_holds_requests_in_the_gateway_and_sends_them_on_in_arrival_order():
    async with holding_endpoint() as (pod, arrived, release), \
            running_gateway(endpoints=(pod,), max_in_flight=2, policy="least-loaded") as (url, gateway), \
            aiohttp.ClientSession(headers=AUTH) as session:
        tasks = []
        for i in range(6):
            tasks.append(asyncio.create_task(post(session, url, chat(f"q{i}"))))
            await wait_until(lambda: gateway.queue.waiting + gateway.endpoints.get(pod).in_flight == i + 1,
                             what=f"request {i} to arrive")
        await wait_until(lambda: len(arrived) == 2, what="two requests at the endpoint")
        assert arrived == ["q0", "q1"] and gateway.queue.waiting == 4
        for i in range(6):  # each answer frees one place: the oldest waiter takes it
            release(f"q{i}")
            await wait_until(lambda: len(arrived) == min(i + 3, 6), what=f"the request after q{i + 1}")
        assert arrived == [f"q{i}" for i in range(6)]
        assert [status for status, _, _ in await asyncio.gather(*tasks)] == [200] * 6
        assert gateway.queue.waiting == 0 and gateway.endpoints.get(pod).in_flight == 0


@contextlib.asynccontextmanager
async def draining_endpoint(status: int = 503):
    """An in-process 'pod' that starts draining at its first /v1 request: from then on /ready
    and every /v1 request answer 503, as ``slipstream serve`` does after SIGTERM; or, with
    ``status`` 429, one whose own queue is full: every /v1 request gets 429 and /ready stays 200.
    Its /metrics is idle throughout. Yields (url, paths of the /v1 requests it got)."""
    hits: list[str] = []
    code, kind = ("draining", "service_unavailable_error") if status == 503 else ("rate_limit_exceeded",
                                                                                  "rate_limit_error")

    async def v1(request: web.Request) -> web.Response:
        hits.append(request.path)
        return web.json_response({"error": {"message": code, "type": kind, "param": None, "code": code}},
                                 status=status, headers={"Retry-After": "1"})

    async def ready(request: web.Request) -> web.Response:
        return web.json_response({}, status=503 if hits and status == 503 else 200)

    async with fake_pod("127.0.0.41", v1, ready) as url:
        yield url, hits


async def test_a_503_before_the_first_byte_is_retried_on_another_endpoint(pods):
    pod = pods["a"].url
    async with draining_endpoint() as (draining, hits), \
            running_gateway(endpoints=(draining, pod), policy="round-robin") as (url, gateway), \
            aiohttp.ClientSession(headers=AUTH) as session:
        before = await metrics(session, pod)
        results = [await post(session, url, chat(f"r{i}", max_tokens=2)) for i in range(6)]
        assert [status for status, _, _ in results] == [200] * 6
        assert len(hits) == 1  # once it said 503 it gets nothing until its /ready says 200 again
        assert not gateway.endpoints.get(draining).ready
        assert total(await metrics(session, pod), SUCCESS) - total(before, SUCCESS) == 6
        assert total(await metrics(session, url), "slipstream:gateway_retries_total", reason="unavailable") == 1


async def test_a_full_pods_429_before_the_first_byte_is_retried_on_another_endpoint(pods):
    """A pod's own queue can be full though the gateway counted room (another gateway replica's
    requests, n > 1 sequences): its 429 moves the request on, and the pod stays routable."""
    pod = pods["a"].url
    async with draining_endpoint(429) as (full, hits), \
            running_gateway(endpoints=(full, pod), policy="round-robin") as (url, gateway), \
            aiohttp.ClientSession(headers=AUTH) as session:
        results = [await post(session, url, chat(f"f{i}", max_tokens=2)) for i in range(6)]
        assert [status for status, _, _ in results] == [200] * 6
        refused = hits.count("/v1/chat/completions")  # the gateway's own calls (KV events, tokenizer) aside
        assert refused >= 2 and gateway.endpoints.get(full).ready
        assert total(await metrics(session, url), "slipstream:gateway_retries_total", reason="busy") == refused
    async with draining_endpoint(429) as (full, hits), running_gateway(endpoints=(full,)) as (url, gateway), \
            aiohttp.ClientSession(headers=AUTH) as session:
        status, body, _ = await post(session, url, chat("alone", max_tokens=2))
        assert status == 429 and hits.count("/v1/chat/completions") == 3  # every try refused: the last reaches the client


async def test_a_silent_endpoint_does_not_stall_routing(pods):
    """A socket that accepts and never answers: never routable, never waited on."""
    accepted: list[asyncio.StreamWriter] = []

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)

    silent_server = await asyncio.start_server(hold, "127.0.0.42", 0)
    silent = f"http://127.0.0.42:{silent_server.sockets[0].getsockname()[1]}"
    pod = pods["a"].url
    try:
        async with running_gateway(endpoints=(silent, pod), policy="round-robin", scrape_timeout=0.5,
                                   wait_for=1) as (url, gateway), \
                aiohttp.ClientSession(headers=AUTH) as session:
            before = await metrics(session, pod)
            start = time.monotonic()
            results = await asyncio.gather(*(post(session, url, chat(f"s{i}", max_tokens=2)) for i in range(8)))
            assert [status for status, _, _ in results] == [200] * 8
            assert time.monotonic() - start < 5
            assert total(await metrics(session, pod), SUCCESS) - total(before, SUCCESS) == 8
            samples = await metrics(session, url)
            assert total(samples, "slipstream:gateway_endpoint_routable", endpoint=silent) == 0
            assert total(samples, "slipstream:gateway_endpoint_routable", endpoint=pod) == 1
            assert accepted, "the gateway never tried to scrape the silent endpoint"
    finally:
        for writer in accepted:
            writer.close()
        silent_server.close()


async def test_a_killed_pod_loses_no_unstarted_request_and_its_streams_end_with_an_error_event(pods):
    victim, survivor = pods["victim"], pods["b"].url
    async with running_gateway(endpoints=(victim.url, survivor), policy="round-robin") as (url, gateway), \
            aiohttp.ClientSession(headers=AUTH) as session:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)

        async def drain(stream) -> str:
            try:
                async for _ in stream:
                    pass
            except openai.APIError as exc:
                return f"error: {exc.message}"
            return "complete"

        # four streams, alternating: two on each pod, each past its first chunk
        streams = []
        for i in range(4):
            stream = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"stream {i}"}], max_tokens=150, stream=True)
            await stream.__anext__()
            streams.append(asyncio.create_task(drain(stream)))
        # four whole (non-streamed) answers, two on each pod: no byte comes back before they end
        wholes = [asyncio.create_task(post(session, url, chat(f"whole {i}", max_tokens=80))) for i in range(4)]
        await wait_until(lambda: sum(gateway.endpoints.get(n).in_flight for n in (victim.url, survivor)) == 8,
                         what="eight requests in flight")
        assert gateway.endpoints.get(victim.url).in_flight == 4
        await asyncio.sleep(0.2)
        victim.kill()
        outcomes = await asyncio.wait_for(asyncio.gather(*streams), 20)
        assert sorted(o.split(":")[0] for o in outcomes) == ["complete", "complete", "error", "error"]
        results = await asyncio.wait_for(asyncio.gather(*wholes), 20)
        assert [status for status, _, _ in results] == [200] * 4
        assert all(body["usage"]["completion_tokens"] == 80 for _, _, body in results)
        # requests after the kill go to the survivor
        after = await asyncio.gather(*(post(session, url, chat(f"after {i}", max_tokens=2)) for i in range(4)))
        assert [status for status, _, _ in after] == [200] * 4
        samples = await metrics(session, url)
        assert total(samples, "slipstream:gateway_retries_total", reason="connection") == 2
        assert total(samples, "slipstream:gateway_upstream_errors_after_first_byte_total") == 2
        assert total(samples, "slipstream:gateway_endpoint_routable", endpoint=victim.url) == 0
        await client.close()
