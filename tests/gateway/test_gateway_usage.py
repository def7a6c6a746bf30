"""The gateway's demand counters read the usage at the end of a relayed response."""
from __future__ import annotations

from slipstream.api_types.metrics import read_gateway_load
from slipstream.server.gateway.usage import usage_tokens


def test_usage_is_read_from_a_json_body_and_from_the_last_sse_event():
    body = b'{"id":"x","choices":[],"usage":{"prompt_tokens":12,"completion_tokens":5,"total_tokens":17}}'
    assert usage_tokens(body) == (12, 5)
    stream = (b'data: {"choices":[{"delta":{"content":"a"}}],"usage":null}\n\n'
              b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3}}\n\ndata: [DONE]\n\n')
    assert usage_tokens(stream) == (7, 3)
    assert usage_tokens(b'{"usage":{"input_tokens":4,"output_tokens":9}}') == (4, 9)  # Responses API
    assert usage_tokens(b'data: {"choices":[{"delta":{}}]}\n\n') is None


def test_usage_with_nested_details_as_slipstream_and_openai_send_it():
    body = (b'{"choices":[{"text":"hi"}],"usage":{"prompt_tokens":33,"total_tokens":363,'
            b'"completion_tokens":330,"prompt_tokens_details":{"cached_tokens":16}}}')
    assert usage_tokens(body) == (33, 330)
    responses = (b'event: response.completed\ndata: {"type":"response.completed","response":{"id":"r",'
                 b'"usage":{"input_tokens":9,"input_tokens_details":{"cached_tokens":0},"output_tokens":4,'
                 b'"output_tokens_details":{"reasoning_tokens":0},"total_tokens":13}}}\n\n')
    assert usage_tokens(responses) == (9, 4)
    # A tail cut inside an earlier usage object still finds the complete last one.
    assert usage_tokens(b'ens":1}}\n\ndata: {"usage":{"prompt_tokens":2,"completion_tokens":3}}') == (2, 3)
    assert usage_tokens(b'{"usage": "none"}') is None


def test_the_gateway_counters_are_read_as_demand():
    text = ("slipstream:gateway_requests_waiting 2\n"
            'slipstream:gateway_endpoint_in_flight{endpoint="a"} 3\n'
            'slipstream:gateway_requests_total{code="200"} 40\n'
            'slipstream:gateway_requests_total{code="429"} 2\n'
            "slipstream:gateway_prompt_tokens_total 4000\n"
            "slipstream:gateway_generation_tokens_total 800\n")
    load = read_gateway_load(text)
    assert (load.waiting, load.in_flight, load.requests_total, load.prompt_tokens_total,
            load.generation_tokens_total) == (2, 3, 42, 4000, 800)
    assert load.answered_total == 40  # the tokens are of the answers below 400, not of the 429s
    assert read_gateway_load("slipstream:gateway_requests_waiting 0\n").requests_total is None


async def test_a_stream_without_include_usage_is_counted_and_clients_see_no_usage(pods):
    """A streamed request that did not ask for usage still feeds the gateway's token counters
    (the pod ends the stream with its usage in an SSE comment) and the tenant's charge, while
    the client's stream carries no usage chunk (the openai client reads it as always)."""
    import aiohttp
    import openai

    from gateway_helpers import API_KEY, AUTH, chat, metrics, running_gateway, total
    from slipstream.api_types import metrics as names
    from slipstream.api_types.tenancy import FAIRNESS_ID_HEADER

    async with running_gateway(endpoints=(pods["a"].url,), api_key=API_KEY) as (url, gateway), \
            aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/chat/completions", json=chat(max_tokens=6, stream=True),
                                headers={**AUTH, FAIRNESS_ID_HEADER: "streamer"}) as response:
            raw = await response.read()
        assert response.status == 200 and raw.endswith(b"data: [DONE]\n\n")
        assert b'"usage":{' not in raw.split(b"\n: ")[0]  # no usage in any data event
        samples = await metrics(session, url)
        assert total(samples, names.GATEWAY_GENERATION_TOKENS + "_total") == 6
        assert total(samples, names.GATEWAY_PROMPT_TOKENS + "_total") > 0
        assert gateway.queue.service.served("streamer") > 2 * 6  # prompt estimate + 2 × output
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=API_KEY)
        chunks = [c async for c in await client.chat.completions.create(**chat(max_tokens=4), stream=True)]
        assert all(c.usage is None for c in chunks) and chunks[-1].choices[0].finish_reason == "length"
        await client.close()


async def test_requests_whose_client_left_are_counted_as_arrivals(pods, caplog):
    """A client that leaves a stream (or is cut while the gateway writes to it) still sent a
    request: ``gateway_requests_total`` counts it (code 499), so the autoscaler's arrivals do not
    lose it, and the gateway logs no error for it."""
    import logging

    import aiohttp

    from gateway_helpers import API_KEY, AUTH, leave_stream, metrics, running_gateway, total, until_none_in_flight
    from slipstream.api_types import metrics as names

    caplog.set_level(logging.INFO)
    async with running_gateway(endpoints=(pods["a"].url,), api_key=API_KEY) as (url, gateway), \
            aiohttp.ClientSession() as session:
        for _ in range(3):
            await leave_stream(session, url, 10, AUTH)
        await until_none_in_flight(gateway)
        samples = await metrics(session, url)
        assert total(samples, names.GATEWAY_REQUESTS + "_total") == 3, samples
        assert total(samples, names.GATEWAY_REQUESTS + "_total", code="499") \
            + total(samples, names.GATEWAY_REQUESTS + "_total", code="200") == 3
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
