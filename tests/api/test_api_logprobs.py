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


def test_echo_with_max_tokens_0_scores_the_prompt_alone(server, http, engine):
    """lm-eval's prompt scoring: the prompt as the text, its logprobs, no completion, streamed or not."""
    import openai

    client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)
    out = client.completions.create(model=server.state.model_name, prompt=PROMPT, max_tokens=0, echo=True,
                                    logprobs=1, temperature=0)
    choice, prompt_ids = out.choices[0], engine.tokenizer.encode(PROMPT)
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(prompt_ids)
    assert len(choice.logprobs.tokens) == len(prompt_ids) and "".join(choice.logprobs.tokens) == PROMPT
    assert choice.logprobs.token_logprobs[0] is None and all(v <= 0 for v in choice.logprobs.token_logprobs[1:])
    with_more = complete(http, max_tokens=1, echo=True, logprobs=1)["choices"][0]["logprobs"]
    assert choice.logprobs.token_logprobs == with_more["token_logprobs"][:-1]
    chunks = stream_chunks(http, "/v1/completions", {"prompt": PROMPT, "max_tokens": 0, "echo": True,
                                                     "temperature": 0, "stream_options": {"include_usage": True}})
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == PROMPT
    assert chunks[-1]["usage"]["completion_tokens"] == 0
    plain = complete(http, max_tokens=0, echo=True)
    assert plain["choices"][0]["text"] == PROMPT and plain["choices"][0]["logprobs"] is None


def test_text_offset_is_exact_when_a_character_spans_tokens(http, engine):
    """A character whose UTF-8 bytes are split over byte tokens: each of its tokens points at its
    offset, the next token past it, streamed and not."""
    prompt = "Weather: 🌦 ok"
    ids = engine.tokenizer.encode(prompt)
    split = [i for i in ids if not engine.tokenizer.convert_ids_to_tokens(i).isascii()]
    assert len(split) >= 2, "the emoji must span several tokens for this test to mean anything"
    body = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 0}
    lp = complete(http, **body)["choices"][0]["logprobs"]
    text_so_far, expected = b"", []
    for token in lp["tokens"]:  # the offset of each token: characters fully or partly before its first byte
        data = token[len("bytes:"):].encode().decode("unicode_escape").encode("latin-1") \
            if token.startswith("bytes:") else token.encode()
        expected.append(len(text_so_far.decode("utf-8", errors="ignore")))
        text_so_far += data
    assert text_so_far.decode() == prompt and lp["text_offset"] == expected
    assert len(set(lp["text_offset"])) < len(lp["text_offset"])  # two tokens share the emoji's offset
    streamed = [c["choices"][0]["logprobs"] for c in stream_chunks(http, "/v1/completions", {**body, "max_tokens": 2,
                                                                                           "temperature": 0})
                if c["choices"] and c["choices"][0]["logprobs"]]
    assert [o for f in streamed for o in f["text_offset"]][:len(expected)] == expected
