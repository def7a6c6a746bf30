"""Tool calls and structured outputs over HTTP with the built-in model: forced tool choices and
``response_format`` schemas come back schema-valid (the grammar makes even a 135M model comply),
whole and streamed; tool turns go back into the prompt."""
from __future__ import annotations

import json

import jsonschema
import pytest

from .harness import Http, assert_engine_idle, assert_error
from .test_api_vllm_fields import stream_chunks

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a timezone",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 30}},
                   "required": ["tz"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 30}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}},
    "required": ["name", "age", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def http(server):
    with Http(server.url) as client:
        yield client


def chat(http, **fields) -> dict:
    r = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 120, "temperature": 0, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def assert_valid_call(call: dict, tools: list[dict]) -> dict:
    """An OpenAI tool call to a declared tool whose arguments validate; returns the arguments."""
    assert call["type"] == "function" and call["id"]
    declared = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert call["function"]["name"] in declared
    args = json.loads(call["function"]["arguments"])
    jsonschema.validate(args, declared[call["function"]["name"]])
    return args


def test_required_tool_choice_returns_schema_valid_calls(http, server):
    body = chat(http, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    calls = choice["message"]["tool_calls"]
    assert calls and choice["message"]["content"] is None
    for call in calls:
        assert_valid_call(call, [WEATHER, TIME])
    assert_engine_idle(server.llm)


def test_named_tool_choice_calls_exactly_that_function(http):
    named = {"type": "function", "function": {"name": "get_time"}}
    calls = chat(http, tools=[WEATHER, TIME], tool_choice=named)["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_time"]
    assert_valid_call(calls[0], [TIME])


def test_streamed_tool_call_deltas_add_up_to_the_whole_call(http):
    whole = chat(http, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    call = whole["choices"][0]["message"]["tool_calls"][0]
    chunks = stream_chunks(http, "/v1/chat/completions", {
        "messages": ASK, "max_tokens": 120, "temperature": 0, "tools": [WEATHER], "tool_choice": "required",
        "parallel_tool_calls": False})
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    parts = [d["tool_calls"][0] for d in deltas if d.get("tool_calls")]
    assert parts[0]["id"] and parts[0]["function"]["name"] == "get_weather" and parts[0]["type"] == "function"
    assert all(p["index"] == 0 for p in parts)
    assert "".join(p["function"].get("arguments", "") for p in parts) == call["function"]["arguments"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert not "".join(d.get("content") or "" for d in deltas)


# Two calls in the hermes format; a one-string choice makes the model write exactly this.
TWO_CALLS = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>')


def test_parallel_tool_calls_false_under_auto_returns_only_the_first_call_whole_and_streamed(http):
    forced = {"tools": [WEATHER, TIME], "tool_choice": "auto", "structured_outputs": {"choice": [TWO_CALLS]},
              "max_tokens": 200}
    both = chat(http, **forced)["choices"][0]
    assert [c["function"]["name"] for c in both["message"]["tool_calls"]] == ["get_weather", "get_time"]
    one = chat(http, **forced, parallel_tool_calls=False)["choices"][0]
    assert one["finish_reason"] == "tool_calls" and one["message"]["content"] is None
    (call,) = one["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city":"Paris","unit":"celsius"}'}
    chunks = stream_chunks(http, "/v1/chat/completions", {"messages": ASK, "temperature": 0, **forced,
                                                          "parallel_tool_calls": False})
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    parts = [p for d in deltas for p in d.get("tool_calls") or []]
    assert parts and all(p["index"] == 0 for p in parts)  # no delta of the second call
    assert [p["function"]["name"] for p in parts if "id" in p] == ["get_weather"]
    assert "".join(p["function"].get("arguments", "") for p in parts) == call["function"]["arguments"]
    assert not "".join(d.get("content") or "" for d in deltas)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_tool_none_leaves_plain_text_and_auto_answers(http):
    none = chat(http, tools=[WEATHER], tool_choice="none", max_tokens=20)["choices"][0]
    assert "tool_calls" not in none["message"] and none["message"]["content"]
    auto = chat(http, tools=[WEATHER], max_tokens=60)["choices"][0]  # the model decides; either is fine
    assert auto["message"].get("tool_calls") or auto["message"]["content"]


def test_a_tool_result_goes_back_into_the_conversation(http):
    first = chat(http, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    call = first["choices"][0]["message"]["tool_calls"][0]
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": call["id"], "content": "18 degrees and sunny"}]
    plain = chat(http, messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=1)["usage"]["prompt_tokens"]
    answer = chat(http, messages=history, tools=[WEATHER], tool_choice="none", max_tokens=30)
    assert answer["usage"]["prompt_tokens"] > plain + 10  # the call and its result are in the prompt
    assert answer["choices"][0]["message"]["content"]


def test_tool_message_answering_no_call_is_refused(http):
    history = ASK + [{"role": "tool", "tool_call_id": "call_nope", "content": "x"}]
    assert_error(http.post("/v1/chat/completions", json={"messages": history, "tools": [WEATHER]}), 400,
                 param="messages[1].tool_call_id")


def test_json_schema_response_format_validates_whole_streamed_and_with_n(http):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    ask = [{"role": "user", "content": "Invent a person."}]
    body = chat(http, messages=ask, response_format=fmt, n=2, temperature=0.8, seed=3, max_tokens=150)
    for choice in body["choices"]:
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)
    chunks = stream_chunks(http, "/v1/chat/completions", {"messages": ask, "response_format": fmt,
                                                          "max_tokens": 150, "temperature": 0})
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    jsonschema.validate(json.loads(text), PERSON)


def test_json_object_and_vllm_guided_fields(http):
    ask = [{"role": "user", "content": "Describe a cat as JSON."}]
    out = chat(http, messages=ask, response_format={"type": "json_object"}, max_tokens=150)
    assert isinstance(json.loads(out["choices"][0]["message"]["content"]), dict)
    r = http.post("/v1/completions", json={"prompt": "Is the sky blue? Answer:", "guided_choice": ["yes", "no"],
                                           "max_tokens": 5, "temperature": 0})
    assert r.json()["choices"][0]["text"] in ("yes", "no")
    r = http.post("/v1/completions", json={"prompt": "A number:", "structured_outputs": {"regex": "[0-9]{3}"},
                                           "max_tokens": 8})
    assert len(r.json()["choices"][0]["text"]) == 3 and r.json()["choices"][0]["text"].isdigit()


def test_invalid_schema_is_a_400_naming_the_field(http):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": 5}}}
    assert_error(http.post("/v1/chat/completions", json={"messages": ASK, "response_format": fmt}), 400,
                 param="response_format")
    assert_error(http.post("/v1/completions", json={"prompt": "x", "guided_regex": "(unclosed"}), 400,
                 param="guided_regex")


def test_logit_bias_steers_greedy_choice(http, engine):
    token = engine.tokenizer.encode(" banana", add_special_tokens=False)[0]
    r = http.post("/v1/completions", json={"prompt": "My favourite fruit is", "max_tokens": 3, "temperature": 0,
                                           "logit_bias": {str(token): 100}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"].startswith(" banana")


def test_tool_parameters_that_are_not_an_object_schema_are_refused(http):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}
    assert_error(http.post("/v1/chat/completions", json={"messages": ASK, "tools": [tool]}), 400,
                 param="tools[0].function.parameters", code="invalid_function_parameters")


def test_a_responses_schema_error_names_text_format(http):
    body = {"input": "a", "text": {"format": {"type": "json_schema", "name": "c", "schema": {"type": "wat"}}}}
    assert_error(http.post("/v1/responses", json=body), 400, param="text.format")


def test_required_calls_cut_by_max_tokens_are_the_same_streamed_and_not(http):
    """tool_choice required, parallel calls allowed, the output cut inside a call's arguments: both
    answers report only the calls whose arguments are complete JSON, and the cut call as content."""
    fields = {"tools": [WEATHER, TIME], "tool_choice": "required", "seed": 7}  # greedy: the model calls on and on
    cut_inside = 0
    for max_tokens in (30, 45):
        message = chat(http, **fields, max_tokens=max_tokens)["choices"][0]["message"]
        chunks = stream_chunks(http, "/v1/chat/completions", {
            "messages": ASK, "temperature": 0, "stream": True, "max_tokens": max_tokens, **fields})
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
        streamed: dict[int, dict] = {}
        for part in (d["tool_calls"][0] for d in deltas if d.get("tool_calls")):
            call = streamed.setdefault(part["index"], {"name": "", "arguments": ""})
            call["name"] += part["function"].get("name") or ""
            call["arguments"] += part["function"].get("arguments") or ""
        calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                 for c in message.get("tool_calls") or []]
        assert [streamed[i] for i in sorted(streamed)] == calls, max_tokens
        assert all(isinstance(json.loads(c["arguments"]), dict) for c in calls)
        assert ("".join(d.get("content") or "" for d in deltas) or None) == message["content"]
        cut_inside += "<tool_call>" in (message["content"] or "")
    assert cut_inside, "no cut fell inside a call: the test shows nothing"
