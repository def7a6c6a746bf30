"""Fields that serving tools built for vLLM send (guidellm's stream options, vLLM's
``include_stop_str_in_output``, OpenAI's no-op fields), over raw HTTP against the real engine."""
from __future__ import annotations

import json

import pytest

from .harness import Http, assert_engine_idle

CHAT = [{"role": "user", "content": "Tell me a story about a cat."}]
GUIDELLM_OPTIONS = {"include_usage": True, "continuous_usage_stats": True}  # what guidellm 0.8.1 always sends


@pytest.fixture(scope="module")
def http(server):
    with Http(server.url) as client:
        yield client


def stream_chunks(http: Http, path: str, body: dict) -> list[dict]:
    """The ``data:`` payloads of one SSE response, up to ``[DONE]``."""
    r = http.post(path, json={**body, "stream": True}, stream=True)
    assert r.status_code == 200, r.text
    chunks = []
    for line in r.iter_lines(decode_unicode=True):
        if not line or line.startswith(":"):  # an SSE comment (the usage for a gateway): clients skip it
            continue
        assert line.startswith("data: "), line
        if line == "data: [DONE]":
            return chunks
        chunks.append(json.loads(line[len("data: "):]))
    raise AssertionError("the stream ended without [DONE]")


def text_of(choice: dict) -> str:
    return choice["delta"].get("content") or "" if "delta" in choice else choice["text"]


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 8, "ignore_eos": True}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 8, "ignore_eos": True}),
], ids=["completions", "chat"])
def test_continuous_usage_puts_usage_so_far_on_every_chunk(http, server, path, body):
    chunks = stream_chunks(http, path, {**body, "temperature": 0, "stream_options": GUIDELLM_OPTIONS})
    *with_choices, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 8  # include_usage's final chunk
    assert with_choices and all(c["choices"] and c["usage"] is not None for c in with_choices)
    counts = [c["usage"]["completion_tokens"] for c in with_choices]
    assert counts == sorted(counts) and counts[-1] == last["usage"]["completion_tokens"]
    text_chunks = [c for c in with_choices if text_of(c["choices"][0])]
    assert len(text_chunks) >= 2 and text_chunks[0]["usage"]["completion_tokens"] < 8
    for c in with_choices:
        usage = c["usage"]
        assert usage["prompt_tokens"] == last["usage"]["prompt_tokens"] > 0
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert_engine_idle(server.llm)


def test_continuous_usage_without_include_usage_has_no_usage_only_chunk(http):
    chunks = stream_chunks(http, "/v1/completions", {"prompt": "Hello", "max_tokens": 4, "ignore_eos": True,
                                                     "stream_options": {"continuous_usage_stats": True}})
    assert all(c["choices"] for c in chunks)
    assert chunks[-1]["usage"]["completion_tokens"] == 4


def test_include_usage_alone_keeps_null_usage_until_the_last_chunk(http):
    chunks = stream_chunks(http, "/v1/completions", {"prompt": "Hello", "max_tokens": 4,
                                                     "stream_options": {"include_usage": True}})
    assert all(c["usage"] is None for c in chunks[:-1]) and chunks[-1]["usage"]["completion_tokens"] >= 1


@pytest.fixture(scope="module")
def stop_case(http):
    """A greedy output of the completions endpoint and a stop string from its middle."""
    body = {"prompt": "The history of the city", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    full = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    words = full.split()
    assert len(words) >= 4, full
    stop = " " + words[len(words) // 2]
    cut = full.find(stop)
    assert cut > 0, (full, stop)
    return body, full, stop, cut


@pytest.mark.parametrize("include", [True, False])
def test_include_stop_str_in_output_keeps_the_stop_string(http, server, stop_case, include):
    body, full, stop, cut = stop_case
    expected = full[:cut + len(stop)] if include else full[:cut]
    body = {**body, "stop": [stop], "include_stop_str_in_output": include}
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (expected, "stop")
    streamed = stream_chunks(http, "/v1/completions", body)
    assert "".join(c["choices"][0]["text"] for c in streamed) == expected
    assert streamed[-1]["choices"][0]["finish_reason"] == "stop"
    assert_engine_idle(server.llm)


def test_fields_that_change_nothing_are_accepted(http):
    no_ops = {"prompt_cache_key": "conversation-1", "safety_identifier": "user-hash", "service_tier": "auto",
              "store": False, "metadata": {"run": "1"}}
    for path, body in (("/v1/chat/completions", {"messages": CHAT}), ("/v1/completions", {"prompt": "Hi"})):
        r = http.post(path, json={**body, "max_tokens": 2, **no_ops})
        assert r.status_code == 200, r.text
