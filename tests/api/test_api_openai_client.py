"""The official ``openai`` client against the server: responses and streams shaped as OpenAI's."""
from __future__ import annotations

import openai
import pytest

from .harness import Http, assert_engine_idle, serve_app

CHAT = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(server):
    return server.state.model_name


def test_models_lists_the_served_model(client, server):
    models = client.models.list().data
    assert [m.id for m in models] == [server.state.model_name]
    assert models[0].object == "model"
    assert client.models.retrieve(server.state.model_name).id == server.state.model_name


def test_several_served_names_are_each_a_model_and_responses_give_the_first(loop_thread, engine):
    """vLLM's ``--served-model-name A B``: a request may name either; /v1/models lists both."""
    with serve_app(loop_thread, engine, served_model_names=("chat", "chat-v1")) as served:
        client = openai.OpenAI(base_url=served.v1, api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["chat", "chat-v1"]
        assert client.models.retrieve("chat-v1").id == "chat-v1"
        reply = client.chat.completions.create(model="chat-v1", messages=CHAT, max_tokens=2, temperature=0)
        assert reply.model == "chat"
        with pytest.raises(openai.NotFoundError) as info:
            client.completions.create(model=engine.model_name, prompt="x", max_tokens=1)
        assert "This server serves `chat`, `chat-v1`" in info.value.message
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("chat-v2")


def test_chat_completion_uses_the_chat_template_and_reports_usage(client, model, server):
    tokenizer = server.llm.tokenizer
    out = client.chat.completions.create(model=model, messages=CHAT, max_tokens=5, temperature=0)
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-") and out.model == model
    assert len(out.choices) == 1
    choice = out.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    prompt = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert out.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))
    assert 1 <= out.usage.completion_tokens <= 5
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_chat_greedy_matches_the_offline_engine(client, model, server):
    out = client.chat.completions.create(model=model, messages=CHAT, max_tokens=6, temperature=0)
    tokenizer = server.llm.tokenizer
    prompt = tokenizer.encode(tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False),
                              add_special_tokens=False)
    # Same prompt ids via the completions endpoint must give the same greedy text.
    raw = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0)
    assert raw.choices[0].text == out.choices[0].message.content


def test_chat_stream_opens_with_role_and_ends_with_finish_and_usage(client, model, server):
    chunks = list(client.chat.completions.create(model=model, messages=CHAT, max_tokens=6, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert len({c.id for c in chunks}) == 1 and all(c.object == "chat.completion.chunk" for c in chunks)
    first = chunks[0].choices[0]
    assert first.delta.role == "assistant" and first.delta.content == "" and first.finish_reason is None
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes in (["stop"], ["length"])
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens >= 1
    assert all(c.usage is None for c in chunks[:-1])
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    full = client.chat.completions.create(model=model, messages=CHAT, max_tokens=6, temperature=0)
    assert text == full.choices[0].message.content
    assert usage_chunk.usage.completion_tokens == full.usage.completion_tokens


def test_stream_without_include_usage_has_no_usage(client, model):
    chunks = list(client.completions.create(model=model, prompt="Once upon a time", max_tokens=4, stream=True))
    assert chunks and all(c.choices for c in chunks)
    assert all(getattr(c, "usage", None) is None for c in chunks)


def test_completion_non_streaming_and_streaming_agree(client, model):
    out = client.completions.create(model=model, prompt="The capital of France is", max_tokens=5, temperature=0)
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 5
    chunks = list(client.completions.create(model=model, prompt="The capital of France is", max_tokens=5,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == out.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n2_returns_two_choices_and_streams_carry_each_index(client, model):
    out = client.chat.completions.create(model=model, messages=CHAT, max_tokens=4, n=2, temperature=1.0, seed=3)
    assert [c.index for c in out.choices] == [0, 1]
    chunks = list(client.chat.completions.create(model=model, messages=CHAT, max_tokens=4, n=2, temperature=1.0,
                                                 seed=3, stream=True, stream_options={"include_usage": True}))
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role == "assistant"]
    assert sorted(roles) == [0, 1]
    finished = sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason)
    assert finished == [0, 1]
    texts = {i: "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
             for i in (0, 1)}
    assert texts == {c.index: c.message.content for c in out.choices}  # same seed, same samples
    assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens


def test_completion_n2_with_two_prompts_indexes_choices_per_prompt(client, model):
    out = client.completions.create(model=model, prompt=["Hello", "Goodbye"], max_tokens=3, n=2, temperature=0)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.choices[0].text == out.choices[1].text  # greedy: both choices of a prompt agree
    assert out.usage.completion_tokens == 12


def test_stop_string_ends_the_choice_and_is_not_returned(client, model):
    base = client.completions.create(model=model, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0)
    text = base.choices[0].text
    assert len(text) >= 6
    stop = text[3:6]
    cut = text.index(stop)
    out = client.completions.create(model=model, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=[stop])
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == text[:cut]


def test_seed_makes_sampling_reproducible(client, model):
    def sample(seed):
        return client.completions.create(model=model, prompt="Tell me a story:", max_tokens=8, temperature=1.0,
                                         seed=seed).choices[0].text
    assert sample(7) == sample(7)
    assert len({sample(s) for s in (1, 2, 3)}) > 1


def test_chat_logprobs_give_top_alternatives(client, model):
    out = client.chat.completions.create(model=model, messages=CHAT, max_tokens=3, temperature=0, logprobs=True,
                                         top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.token == entry.top_logprobs[0].token  # greedy picks the most likely token
    assert "".join(e.token for e in content) == out.choices[0].message.content


def test_completion_logprobs_have_offsets(client, model):
    out = client.completions.create(model=model, prompt="Hello", max_tokens=3, temperature=0, logprobs=1)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == 3
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == out.choices[0].text


def test_prompt_as_token_ids(client, model, server):
    ids = server.llm.tokenizer.encode("The sky is")
    a = client.completions.create(model=model, prompt=ids, max_tokens=3, temperature=0)
    assert a.usage.prompt_tokens == len(ids)


def test_default_noop_fields_and_nulls_are_accepted(server, model):
    body = {"model": model, "messages": CHAT, "max_tokens": 2, "user": "u1", "store": False, "metadata": {},
            "parallel_tool_calls": True, "logit_bias": {}, "stream_options": None,
            "temperature": None, "top_p": None, "stop": None, "seed": None, "tools": None, "response_format":
            {"type": "text"}, "n": None, "presence_penalty": None, "frequency_penalty": None}
    r = Http(server.url).post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["role"] == "assistant"


def test_vllm_style_sampling_fields(client, model):
    out = client.completions.create(model=model, prompt="Hi", max_tokens=6, temperature=0.8, top_p=0.9,
                                    extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
                                                "min_tokens": 6, "ignore_eos": True})
    assert out.usage.completion_tokens == 6 and out.choices[0].finish_reason == "length"


def test_engine_is_idle_after_the_module(server):
    assert_engine_idle(server.llm)
