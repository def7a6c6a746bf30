"""``litellm.completion`` with an ``openai/`` model against a real ``slipstream serve``, plain and streamed."""
from __future__ import annotations

import pytest

litellm = pytest.importorskip("litellm", reason="litellm is not installed (pip install -e '.[test]')")


def test_completion_returns_text_and_usage(server):
    response = litellm.completion(model=f"openai/{server.model}", api_base=server.base_url, api_key=server.api_key,
                                  messages=[{"role": "user", "content": "Name a planet."}], max_tokens=12,
                                  temperature=0, num_retries=0)
    choice = response.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert 0 < response.usage.completion_tokens <= 12
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens


def test_streamed_completion_rebuilds_the_same_text_as_the_plain_one(server):
    kwargs = dict(model=f"openai/{server.model}", api_base=server.base_url, api_key=server.api_key, max_tokens=12,
                  temperature=0, num_retries=0, messages=[{"role": "user", "content": "Name a planet."}])
    plain = litellm.completion(**kwargs).choices[0].message.content
    chunks = list(litellm.completion(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert len(chunks) > 1
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain
    rebuilt = litellm.stream_chunk_builder(chunks)
    assert rebuilt.choices[0].message.content == plain
    assert 0 < rebuilt.usage.completion_tokens <= 12
