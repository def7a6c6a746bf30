"""``POST /v1/responses`` (issue 13 item 6) with the built-in model, through the official ``openai``
client and raw HTTP: the same prompt as the equivalent chat request, OpenAI's response object and
named stream events, function tools, ``text.format`` structured output, the bounded store behind
``previous_response_id``, and 400s naming the Responses field."""
from __future__ import annotations

import json
import typing

import jsonschema
import openai
import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from slipstream.server.api.serving_responses import OutputItems, ResponseStore
from slipstream.server.api.tools import get_parser

from .harness import Http, assert_engine_idle, assert_error

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 40},
               "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
               "required": ["city", "unit"], "additionalProperties": False}}
ASK = "What is the weather in Paris?"
# The openai package's model of each stream event, by its type (validated strictly, unlike the client's parsing).
EVENT_MODELS = {typing.get_args(m.model_fields["type"].annotation)[0]: m
                for m in typing.get_args(typing.get_args(ResponseStreamEvent)[0])}


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    age: int = pydantic.Field(ge=0, le=150)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with Http(server.url) as session:
        yield session


@pytest.fixture(scope="module")
def weather_call(client):
    """A response whose one output item is a forced get_weather call (the grammar makes it valid)."""
    return client.responses.create(input=ASK, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                                   max_output_tokens=120, temperature=0)


def chat(http, messages, **fields) -> dict:
    r = http.post("/v1/chat/completions", json={"messages": messages, "temperature": 0, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def events_of(http, body: dict) -> list[dict]:
    """The events of a streamed response: each ``event:`` line's name checked against its data."""
    r = http.post("/v1/responses", json={**body, "stream": True}, stream=True)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    events, name = [], None
    for line in r.iter_lines(decode_unicode=True):
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            assert line != "data: [DONE]", "the Responses API ends a stream without [DONE]"
            event = json.loads(line[len("data: "):])
            assert event["type"] == name, (name, event)
            EVENT_MODELS[name].model_validate(event)
            events.append(event)
        elif line.startswith(": "):  # an SSE comment (clients skip it): the usage, last, for a gateway
            assert json.loads(line[2:])["usage"]["completion_tokens"] == events[-1]["response"]["usage"]["output_tokens"]
        else:
            assert line == "", line
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def output_text(body: dict) -> str:
    return "".join(p["text"] for item in body["output"] if item["type"] == "message" for p in item["content"])


def test_text_input_is_the_user_turn_of_the_equivalent_chat_request(client, http, server):
    out = client.responses.create(model=server.state.model_name, input="Name three colors.", max_output_tokens=12,
                                  temperature=0)
    want = chat(http, [{"role": "user", "content": "Name three colors."}], max_tokens=12)
    assert out.object == "response" and out.id.startswith("resp_") and out.model == server.state.model_name
    message = out.output[0]
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.content[0].type == "output_text" and message.content[0].annotations == []
    assert out.output_text == want["choices"][0]["message"]["content"]
    assert out.usage.input_tokens == want["usage"]["prompt_tokens"]
    assert out.usage.output_tokens == want["usage"]["completion_tokens"]
    assert out.usage.total_tokens == out.usage.input_tokens + out.usage.output_tokens
    assert out.usage.output_tokens_details.reasoning_tokens == 0 and out.error is None
    assert_engine_idle(server.llm)


def test_items_with_instructions_render_as_system_message_then_turns(client, http):
    items = [{"role": "user", "content": "Hi, I am Ann."},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello Ann!"}]},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is my name?"}]}]
    out = client.responses.create(input=items, instructions="Answer briefly.", max_output_tokens=10, temperature=0)
    want = chat(http, [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hi, I am Ann."},
                       {"role": "assistant", "content": "Hello Ann!"}, {"role": "user", "content": "What is my name?"}],
                max_tokens=10)
    assert out.instructions == "Answer briefly."
    assert out.output_text == want["choices"][0]["message"]["content"]
    assert out.usage.input_tokens == want["usage"]["prompt_tokens"]


def test_max_output_tokens_cut_makes_the_response_incomplete(client):
    out = client.responses.create(input="Tell me a long story.", max_output_tokens=3, temperature=0)
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.usage.output_tokens == 3 and out.max_output_tokens == 3
    assert out.output[0].status == "incomplete" and out.output_text


def test_response_echoes_the_request_settings(client):
    out = client.responses.create(input="Hi", max_output_tokens=2, temperature=0.5, top_p=0.9,
                                  metadata={"run": "7"}, tools=[WEATHER], tool_choice="none", store=False)
    assert (out.temperature, out.top_p, out.metadata, out.tool_choice) == (0.5, 0.9, {"run": "7"}, "none")
    assert out.tools[0].name == "get_weather" and out.tools[0].parameters == WEATHER["parameters"]
    assert out.text.format.type == "text" and out.parallel_tool_calls is True and out.previous_response_id is None


def test_stream_events_come_in_documented_order_and_deltas_add_up_to_the_response(http):
    body = {"input": "Name three colors.", "max_output_tokens": 12, "temperature": 0}
    events = events_of(http, body)
    kinds = [e["type"] for e in events]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert deltas and kinds == ["response.created", "response.in_progress", "response.output_item.added",
                                "response.content_part.added", *["response.output_text.delta"] * len(deltas),
                                "response.output_text.done", "response.content_part.done",
                                "response.output_item.done", kinds[-1]]
    created, final = events[0]["response"], events[-1]["response"]
    assert created["status"] == "in_progress" and created["output"] == [] and created["id"] == final["id"]
    assert kinds[-1] == f"response.{final['status']}" and final["status"] in ("completed", "incomplete")
    item_id = events[2]["item"]["id"]
    assert all(d["item_id"] == item_id and d["output_index"] == 0 and d["content_index"] == 0
               and d["logprobs"] == [] for d in deltas)
    text = "".join(d["delta"] for d in deltas)
    assert text == events[-4]["text"] == output_text(final)
    assert events[-2]["item"] == final["output"][0]
    whole = http.post("/v1/responses", json=body).json()
    Response.model_validate(whole)  # every field the openai package requires, with its type
    assert output_text(whole) == text and whole["usage"]["output_tokens"] == final["usage"]["output_tokens"]


@pytest.mark.slow
def test_openai_client_stream_yields_typed_events_with_the_final_response(client, server):
    with client.responses.stream(model=server.state.model_name, input=ASK, tools=[WEATHER], tool_choice="required",
                                 parallel_tool_calls=False, max_output_tokens=120, temperature=0) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert final.status == "completed" and [item.type for item in final.output] == ["function_call"]


def test_parse_with_a_pydantic_model_returns_the_parsed_object(client):
    out = client.responses.parse(input="Invent a person: name and age.", text_format=Person, max_output_tokens=60,
                                 temperature=0)
    assert out.status == "completed" and out.text.format.type == "json_schema"
    assert isinstance(out.output_parsed, Person)
    assert Person.model_validate_json(out.output_text) == out.output_parsed


def test_json_object_format_constrains_the_output_to_an_object(client):
    plain = client.responses.create(input="Describe a cat.", max_output_tokens=8, temperature=0)
    out = client.responses.create(input="Describe a cat.", max_output_tokens=8, temperature=0,
                                  text={"format": {"type": "json_object"}})
    assert not plain.output_text.lstrip().startswith("{")  # unconstrained, the model writes prose
    assert out.output_text.lstrip().startswith("{") and out.text.format.type == "json_object"


@pytest.mark.slow
def test_required_tool_choice_returns_a_function_call_whose_arguments_validate(weather_call, server):
    out = weather_call
    assert out.status == "completed" and len(out.output) == 1
    call = out.output[0]
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    assert_engine_idle(server.llm)


@pytest.mark.slow
def test_named_tool_choice_calls_that_function(client):
    time_tool = {"type": "function", "name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string", "maxLength": 12}}, "required": ["tz"]}}
    out = client.responses.create(input=ASK, tools=[WEATHER, time_tool], max_output_tokens=120, temperature=0,
                                  tool_choice={"type": "function", "name": "get_time"})
    assert [(item.type, item.name) for item in out.output] == [("function_call", "get_time")]


@pytest.mark.slow
def test_function_call_output_goes_back_as_the_tool_turn_of_the_chat_template(client, http, weather_call):
    call = weather_call.output[0]
    # the output item goes back as the client holds it, as OpenAI's function-calling guide does
    items = [{"role": "user", "content": ASK}, call,
             {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees, sunny"}]
    out = client.responses.create(input=items, tools=[WEATHER], max_output_tokens=20, temperature=0)
    want = chat(http, [{"role": "user", "content": ASK},
                       {"role": "assistant", "content": None, "tool_calls": [
                           {"id": call.call_id, "type": "function",
                            "function": {"name": call.name, "arguments": call.arguments}}]},
                       {"role": "tool", "tool_call_id": call.call_id, "content": "18 degrees, sunny"}],
                max_tokens=20, tools=[{"type": "function", "function": {
                    k: v for k, v in WEATHER.items() if k != "type"}}])
    assert out.usage.input_tokens == want["usage"]["prompt_tokens"]
    assert out.output_text == (want["choices"][0]["message"]["content"] or "")


@pytest.mark.slow
def test_streamed_function_call_arguments_add_up_to_the_call(http):
    events = events_of(http, {"input": ASK, "tools": [WEATHER], "tool_choice": "required",
                              "parallel_tool_calls": False, "max_output_tokens": 120, "temperature": 0})
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert events[2]["item"]["type"] == "function_call" and events[2]["item"]["arguments"] == ""
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    arguments = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    final = events[-1]["response"]["output"][0]
    assert arguments == events[-3]["arguments"] == final["arguments"]
    jsonschema.validate(json.loads(arguments), WEATHER["parameters"])


def test_previous_response_id_continues_the_stored_conversation(client, http):
    first = client.responses.create(input="My name is Ann.", instructions="Be brief.", max_output_tokens=8,
                                    temperature=0)
    second = client.responses.create(input="What is my name?", previous_response_id=first.id, max_output_tokens=8,
                                     temperature=0)
    # OpenAI's rule: the earlier instructions are not carried over, the earlier turns are.
    want = chat(http, [{"role": "user", "content": "My name is Ann."},
                       {"role": "assistant", "content": first.output_text},
                       {"role": "user", "content": "What is my name?"}], max_tokens=8)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == want["usage"]["prompt_tokens"]
    assert second.output_text == want["choices"][0]["message"]["content"]


def test_a_response_with_store_false_cannot_be_continued(client, http):
    first = client.responses.create(input="Hi", max_output_tokens=2, store=False)
    r = http.post("/v1/responses", json={"input": "Again", "previous_response_id": first.id})
    assert_error(r, 400, param="previous_response_id", code="previous_response_not_found")


def test_client_disconnect_mid_stream_aborts_the_generation(http, server):
    r = http.post("/v1/responses", json={"input": "Tell me a long story.", "max_output_tokens": 400,
                                         "stream": True}, stream=True)
    assert r.status_code == 200
    next(r.iter_lines())
    r.close()
    assert_engine_idle(server.llm, timeout=30)  # the abort lands at the next token; slow on a loaded machine


ITEM = {"role": "user", "content": "Hi"}


@pytest.mark.parametrize("body, param, code", [
    ({"input": "x", "frobnicate": 1}, "frobnicate", "unknown_parameter"),
    ({"input": [{"role": "user", "content": "x", "nmae": "a"}]}, "input[0].nmae", "unknown_parameter"),
    ({}, "input", "missing_required_parameter"),
    ({"input": []}, "input", None),
    ({"input": "x", "tool_choice": "always"}, "tool_choice", None),
    ({"input": "x", "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "tools": [WEATHER]},
     "tool_choice", None),
    ({"input": "x", "tool_choice": {"type": "function", "name": "get_time"}, "tools": [WEATHER]}, "tool_choice",
     None),
    ({"input": "x", "tool_choice": "required"}, "tool_choice", None),
    ({"input": "x", "tools": [WEATHER, WEATHER]}, "tools[1].name", None),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type", None),
    ({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": {"type": "nonsense"}}],
      "tool_choice": "required"}, "tools[0].parameters", "invalid_function_parameters"),
    ({"input": "x", "previous_response_id": "resp_unknown"}, "previous_response_id", "previous_response_not_found"),
    ({"input": [ITEM, {"type": "function_call_output", "call_id": "call_x", "output": "1"}]}, "input[1].call_id",
     None),
    ({"input": [ITEM, {"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]},
     "input[1].arguments", None),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input[0].content[0].type", None),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type", None),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", None),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", None),
    ({"input": "x", "temperature": 2.5}, "temperature", None),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "p"}}}, "text.format.schema",
     "missing_required_parameter"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format.type", None),
    ({"input": "x", "stream_options": {"include_obfuscation": False}}, "stream_options", None),
    ({"input": "x", "truncation": "auto"}, "truncation", None),
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning", None),
    ({"input": "x", "include": ["message.output_text.logprobs"]}, "include", None),
    ({"input": "x", "background": True}, "background", None),
    ({"input": "x", "metadata": {str(i): "v" for i in range(17)}}, "metadata", None),
    ({"input": "x", "model": "gpt-4o"}, "model", "model_not_found"),
])
def test_bad_requests_are_400s_naming_the_responses_field(http, body, param, code):
    r = http.post("/v1/responses", json=body)
    error = assert_error(r, 404 if code == "model_not_found" else 400, param=param, code=code)
    assert "messages[" not in error["message"]  # chat paths are named as the Responses request names them


def test_no_op_fields_are_accepted(http):
    r = http.post("/v1/responses", json={
        "input": "Hi", "max_output_tokens": 2, "user": "u", "prompt_cache_key": "k", "safety_identifier": "s",
        "service_tier": "auto", "truncation": "disabled", "include": ["reasoning.encrypted_content"],
        "reasoning": {"effort": None}, "text": {"format": {"type": "text"}, "verbosity": "low"}, "max_tool_calls": 3,
        "stream": False, "parallel_tool_calls": False})
    assert r.status_code == 200, r.text
    assert r.json()["user"] == "u" and r.json()["parallel_tool_calls"] is False


def test_a_stored_response_is_retrieved_by_id_and_an_unknown_one_is_a_404(client, http):
    created = client.responses.create(input="Name a color.", max_output_tokens=4, temperature=0)
    again = client.responses.retrieve(created.id)
    assert again.model_dump() == created.model_dump()
    streamed = [e for e in events_of(http, {"input": "Hi", "max_output_tokens": 2, "temperature": 0})
                if e["type"] in ("response.completed", "response.incomplete")][0]["response"]
    assert client.responses.retrieve(streamed["id"]).model_dump(exclude_none=True)["output"] == streamed["output"]
    unstored = client.responses.create(input="Hi", max_output_tokens=2, temperature=0, store=False)
    for missing in (unstored.id, "resp_nothing"):
        with pytest.raises(openai.NotFoundError) as info:
            client.responses.retrieve(missing)
        assert info.value.body["param"] == "response_id" and info.value.body["code"] == "not_found"


def test_store_drops_the_least_recently_used_response_first():
    store = ResponseStore(max_responses=2)
    for rid in ("a", "b"):
        store.put(rid, [{"type": "message", "role": "user", "content": rid}], {"id": rid})
    assert store.get("a") is not None  # "a" now most recently used
    store.put("c", [], {"id": "c"})
    assert store.get("b") is None and store.get("a") is not None and len(store) == 2
    assert store.response("c") == {"id": "c"} and store.response("b") is None


def test_store_is_bounded_by_bytes():
    store = ResponseStore(max_bytes=200)
    store.put("a", [{"type": "message", "role": "user", "content": "x" * 120}], {})
    store.put("b", [{"type": "message", "role": "user", "content": "y" * 120}], {})
    assert store.get("a") is None and store.get("b") is not None
    store.put("huge", [{"type": "message", "role": "user", "content": "z" * 300}], {})
    assert store.get("huge") is None and store.get("b") is not None


def test_text_after_a_call_opens_a_second_message_item():
    out = OutputItems(get_parser("hermes").stream())
    events = out.feed('Sure.<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\nDone.')
    events += out.finish(incomplete=False)
    assert [i["type"] for i in out.items] == ["message", "function_call", "message"]
    assert [i["content"][0]["text"] for i in out.items if i["type"] == "message"] == ["Sure.", "Done."]
    assert out.items[1]["arguments"] == '{"a":1}' and all(i["status"] == "completed" for i in out.items)
    added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["output_index"] for e in events if e["type"] == "response.output_item.done"]
    assert added == done == [0, 1, 2]


def test_an_empty_output_is_one_empty_message_marked_incomplete_when_cut():
    out = OutputItems(None)
    events = out.finish(incomplete=True)
    assert out.items == [{"id": out.items[0]["id"], "type": "message", "status": "incomplete", "role": "assistant",
                          "content": [{"type": "output_text", "text": "", "annotations": []}]}]
    assert [e["type"] for e in events] == ["response.output_item.added", "response.content_part.added",
                                           "response.output_text.done", "response.content_part.done",
                                           "response.output_item.done"]
