"""The official ``openai`` client against a real ``slipstream serve``: structured output parsed into
pydantic objects, forced tool calls with schema-valid arguments, streamed usage, the Responses API."""
from __future__ import annotations

import json
from typing import Literal

import pytest
from pydantic import BaseModel, Field

openai = pytest.importorskip("openai", reason="the openai client is not installed (pip install -e '.[test]')")
jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is not installed")


class City(BaseModel):
    """Every field bounded, so that even a 135M model ends the object within max_tokens."""

    name: str = Field(max_length=24)
    continent: Literal["Africa", "America", "Asia", "Europe", "Oceania"]
    is_capital: bool
    founded: int = Field(ge=-3000, le=2026)


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key=server.api_key, max_retries=0, timeout=120)


def _parse(client):
    """``client.chat.completions.parse`` in openai>=1.92, ``client.beta.chat.completions.parse`` before."""
    return getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse


def test_chat_completions_parse_returns_the_pydantic_object(client, server):
    completion = _parse(client)(
        model=server.model, max_tokens=80, temperature=0,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}], response_format=City)
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, City)
    assert City.model_validate_json(message.content) == message.parsed


def test_streamed_structured_output_concatenates_to_a_valid_object(client, server):
    with client.chat.completions.stream(
            model=server.model, max_tokens=80, temperature=0,
            messages=[{"role": "user", "content": "Describe Rome as JSON."}], response_format=City) as stream:
        deltas = [event.delta for event in stream if event.type == "content.delta"]
        final = stream.get_final_completion()
    assert len(deltas) > 1
    assert isinstance(final.choices[0].message.parsed, City)
    assert City.model_validate_json("".join(deltas)) == final.choices[0].message.parsed


def test_tool_choice_required_returns_tool_calls_whose_arguments_validate(client, server):
    completion = client.chat.completions.create(
        model=server.model, max_tokens=120, temperature=0, tools=[WEATHER_TOOL], tool_choice="required",
        parallel_tool_calls=False, messages=[{"role": "user", "content": "What is the weather in Oslo?"}])
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_TOOL["function"]["parameters"])


def test_a_named_tool_choice_is_streamed_as_tool_call_deltas(client, server):
    stream = client.chat.completions.create(
        model=server.model, max_tokens=120, temperature=0, tools=[WEATHER_TOOL], stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, parallel_tool_calls=False,
        messages=[{"role": "user", "content": "Weather in Lima, please."}])
    name, arguments, finish = "", "", None
    for chunk in stream:
        for call in chunk.choices[0].delta.tool_calls or []:
            assert call.index == 0
            name += call.function.name or ""
            arguments += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (name, finish) == ("get_weather", "tool_calls")
    jsonschema.validate(json.loads(arguments), WEATHER_TOOL["function"]["parameters"])


def test_stream_with_include_usage_ends_with_a_usage_chunk_matching_the_text(client, server):
    stream = client.chat.completions.create(
        model=server.model, max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "Count from one to ten."}])
    chunks = list(stream)
    *content, last = chunks
    assert last.choices == [] and last.usage is not None
    assert all(c.usage is None for c in content)
    assert last.usage.completion_tokens == 12
    assert last.usage.total_tokens == last.usage.prompt_tokens + 12
    text = "".join(c.choices[0].delta.content or "" for c in content)
    assert text and content[-1].choices[0].finish_reason == "length"


def test_continuous_usage_stats_put_usage_on_every_chunk(client, server):
    stream = client.chat.completions.create(
        model=server.model, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"stream_options": {
            "include_usage": True, "continuous_usage_stats": True}},
        messages=[{"role": "user", "content": "Say hello."}])
    chunks = list(stream)
    assert all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 8


def test_responses_create_returns_output_text_and_usage(client, server):
    response = client.responses.create(model=server.model, input="Name a color.", instructions="Answer briefly.",
                                       max_output_tokens=16, temperature=0)
    assert response.object == "response" and response.output_text
    assert response.usage.output_tokens <= 16
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens


def test_responses_parse_returns_the_pydantic_object(client, server):
    response = client.responses.parse(model=server.model, input="Describe Berlin as JSON.", text_format=City,
                                      max_output_tokens=80, temperature=0)
    assert response.status == "completed"
    assert isinstance(response.output_parsed, City)


def test_responses_stream_emits_the_documented_events(client, server):
    # max_output_tokens cuts it: the last event is response.incomplete (the SDK's get_final_response
    # accepts only response.completed), carrying the whole response.
    events = list(client.responses.create(model=server.model, input="Say hi.", max_output_tokens=8, temperature=0,
                                          stream=True))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas and deltas == final.output_text
    assert final.usage.output_tokens == 8 and final.incomplete_details.reason == "max_output_tokens"
