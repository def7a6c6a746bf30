"""``/tokenize``, ``/detokenize``, ``/tokenizer_info`` (as vLLM serves them) and
``slipstream tokenizer export``: the counts a tool gets are the ones the generation endpoints use."""
from __future__ import annotations

import subprocess
import sys

import pytest

from .harness import Http, assert_error

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def http(server):
    with Http(server.url) as client:
        yield client


def test_tokenize_a_prompt_counts_what_completions_bills(http):
    r = http.post("/tokenize", json={"prompt": "The quick brown fox"})
    assert r.status_code == 200, r.text
    body = r.json()
    usage = http.post("/v1/completions", json={"prompt": "The quick brown fox", "max_tokens": 1}).json()["usage"]
    assert body["count"] == len(body["tokens"]) == usage["prompt_tokens"]
    assert body["max_model_len"] == 512 and body["token_strs"] is None


def test_tokenize_messages_counts_what_chat_bills(http):
    body = http.post("/tokenize", json={"messages": CHAT}).json()
    usage = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1}).json()["usage"]
    assert body["count"] == usage["prompt_tokens"]
    without = http.post("/tokenize", json={"messages": CHAT, "add_generation_prompt": False}).json()
    assert without["count"] < body["count"]  # the opened assistant turn is gone


def test_chat_template_kwargs_reach_the_template_of_tokenize_and_chat(http, engine, monkeypatch):
    # The built-in template reads no variable of its own; for this test it reads ``system_hint``.
    hint = "{% if system_hint is defined %}<|im_start|>system\n{{ system_hint }}<|im_end|>\n{% endif %}"
    monkeypatch.setattr(engine.tokenizer, "chat_template", hint + engine.tokenizer.chat_template)
    plain = http.post("/tokenize", json={"messages": CHAT}).json()
    kwargs = {"chat_template_kwargs": {"system_hint": "Answer in French."}}
    hinted = http.post("/tokenize", json={"messages": CHAT, **kwargs})
    assert hinted.status_code == 200, hinted.text
    hinted = hinted.json()
    assert hinted["count"] > plain["count"] and hinted["tokens"][-plain["count"]:] == plain["tokens"]
    text = http.post("/detokenize", json={"tokens": hinted["tokens"]}).json()["prompt"]
    assert text.startswith("<|im_start|>system\nAnswer in French.<|im_end|>\n")
    usage = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1, **kwargs}).json()["usage"]
    assert usage["prompt_tokens"] == hinted["count"]  # the chat endpoint renders the same prompt


def test_detokenize_inverts_tokenize(http):
    text = "Grüße, 世界! 🎉"
    ids = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False,
                                       "return_token_strs": True}).json()
    assert len(ids["token_strs"]) == ids["count"]
    assert http.post("/detokenize", json={"tokens": ids["tokens"]}).json() == {"prompt": text}


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": CHAT}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "a", "model": "nope"}, "model"),
    ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/detokenize", {"tokens": [1], "extra": 1}, "extra"),
])
def test_bad_tokenizer_requests_name_the_field(http, path, body, param):
    status = 404 if param == "model" else 400
    assert_error(http.post(path, json=body), status, param=param)


def test_tokenizer_info_describes_the_served_tokenizer(http, engine):
    info = http.get("/tokenizer_info").json()
    tok = engine.tokenizer
    assert info["eos_token"] == tok.eos_token and info["vocab_size"] == len(tok)
    assert info["chat_template"] == tok.chat_template and info["model_max_length"] == 512
    assert str(tok.eos_token_id) in info["added_tokens_decoder"]


def test_exported_tokenizer_encodes_like_the_server(http, tmp_path):
    from transformers import AutoTokenizer

    run = subprocess.run([sys.executable, "-m", "slipstream.server", "tokenizer", "export", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    local = AutoTokenizer.from_pretrained(str(tmp_path))
    text = "Exported tokenizers must agree: ümlauts, 数字 123."
    assert local.encode(text) == http.post("/tokenize", json={"prompt": text}).json()["tokens"]
    rendered = local.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert local.encode(rendered, add_special_tokens=False) == \
        http.post("/tokenize", json={"messages": CHAT}).json()["tokens"]


def test_content_as_text_parts_renders_exactly_as_the_same_text_as_a_string(http):
    parts = [{"type": "text", "text": "What is the capital"}, {"type": "text", "text": " of France?"}]
    as_parts = http.post("/tokenize", json={"messages": [{"role": "system", "content": [parts[0]]},
                                                         {"role": "user", "content": parts}]}).json()
    as_text = http.post("/tokenize", json={"messages": [{"role": "system", "content": "What is the capital"},
                                                        {"role": "user", "content": "What is the capital of France?"}]}).json()
    assert as_parts["tokens"] == as_text["tokens"] and as_parts["count"] == as_text["count"]
    chat = {"max_tokens": 1, "temperature": 0}
    usage = [http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": c}], **chat}).json()
             ["usage"]["prompt_tokens"] for c in (parts, "What is the capital of France?")]
    assert usage[0] == usage[1]
