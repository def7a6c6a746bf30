"""Logprobs over HTTP: ``echo`` returns the prompt's logprobs as lm-eval's log-likelihood requests
need them; every entry is the token's own bytes, so the bytes add up to the text; a skipped EOS
has no entry."""
from __future__ import annotations

import json
import math

import pytest

from .harness import Http
from .test_api_vllm_fields import stream_chunks

PROMPT = "The capital of France is Paris. The capital of Japan is"


@pytest.fixture(scope="module")
def http(server):
    with Http(server.url) as client:
        yield client


def complete(http, **fields) -> dict:
    r = http.post("/v1/completions", json={"prompt": PROMPT, "temperature": 0, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def test_echo_with_logprobs_is_what_lm_eval_reads(http, engine):
    """lm-eval's loglikelihood request: ``max_tokens=1, logprobs=1, echo=true``."""
    choice = complete(http, max_tokens=1, logprobs=1, echo=True)["choices"][0]
    lp = choice["logprobs"]
    prompt_ids = engine.tokenizer.encode(PROMPT)
    assert choice["text"].startswith(PROMPT) and len(choice["text"]) > len(PROMPT)
    assert len(lp["tokens"]) == len(prompt_ids) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v <= 0 for v in lp["token_logprobs"][1:])
    # the greedy continuation is the most likely token: its logprob tops its own top-1
    assert lp["token_logprobs"][-1] == pytest.approx(max(lp["top_logprobs"][-1].values()))
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][-1] == len(PROMPT)
    assert "".join(lp["tokens"]) == choice["text"]


def test_prompt_logprobs_bypass_the_prefix_cache(http):
    """A warm prefix cache serves a plain request; a request for prompt logprobs computes them all."""
    long_prompt = PROMPT + " Tokyo. " + "The capital of Italy is Rome. " * 6
    body = {"prompt": long_prompt, "max_tokens": 1, "temperature": 0}
    http.post("/v1/completions", json=body)
    warm = http.post("/v1/completions", json=body).json()
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    first, again = (http.post("/v1/completions", json={**body, "echo": True, "logprobs": 0}).json() for _ in range(2))
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    lp = again["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == again["usage"]["prompt_tokens"] + 1
    assert lp["token_logprobs"] == first["choices"][0]["logprobs"]["token_logprobs"]
    assert math.isfinite(sum(lp["token_logprobs"][1:]))


def test_echo_without_logprobs_and_streamed(http):
    plain = complete(http, max_tokens=4, echo=True)["choices"][0]
    assert plain["text"].startswith(PROMPT) and plain["logprobs"] is None
    chunks = stream_chunks(http, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "temperature": 0,
                                                     "echo": True, "logprobs": 1})
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == plain["text"]
    tokens = [t for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
              for t in c["choices"][0]["logprobs"]["tokens"]]
    assert "".join(tokens) == text


def test_chat_logprob_bytes_add_up_to_the_text(http):
    """A multi-byte character split over tokens: each entry carries its own bytes."""
    r = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Repeat exactly: 🎉🎉 日本語 🎉"}], "max_tokens": 24,
        "temperature": 0, "logprobs": True, "top_logprobs": 2, "ignore_eos": False})
    choice = r.json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert bytes(b for e in content for b in e["bytes"]).decode() == choice["message"]["content"]
    assert all(len(e["top_logprobs"]) == 2 for e in content)


def test_a_skipped_eos_has_no_logprobs_entry(http):
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Say hi."}],
                                                "max_tokens": 64, "temperature": 0, "logprobs": True})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    content = choice["logprobs"]["content"]
    assert bytes(b for e in content for b in e["bytes"]).decode() == choice["message"]["content"]
    assert r.json()["usage"]["completion_tokens"] == len(content) + 1  # the EOS is billed, not listed


def test_prompt_logprobs_come_back_as_vllm_returns_them(http, engine):
    ids = engine.tokenizer.encode(PROMPT)
    choice = complete(http, max_tokens=2, prompt_logprobs=2)["choices"][0]
    plp = choice["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    for token_id, entry in zip(ids[1:], plp[1:]):
        assert str(token_id) in entry and 2 <= len(entry) <= 3
        assert sorted(e["rank"] for e in entry.values() if e["rank"] is not None)[:2] == [1, 2]
        assert all(e["logprob"] <= 0 for e in entry.values())
    echo = complete(http, max_tokens=1, logprobs=0, echo=True)["choices"][0]["logprobs"]["token_logprobs"]
    assert [plp[i][str(t)]["logprob"] for i, t in enumerate(ids) if i] == pytest.approx(echo[1:len(ids)])
    chunks = stream_chunks(http, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 0})
    assert [c["choices"][0].get("prompt_logprobs") is not None for c in chunks if c["choices"]][0]


def _strict(text: str):
    def refuse(constant: str):
        raise AssertionError(f"{constant} is not JSON (jq, JavaScript and Go refuse the body)")
    return json.loads(text, parse_constant=refuse)


def test_non_finite_logits_are_a_500_naming_them_not_nan_logprobs(http, server):
    """A model whose logits are NaN (damaged weights) served argmax-of-NaN tokens with NaN
    logprobs (which Python's json writes as a bare NaN): now the request fails, streamed or not,
    with an error body that is strict JSON; the server goes on serving."""
    lm_head = server.llm.engine.runner.model.lm_head
    handle = lm_head.register_forward_hook(lambda module, args, out: out * float("nan"))
    try:
        for stream in (False, True):
            r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "logprobs": 2, "stream": stream})
            assert r.status_code == 500, r.text
            error = _strict(r.text)["error"]
            assert error["code"] == "engine_error" and "not finite" in error["message"]
    finally:
        handle.remove()
