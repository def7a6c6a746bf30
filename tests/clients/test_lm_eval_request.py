"""lm-evaluation-harness's log-likelihood request (``local-completions``), sent as lm-eval 0.4.13 sends
it, read as it reads it: ``{"prompt": [token ids], "max_tokens": 1, "logprobs": 1, "echo": true}``, then
``sum(token_logprobs[ctxlen:-1])`` (lm_eval/models/openai_completions.py) — the last entry taken to be
the sampled token's. benchmarks/clients.py compares the scores with transformers on the same weights."""
from __future__ import annotations

import pytest
import requests


def _tokenize(server, text: str) -> list[int]:
    r = requests.post(server.url + "/tokenize", json={"model": server.model, "prompt": text},
                      headers={"Authorization": f"Bearer {server.api_key}"}, timeout=30)
    r.raise_for_status()
    return r.json()["tokens"]


def _score(server, ids: list[int]) -> dict:
    r = requests.post(server.base_url + "/completions", headers={"Authorization": f"Bearer {server.api_key}"},
                      json={"model": server.model, "prompt": ids, "max_tokens": 1, "logprobs": 1, "echo": True,
                            "temperature": 0, "seed": 1234}, timeout=60)
    r.raise_for_status()
    return r.json()["choices"][0]


def test_echo_scores_every_prompt_token_but_the_first_and_then_the_sampled_one(server):
    context = _tokenize(server, "Question: What is the capital of France?\nAnswer:")
    ids = context + _tokenize(server, " Paris")
    choice = _score(server, ids)
    assert choice["finish_reason"] == "length"  # the sampled token is not EOS here
    logprobs = choice["logprobs"]
    assert len(logprobs["token_logprobs"]) == len(ids) + 1
    assert logprobs["token_logprobs"][0] is None  # nothing predicts the first token
    assert all(lp <= 0 for lp in logprobs["token_logprobs"][1:])
    continuation = logprobs["token_logprobs"][len(context):-1]  # lm-eval's slice
    assert len(continuation) == len(ids) - len(context)


def test_echo_keeps_the_sampled_tokens_entry_when_it_is_eos(server):
    # greedy after "Answer: spring" is the end of the turn: the one sampled token is EOS
    context = _tokenize(server, "Question: Which season comes after winter?\nAnswer:")
    ids = context + _tokenize(server, " spring")
    choice = _score(server, ids)
    assert choice["finish_reason"] == "stop"
    assert len(choice["logprobs"]["token_logprobs"]) == len(ids) + 1
    assert choice["logprobs"]["token_logprobs"][len(context):-1] != []
