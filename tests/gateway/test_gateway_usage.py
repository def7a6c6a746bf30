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
    assert read_gateway_load("slipstream:gateway_requests_waiting 0\n").requests_total is None
