"""Request validation as pure functions: what is accepted, what is refused, and how fields map to
SamplingParams. No engine needed."""
from __future__ import annotations

import pytest

from slipstream.server.api.errors import APIError
from slipstream.server.api.protocol import check_model, parse_chat_request, parse_completion_request

MESSAGES = [{"role": "user", "content": "hi"}]


def refused(parse, body, **kwargs) -> APIError:
    with pytest.raises(APIError) as info:
        parse(body, **kwargs)
    return info.value


def test_chat_defaults_follow_openai():
    req = parse_chat_request({"messages": MESSAGES})
    p = req.params
    assert (p.n, p.temperature, p.top_p, p.max_tokens, p.logprobs) == (1, 1.0, 1.0, None, None)
    assert not req.stream and not req.include_usage and req.model is None


def test_completion_default_max_tokens_is_16():
    assert parse_completion_request({"prompt": "x"}).params.max_tokens == 16


def test_every_sampling_field_reaches_the_sampling_params():
    p = parse_completion_request({
        "prompt": "x", "max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 40, "min_p": 0.1, "n": 3,
        "best_of": 3, "stop": "END", "stop_token_ids": [5], "seed": 11, "presence_penalty": 0.5,
        "frequency_penalty": -0.5, "repetition_penalty": 1.2, "ignore_eos": True, "min_tokens": 2, "logprobs": 2,
        "skip_special_tokens": False, "include_stop_str_in_output": True}).params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.n) == (7, 0.5, 0.9, 40, 0.1, 3)
    assert (p.stop, p.stop_token_ids, p.seed, p.presence_penalty, p.frequency_penalty) == (["END"], [5], 11, 0.5, -0.5)
    assert (p.repetition_penalty, p.ignore_eos, p.min_tokens, p.logprobs) == (1.2, True, 2, 2)
    assert p.skip_special_tokens is False and p.include_stop_str_in_output is True


def test_max_completion_tokens_is_max_tokens_and_both_must_agree():
    assert parse_chat_request({"messages": MESSAGES, "max_completion_tokens": 9}).params.max_tokens == 9
    assert parse_chat_request({"messages": MESSAGES, "max_completion_tokens": 9, "max_tokens": 9}).params.max_tokens == 9
    assert refused(parse_chat_request, {"messages": MESSAGES, "max_completion_tokens": 9, "max_tokens": 8}).status == 400


def test_chat_logprobs_map_to_top_n():
    assert parse_chat_request({"messages": MESSAGES, "logprobs": True}).params.logprobs == 0
    assert parse_chat_request({"messages": MESSAGES, "logprobs": True, "top_logprobs": 4}).params.logprobs == 4
    assert parse_chat_request({"messages": MESSAGES, "logprobs": False}).params.logprobs is None


def test_top_p_zero_is_greedy():
    p = parse_chat_request({"messages": MESSAGES, "top_p": 0}).params
    assert p.temperature == 0 and p.top_p == 1


def test_stream_options_need_a_stream():
    body = {"messages": MESSAGES, "stream_options": {"include_usage": True}}
    assert parse_chat_request({**body, "stream": True}).include_usage
    assert not parse_chat_request({**body, "stream": True, "stream_options": {}}).include_usage
    for stream in (False, None):
        with pytest.raises(APIError, match="only allowed when stream is true") as exc:
            parse_chat_request({**body, "stream": stream})
        assert exc.value.param == "stream_options"


def test_continuous_usage_stats_works_with_or_without_include_usage():
    body = {"messages": MESSAGES, "stream": True}
    guidellm = parse_chat_request({**body, "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert guidellm.include_usage and guidellm.continuous_usage
    alone = parse_completion_request({"prompt": "x", "stream": True,
                                      "stream_options": {"continuous_usage_stats": True}})
    assert alone.continuous_usage and not alone.include_usage
    assert not parse_chat_request({**body, "stream_options": {"include_usage": True}}).continuous_usage


def test_stream_options_fields_are_checked_by_their_path():
    body = {"messages": MESSAGES, "stream": True}
    error = refused(parse_chat_request, {**body, "stream_options": {"continuous_usage_stats": "yes"}})
    assert error.param == "stream_options.continuous_usage_stats"
    error = refused(parse_chat_request, {**body, "stream_options": {"include_obfuscation": False}})
    assert (error.param, error.code) == ("stream_options.include_obfuscation", "unknown_parameter")


def test_explicit_nulls_take_the_defaults():
    fields = ["model", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "presence_penalty", "logit_bias",
              "user", "stream", "stream_options", "tools", "tool_choice", "response_format", "logprobs",
              "top_logprobs", "max_completion_tokens", "metadata", "store"]
    req = parse_chat_request({"messages": MESSAGES, **{f: None for f in fields}})
    assert req.params.n == 1 and req.params.temperature == 1.0 and not req.stream


def test_noop_values_clients_send_by_default_are_accepted():
    parse_chat_request({"messages": MESSAGES, "user": "u", "store": False, "metadata": {"a": "b"},
                        "parallel_tool_calls": True, "logit_bias": {}, "tools": [], "tool_choice": "none",
                        "response_format": {"type": "text"}, "modalities": ["text"], "service_tier": "auto"})
    parse_completion_request({"prompt": "x", "echo": False, "suffix": None, "best_of": 1, "logit_bias": {}})


def test_fields_that_change_nothing_here_are_accepted_and_type_checked():
    no_ops = {"prompt_cache_key": "k1", "safety_identifier": "hash", "service_tier": "default", "store": True,
              "metadata": {"run": "7"}, "user": "u"}
    for parse, body in ((parse_chat_request, {"messages": MESSAGES}), (parse_completion_request, {"prompt": "x"})):
        assert parse({**body, **no_ops}).params == parse(body).params
    for field, value in [("prompt_cache_key", 1), ("safety_identifier", ["a"]), ("store", "yes"), ("metadata", "m")]:
        assert refused(parse_completion_request, {"prompt": "x", field: value}).param == field


def test_unknown_field_is_unknown_parameter_naming_it():
    for parse, body in ((parse_chat_request, {"messages": MESSAGES}), (parse_completion_request, {"prompt": "x"})):
        error = refused(parse, {**body, "frobnicate": 1})
        assert (error.status, error.param, error.code) == (400, "frobnicate", "unknown_parameter")


@pytest.mark.parametrize("field, value", [
    ("functions", [{"name": "f"}]), ("function_call", {"name": "f"}), ("audio", {"voice": "x"}),
    ("prediction", {"type": "content"}), ("reasoning_effort", "high"), ("web_search_options", {}),
    ("unknown_knob", 1), ("modalities", ["text", "audio"]),
])
def test_fields_that_would_change_the_output_are_refused_by_name(field, value):
    error = refused(parse_chat_request, {"messages": MESSAGES, field: value})
    assert error.status == 400 and error.param == field


@pytest.mark.parametrize("field, value, param", [
    ("tools", [{"type": "function"}], "tools[0].function"),
    ("tools", [{"type": "function", "function": {"name": "has space"}}], "tools[0].function.name"),
    ("tools", [{"type": "function", "function": {"name": "f"}}] * 2, "tools[1].function.name"),
    ("tool_choice", "required", "tool_choice"),  # no tools to call
    ("tool_choice", {"type": "function"}, "tool_choice"),
    ("tool_choice", {"type": "function", "function": {"name": "g"}}, "tool_choice"),  # not declared
    ("response_format", {"type": "json_schema"}, "response_format.json_schema"),
    ("response_format", {"type": "xml"}, "response_format.type"),
    ("logit_bias", {"one": 1}, "logit_bias"),
    ("logit_bias", {"1": 101}, "logit_bias"),
    ("structured_outputs", {"regex": "a+", "choice": ["a"]}, "structured_outputs"),
    ("structured_outputs", {"json_schema": {}}, "structured_outputs.json_schema"),
])
def test_malformed_tools_formats_and_biases_name_their_field(field, value, param):
    error = refused(parse_chat_request, {"messages": MESSAGES, field: value})
    assert (error.status, error.param) == (400, param), error.message


def test_output_constraints_map_to_one_structured_outputs_params():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    assert parse_chat_request({"messages": MESSAGES, "response_format": rf}).params.structured_outputs.json == schema
    assert parse_chat_request({"messages": MESSAGES, "response_format": {"type": "json_object"}}
                              ).params.structured_outputs.json_object
    assert parse_completion_request({"prompt": "x", "guided_choice": ["yes", "no"]}).params.structured_outputs.choice \
        == ["yes", "no"]
    assert parse_completion_request({"prompt": "x", "structured_outputs": {"regex": "[0-9]+"}}
                                    ).params.structured_outputs.regex == "[0-9]+"
    error = refused(parse_chat_request, {"messages": MESSAGES, "response_format": {"type": "json_object"},
                                         "guided_regex": "a"})
    assert error.param == "guided_regex"


def test_logit_bias_keys_become_token_ids():
    assert parse_completion_request({"prompt": "x", "logit_bias": {"17": -100, "3": 5.5}}).params.logit_bias == \
        {17: -100.0, 3: 5.5}


def test_echo_with_logprobs_asks_for_the_prompt_logprobs():
    p = parse_completion_request({"prompt": "x", "echo": True, "logprobs": 2}).params
    assert (p.logprobs, p.prompt_logprobs) == (2, 2)
    assert parse_completion_request({"prompt": "x", "echo": True}).params.prompt_logprobs is None


def test_forced_tool_choice():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert parse_chat_request({"messages": MESSAGES, "tools": tools, "tool_choice": "required"}).forced_tool is True
    named = {"type": "function", "function": {"name": "f"}}
    assert parse_chat_request({"messages": MESSAGES, "tools": tools, "tool_choice": named}).forced_tool == "f"
    assert parse_chat_request({"messages": MESSAGES, "tools": tools}).forced_tool is None


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("top_p", 1.01), ("top_p", -1), ("n", 0), ("n", 129), ("max_tokens", 0),
    ("min_p", 2), ("presence_penalty", -2.5), ("frequency_penalty", 2.5), ("repetition_penalty", 0),
    ("top_k", -2), ("min_tokens", -1), ("logprobs", 21), ("temperature", float("nan")),
    ("temperature", True), ("n", "2"), ("seed", 1.5), ("stop", [""]), ("stop_token_ids", ["a"]),
])
def test_out_of_range_or_mistyped_values_name_the_field(field, value):
    error = refused(parse_completion_request, {"prompt": "x", field: value})
    assert error.status == 400 and error.param == field, error.message
    assert field in error.message


def test_min_tokens_above_max_tokens_is_refused():
    assert refused(parse_completion_request, {"prompt": "x", "max_tokens": 2, "min_tokens": 3}).status == 400


@pytest.mark.parametrize("prompt, expected", [
    ("abc", ["abc"]), (["a", "b"], ["a", "b"]), ([1, 2, 3], [[1, 2, 3]]), ([[1], [2, 3]], [[1], [2, 3]]),
])
def test_prompt_forms(prompt, expected):
    assert parse_completion_request({"prompt": prompt}).prompts == expected


@pytest.mark.parametrize("prompt", ["", [], [[]], ["a", 1], [1.5], {"text": "x"}, [[1], "a"]])
def test_bad_prompts_are_refused(prompt):
    assert refused(parse_completion_request, {"prompt": prompt}).param == "prompt"


def test_a_sampling_limit_is_reported_under_the_request_s_own_name():
    """SamplingParams owns the ranges; the request maps its field names onto it and back."""
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    error = refused(parse_chat_request, {**chat, "logprobs": True, "top_logprobs": 21})
    assert error.param == "top_logprobs" and error.message.startswith("top_logprobs must be in [0, 20]")
    error = refused(parse_chat_request, {**chat, "max_completion_tokens": 0})
    assert error.param == "max_completion_tokens" and error.message.startswith("max_completion_tokens")
    error = refused(parse_completion_request, {"prompt": "x", "temperature": 2.5})
    assert (error.status, error.param, error.message) == (400, "temperature", "temperature must be in [0, 2], got 2.5")


def test_messages_normalized_for_the_chat_template():
    req = parse_chat_request({"messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "ann"},
        {"role": "assistant", "content": None, "tool_calls": []},
    ]})
    assert req.template_messages() == [{"role": "system", "content": "be brief"},
                                       {"role": "user", "content": "ab", "name": "ann"},
                                       {"role": "assistant", "content": ""}]


def test_tool_turns_reach_the_template_as_openai_sends_them():
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}
    req = parse_chat_request({"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
    ]})
    assert req.template_messages()[1:] == [{"role": "assistant", "content": "", "tool_calls": [call]},
                                           {"role": "tool", "content": "42", "tool_call_id": "call_1"}]


@pytest.mark.parametrize("message, param", [
    ({"role": "robot", "content": "x"}, "messages[0].role"),
    ({"role": "tool", "content": "x"}, "messages[0].tool_call_id"),
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, "messages[0].content[0].type"),
    ({"role": "user", "content": [{"type": "text", "text": 5}]}, "messages[0].content[0].text"),
    ({"role": "user", "content": [{"type": "text"}]}, "messages[0].content[0].text"),
    ({"role": "user"}, "messages[0].content"),
    ({"role": "user", "content": 5}, "messages[0].content"),
    ({"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}, "messages[0].tool_calls[0].function"),
    ({"role": "user", "content": "x", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}, "messages[0].tool_calls"),
    ("hello", "messages[0]"),
])
def test_bad_messages_name_the_message(message, param):
    assert refused(parse_chat_request, {"messages": [message]}).param == param


def test_unknown_model_is_404_model_not_found():
    check_model(None, ("m",))
    check_model("m", ("m",))
    check_model("alias", ("m", "alias"))
    with pytest.raises(APIError) as info:
        check_model("other", ("m", "alias"))
    assert (info.value.status, info.value.code, info.value.param) == (404, "model_not_found", "model")
    assert "This server serves `m`, `alias`" in info.value.message
    with pytest.raises(APIError):
        check_model("m", ("mm",))  # a name, not a substring
