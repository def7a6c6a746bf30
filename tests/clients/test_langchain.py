"""``langchain-openai``'s ChatOpenAI against a real ``slipstream serve``: invoke, stream, structured output
(json_schema and function calling) and bound tools, as LangChain applications use them."""
from __future__ import annotations

from typing import Literal

import pytest
from pydantic import BaseModel, Field

langchain_openai = pytest.importorskip(
    "langchain_openai", reason="langchain-openai is not installed (pip install -e '.[test]')")
jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is not installed")


class Pet(BaseModel):
    """A pet, every field bounded so that a 135M model ends the object within max_tokens."""

    name: str = Field(max_length=16)
    species: Literal["cat", "dog", "fish", "bird"]
    age: int = Field(ge=0, le=30)


class GetWeather(BaseModel):
    """Current weather of a city."""

    city: str = Field(max_length=32)
    unit: Literal["celsius", "fahrenheit"]


@pytest.fixture(scope="module")
def chat(server):
    return langchain_openai.ChatOpenAI(base_url=server.base_url, api_key=server.api_key, model=server.model,
                                       temperature=0, max_tokens=64, max_retries=0, timeout=120)


def test_invoke_returns_an_ai_message_with_token_usage(chat):
    message = chat.invoke("Name one fruit.")
    assert isinstance(message.content, str) and message.content
    usage = message.usage_metadata
    assert usage["input_tokens"] > 0 and 0 < usage["output_tokens"] <= 64
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert message.response_metadata["model_name"] == "smollm2"


def test_stream_yields_chunks_that_add_up_to_the_message(chat):
    chunks = list(chat.bind(max_tokens=10).stream("Say something about the sea."))
    assert len(chunks) > 1
    total = chunks[0]
    for chunk in chunks[1:]:
        total += chunk
    assert total.content == "".join(c.content for c in chunks) and total.content
    assert total.response_metadata["finish_reason"] == "length"


def test_with_structured_output_json_schema_returns_the_pydantic_object(chat):
    pet = chat.with_structured_output(Pet, method="json_schema", strict=True).invoke(
        "Invent a pet and describe it.")
    assert isinstance(pet, Pet)


@pytest.mark.slow
def test_with_structured_output_function_calling_returns_the_pydantic_object(chat):
    # function calling forces the one tool by name: the grammar makes its arguments valid
    pet = chat.with_structured_output(Pet, method="function_calling").invoke("Invent a pet and describe it.")
    assert isinstance(pet, Pet)


@pytest.mark.slow
def test_bind_tools_with_forced_choice_returns_tool_calls(chat):
    message = chat.bind_tools([GetWeather], tool_choice="GetWeather", parallel_tool_calls=False).invoke(
        "What is the weather in Madrid?")
    assert len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert call["name"] == "GetWeather" and call["id"]
    GetWeather.model_validate(call["args"])
    assert message.response_metadata["finish_reason"] == "tool_calls"


@pytest.mark.slow
def test_bind_tools_with_required_choice_streams_tool_call_chunks(chat):
    chunks = list(chat.bind_tools([GetWeather], tool_choice="required", parallel_tool_calls=False).stream(
        "Weather in Cairo?"))
    total = chunks[0]
    for chunk in chunks[1:]:
        total += chunk
    assert [c["name"] for c in total.tool_calls] == ["GetWeather"]
    GetWeather.model_validate(total.tool_calls[0]["args"])
