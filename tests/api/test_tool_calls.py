"""Tool calls (issue 13, item 3): the parsers of ``--tool-call-parser`` (finished and streamed),
the prompt side for chat templates with and without tools, the grammars of ``tool_choice``, and
the validation of ``tools``/``tool_choice``. Pure functions; the tokenizer is the built-in
model's, loaded once."""
from __future__ import annotations

import copy
import json
import random
import re
import time
from types import SimpleNamespace

import jinja2
import jsonschema
import llguidance
import llguidance.hf
import numpy as np
import pytest

from slipstream.server.api import render
from slipstream.server.api.protocol import validate
from slipstream.server.api.protocol_responses import ResponsesRequest, chat_request
from slipstream.server.api.serving_responses import ResponseStore, ResponsesCall
from slipstream.server.api.tools import (ToolCallError, UnknownToolParser, check_tools, get_parser, grammar_for,
                                         prepare_messages, render_calls, template_supports_tools)
from slipstream.server.api.tools.scan import ObjectScan, Scan
from slipstream.server.engine.errors import InvalidRequest
from slipstream.server.engine.outputs import CompletionOutput
from slipstream.server.models.loader import load_tokenizer

WEATHER = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
TIME = {"name": "get_time", "arguments": {"tz": "Europe/Paris"}}
TRICKY = {"name": "echo", "arguments": {"text": "a } ] \" \\ \u00e9 <tool_call> ; , [TOOL_CALLS]",
                                        "n": [1, -2.5e3, True, None, {"k": {}}]}}


def _compact(args: dict) -> str:
    return json.dumps(args, separators=(",", ":"), ensure_ascii=False)


def _names_args(calls):
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def _want(*calls):
    return [(c["name"], _compact(c["arguments"])) for c in calls]


def hermes(*calls, sep="\n"):
    return sep.join(f"<tool_call>\n{json.dumps(c, ensure_ascii=False)}\n</tool_call>" for c in calls)


def llama(*calls, tag=""):
    return tag + "; ".join(json.dumps({"name": c["name"], "parameters": c["arguments"]},
                                      ensure_ascii=False) for c in calls)


def mistral(*calls):
    return "[TOOL_CALLS]" + json.dumps(list(calls), ensure_ascii=False)


# (parser, model output, expected content, expected [(name, arguments)])
CASES = [
    # hermes (Hermes 2 Pro, Qwen2.5)
    ("hermes", "The capital of France is Paris.", "The capital of France is Paris.", []),
    ("hermes", hermes(WEATHER), None, _want(WEATHER)),
    ("hermes", hermes(WEATHER, TIME), None, _want(WEATHER, TIME)),
    ("hermes", "Let me check.\n" + hermes(WEATHER) + "\n", "Let me check.", _want(WEATHER)),
    ("hermes", hermes(TRICKY), None, _want(TRICKY)),
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}', None,
     [("get_time", '{"tz":"UTC"}')]),  # cut at the stop string: no end tag
    ("hermes", '<tool_call>{"arguments": {"tz": "UTC"}, "id": 7, "name": "get_time"}</tool_call>', None,
     [("get_time", '{"tz":"UTC"}')]),  # any key order, extra keys ignored
    ("hermes", "<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", []),
    ("hermes", '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
     '<tool_call>{"name": 3, "arguments": {}}</tool_call>', []),
    ("hermes", '<tool_call>{"name": "f", "arguments": "{}"}</tool_call>',
     '<tool_call>{"name": "f", "arguments": "{}"}</tool_call>', []),  # arguments must be an object
    ("hermes", '<tool_call>{"name": "f"}</tool_call>', '<tool_call>{"name": "f"}</tool_call>', []),
    ("hermes", '<tool_call>{"name": "f", "name": "g", "arguments": {}}',
     '<tool_call>{"name": "f", "name": "g", "arguments": {}}', []),
    ("hermes", "<tool_call> <tool_call>" + '{"name": "f", "arguments": {}}', "<tool_call>",
     [("f", "{}")]),  # a rejected marker stays content; the next one is a call
    ("hermes", "a <tool_", "a <tool_", []),  # a partial marker at the end is content
    ("hermes", hermes(WEATHER) + "\nDone.", "Done.", _want(WEATHER)),
    # llama3_json (Llama 3.1-3.3)
    ("llama3_json", llama(WEATHER), None, _want(WEATHER)),
    ("llama3_json", "  " + llama(WEATHER, TIME), None, _want(WEATHER, TIME)),
    ("llama3_json", llama(WEATHER, tag="<|python_tag|>"), None, _want(WEATHER)),
    ("llama3_json", "Checking. <|python_tag|>" + llama(TIME), "Checking.", _want(TIME)),
    ("llama3_json", llama(TRICKY), None, _want(TRICKY)),
    ("llama3_json", '{"name": "f", "arguments": {"x": 1}}', None, [("f", '{"x":1}')]),
    ("llama3_json", '{"name": "Bob", "age": 3}', '{"name": "Bob", "age": 3}', []),  # JSON, no call
    ("llama3_json", "Hello {world}", "Hello {world}", []),  # a brace inside content is content
    ("llama3_json", llama(TIME) + "; oops", "; oops", _want(TIME)),
    ("llama3_json", llama(TIME) + " and more", "and more", _want(TIME)),
    ("llama3_json", '<|python_tag|>brave_search.call(query="x")', '<|python_tag|>brave_search.call(query="x")', []),
    # mistral (v3 tokenizers)
    ("mistral", mistral(WEATHER), None, _want(WEATHER)),
    ("mistral", mistral(WEATHER, TIME), None, _want(WEATHER, TIME)),
    ("mistral", "Sure. [TOOL_CALLS] " + mistral(TIME)[12:], "Sure.", _want(TIME)),
    ("mistral", mistral(TRICKY), None, _want(TRICKY)),
    ("mistral", '[TOOL_CALLS]{"name": "f", "arguments": {}}', None, [("f", "{}")]),
    ("mistral", "[TOOL_CALLS][]", "[TOOL_CALLS][]", []),
    ("mistral", "[TOOL_CALLS] nothing", "[TOOL_CALLS] nothing", []),
    ("mistral", mistral(TIME) + " trailing", "trailing", _want(TIME)),
]
# Outputs that break after a call was announced (name complete, arguments begun): ``extract``
# returns them as content; a stream has already sent the call. (parser, text, streamed call)
BROKEN_AFTER_ANNOUNCE = [
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": tru}}</tool_call>', ("f", '{"a":tru')),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": "line\nbreak"}}</tool_call>',
     ("f", '{"a":"line')),  # a raw newline inside a JSON string
    ("llama3_json", '{"name": "f", "parameters": {}, "arguments": {}}', ("f", "{}")),  # ambiguous
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa', ("get_weather", '{"city":"Pa')),
]
IDS = [f"{p}-{i}" for i, (p, *_rest) in enumerate(CASES)]


@pytest.mark.parametrize("parser,text,content,calls", CASES, ids=IDS)
def test_extract_returns_content_and_calls_in_openai_shape(parser, text, content, calls):
    got_content, got_calls = get_parser(parser).extract(text)
    assert got_content == content
    assert _names_args(got_calls) == calls
    for call in got_calls:
        assert set(call) == {"id", "type", "function"} and call["type"] == "function"
        assert isinstance(json.loads(call["function"]["arguments"]), dict)
        assert re.fullmatch(r"[A-Za-z0-9]{9}" if parser == "mistral" else r"call_[A-Za-z0-9]{24}",
                            call["id"])


def _stream(parser, chunks, **options):
    """Feed ``chunks`` to a stream made with ``options``; check the deltas' shapes; return
    (content, [(name, args)])."""
    stream = get_parser(parser).stream(**options)
    deltas = [d for c in chunks for d in stream.feed(c)] + stream.finish()
    content, calls, ids = "", [], []
    for d in deltas:
        assert len(d) == 1, d
        if "content" in d:
            assert d["content"]
            content += d["content"]
            continue
        (tc,) = d["tool_calls"]
        if "id" in tc:  # the first delta of a call: id, type, name, empty arguments
            assert tc["index"] == len(calls) and tc["type"] == "function"
            assert tc["function"]["arguments"] == ""
            calls.append([tc["function"]["name"], ""])
            ids.append(tc["id"])
        else:
            assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
            assert tc["index"] == len(calls) - 1, "fragments follow their call's header"
            calls[tc["index"]][1] += tc["function"]["arguments"]
    assert [c["id"] for c in stream.tool_calls] == ids
    return content or None, [tuple(c) for c in calls]


@pytest.mark.parametrize("parser,text,content,calls", CASES, ids=IDS)
def test_stream_split_at_every_position_equals_extract(parser, text, content, calls):
    for i in range(len(text) + 1):
        assert _stream(parser, [text[:i], text[i:]]) == (content, calls), f"split at {i}"
    assert _stream(parser, list(text)) == (content, calls), "one character at a time"


@pytest.mark.parametrize("parser,text,content,calls", CASES, ids=IDS)
def test_stream_split_at_random_positions_equals_extract(parser, text, content, calls):
    rng = random.Random(len(text))
    for _ in range(30):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 8))))
        chunks = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        assert _stream(parser, chunks) == (content, calls), chunks


NOISE = ["Sure.", " ", "\n", "a <tool", "<tool_call> no", "</tool_call>", "{x}", '{"a": 1}', "[1, 2]",
         "[TOOL_CALLS] no", "[TOOL_", "<|python_", "<|python_tag|>print(1)", "; ", ", ", "é 🙂"]
CALL_WRITERS = {"hermes": lambda c: hermes(c), "mistral": lambda c: mistral(c),
                "llama3_json": lambda c: llama(c, tag="<|python_tag|>")}


@pytest.mark.parametrize("parser", sorted(CALL_WRITERS))
def test_random_mixes_of_text_and_calls_extract_every_call_and_stream_the_same(parser):
    rng = random.Random(parser)
    for _ in range(150):
        pieces = [("call", rng.choice([WEATHER, TIME, TRICKY])) for _ in range(rng.randint(0, 3))]
        pieces += [("text", rng.choice(NOISE)) for _ in range(rng.randint(0, 5))]
        rng.shuffle(pieces)
        text = "".join(CALL_WRITERS[parser](v) if kind == "call" else v for kind, v in pieces)
        content, got = get_parser(parser).extract(text)
        assert _names_args(got) == _want(*[v for kind, v in pieces if kind == "call"]), text
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, 6)))
        chunks = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        assert _stream(parser, chunks) == (content, _names_args(got)), chunks


def test_stream_sends_plain_text_at_once_and_holds_only_a_possible_marker():
    stream = get_parser("hermes").stream()
    assert stream.feed("Hello") == [{"content": "Hello"}]
    assert stream.feed(" <tool") == []  # may be "<tool_call>": held, with the space before it
    assert stream.feed("box>") == [{"content": " <toolbox>"}]
    assert stream.finish() == []


def test_stream_sends_a_call_whole_once_its_arguments_are_complete_json():
    stream = get_parser("hermes").stream()
    assert stream.feed('<tool_call>\n{"name": "get_weather", ') == []
    assert stream.feed('"arguments": {"city": "Pa') == []  # could still be cut off: nothing sent
    header, args = stream.feed('ris"}}\n</tool_call>')
    call = header["tool_calls"][0]
    assert call["index"] == 0 and call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": ""}
    assert args == {"tool_calls": [{"index": 0, "function": {"arguments": '{"city":"Paris"}'}}]}
    assert stream.finish() == []
    assert stream.tool_calls[0]["function"] == {"name": "get_weather", "arguments": '{"city":"Paris"}'}


@pytest.mark.parametrize("parser,text,call", BROKEN_AFTER_ANNOUNCE)
def test_output_broken_or_cut_inside_a_call_is_content_streamed_or_not(parser, text, call):
    """No call whose arguments are not complete JSON is ever reported: split anywhere, a stream
    reads the output as ``extract`` does."""
    assert get_parser(parser).extract(text) == (text, [])
    assert _stream(parser, list(text)) == (text, [])  # token by token
    for i in range(len(text) + 1):
        assert _stream(parser, [text[:i], text[i:]]) == (text, []), f"split at {i}"


# -- parallel_tool_calls: false --------------------------------------------------------------------

@pytest.mark.parametrize("parser,text,content,calls", CASES + [
    ("hermes", "Let me check.\n" + hermes(WEATHER, TIME, TRICKY) + "\nDone.", "Let me check.Done.",
     _want(WEATHER, TIME, TRICKY)),
    ("llama3_json", llama(TIME, WEATHER) + " and more", "and more", _want(TIME, WEATHER)),
    ("mistral", "Sure. " + mistral(TIME, WEATHER), "Sure.", _want(TIME, WEATHER)),
], ids=IDS + ["hermes-three-calls", "llama3_json-two-calls", "mistral-two-calls"])
def test_without_parallel_tool_calls_only_the_first_call_is_returned_and_the_content_is_the_same(
        parser, text, content, calls):
    every_content, every_call = get_parser(parser).extract(text)
    assert (every_content, _names_args(every_call)) == (content, calls)  # as parallel calls read it
    got_content, got_calls = get_parser(parser).extract(text, parallel_tool_calls=False)
    assert (got_content, _names_args(got_calls)) == (content, calls[:1])
    for i in range(len(text) + 1):
        assert _stream(parser, [text[:i], text[i:]], parallel_tool_calls=False) == (content, calls[:1]), i
    assert _stream(parser, list(text), parallel_tool_calls=False) == (content, calls[:1])


@pytest.mark.parametrize("parser", sorted(CALL_WRITERS))
def test_without_parallel_tool_calls_random_mixes_keep_the_first_call_and_all_the_content(parser):
    rng = random.Random(parser + "-single")
    for _ in range(150):
        pieces = [("call", rng.choice([WEATHER, TIME, TRICKY])) for _ in range(rng.randint(0, 3))]
        pieces += [("text", rng.choice(NOISE)) for _ in range(rng.randint(0, 5))]
        rng.shuffle(pieces)
        text = "".join(CALL_WRITERS[parser](v) if kind == "call" else v for kind, v in pieces)
        content, every = get_parser(parser).extract(text)
        single = get_parser(parser).extract(text, parallel_tool_calls=False)
        assert (single[0], _names_args(single[1])) == (content, _names_args(every)[:1]), text
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, 6)))
        chunks = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        assert _stream(parser, chunks, parallel_tool_calls=False) == (content, _names_args(every)[:1]), chunks


def test_without_parallel_tool_calls_a_stream_sends_no_delta_of_a_second_call():
    stream = get_parser("hermes").stream(parallel_tool_calls=False)
    first = stream.feed(hermes(WEATHER) + "\n")
    assert [d["tool_calls"][0]["index"] for d in first] == [0, 0]  # the header, then the arguments
    assert stream.feed(hermes(TIME)[:30]) == []  # the second call is read, not sent
    assert stream.feed(hermes(TIME)[30:] + " Bye.") == [{"content": "Bye."}]  # text after it is content
    assert stream.finish() == []
    assert _names_args(stream.tool_calls) == _want(WEATHER)


def _responses_call(parallel_tool_calls):
    """A ``/v1/responses`` call over the hermes parser, as the endpoint builds it (no engine)."""
    tools = [{"type": "function", **t["function"]} for t in (WEATHER_TOOL, TIME_TOOL)]
    req = validate(ResponsesRequest, {"input": "Weather and time in Paris?", "tools": tools,
                                      "parallel_tool_calls": parallel_tool_calls})
    chat, _ = chat_request(req, req.items, ["input"])
    assert chat.parallel_tool_calls is parallel_tool_calls
    return ResponsesCall(SimpleNamespace(model_name="m"), chat, "resp_test", req, get_parser("hermes"), req.items,
                         ResponseStore())


@pytest.mark.parametrize("parallel", [True, False])
def test_responses_without_parallel_tool_calls_has_one_function_call_item_whole_and_streamed(parallel):
    text = hermes(WEATHER, TIME)
    want = _want(WEATHER, TIME) if parallel else _want(WEATHER)
    whole = _responses_call(parallel).response_body([render.Choice(0, text=text, finish_reason="stop")])
    assert [(i["type"], i["name"], i["arguments"]) for i in whole["output"]] == [("function_call", *w) for w in want]
    assert whole["parallel_tool_calls"] is parallel
    call, choice = _responses_call(parallel), render.Choice(0)
    events = [e for i in range(0, len(text), 7) for e in call.deltas(choice, CompletionOutput(0, text[i:i + 7], []))]
    choice.finish_reason = "stop"
    events += call.closing_deltas(choice) + [call.finish_delta(choice)]
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    assert [(i["type"], i["name"]) for i in added] == [("function_call", name) for name, _ in want]
    for index, (_, arguments) in enumerate(want):
        assert "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"
                       and e["output_index"] == index) == arguments
    assert not any(e["type"] == "response.output_text.delta" for e in events)
    final = events[-1]["response"]
    assert final["status"] == "completed"
    assert [(i["name"], i["arguments"]) for i in final["output"]] == want


VALID_OBJECTS = ['{}', ' { "a" : [ 1 , -2.5e+3 , 0.0, true, false, null, "x\\n\\u00e9\\"" ] } ',
                 '{"a": {"b": {"c": []}}, "d": [[], [{}]], "e": "}]{["}', '{"\u00e9": -0}']
INVALID_OBJECTS = ['{"a": 1,}', '{"a": [1,]}', '{"a" 1}', '{a: 1}', '{"a": 01}', '{"a": 1.}',
                   '{"a": tru}', '{"a": nul, "b": 1}', '{"a": "\\x"}', '{"a": "\\u12g4"}',
                   '{"a": "tab\there"}', '[1]', '"a"', '{"a": 1}}', '{"a": 1 "b": 2}', '{"a": +1}',
                   '{"a": 1, "a": 2}']


def _json_object(text):
    """json.loads, refusing what the scanner refuses besides invalid JSON: non-objects, repeated keys."""
    def pairs(items):
        if len({k for k, _ in items}) != len(items):
            raise ValueError("repeated key")
        return dict(items)

    value = json.loads(text, object_pairs_hook=pairs)
    if not isinstance(value, dict):
        raise ValueError("not an object")
    return value


@pytest.mark.parametrize("text", VALID_OBJECTS)
def test_object_scan_reads_valid_json_and_keeps_its_compact_text(text):
    start = text.index("{")
    for i in range(start, text.rindex("}") + 1):  # no prefix is judged invalid
        assert ObjectScan(start).advance(text[:i]) is Scan.MORE, text[:i]
    scan = ObjectScan(start)
    assert scan.advance(text) is Scan.DONE and text[scan.end:].strip() == ""
    assert json.loads(scan.compact) == _json_object(text)
    assert " " not in scan.compact, "whitespace outside strings is dropped"


@pytest.mark.parametrize("text", INVALID_OBJECTS)
def test_object_scan_rejects_what_json_loads_rejects(text):
    scan = ObjectScan(0)
    result = scan.advance(text)
    assert result is Scan.BAD or (result is Scan.DONE and text[scan.end:].strip())
    with pytest.raises(ValueError):
        _json_object(text)


def test_a_long_call_streams_in_linear_time():
    args = {"code": "x = 1\n" * 4000, "items": list(range(2000))}
    text = hermes({"name": "run", "arguments": args})
    stream, t0 = get_parser("hermes").stream(), time.perf_counter()
    for i in range(0, len(text), 4):
        stream.feed(text[i:i + 4])
    stream.finish()
    assert time.perf_counter() - t0 < 3.0, "quadratic rescanning would take minutes"
    assert json.loads(stream.tool_calls[0]["function"]["arguments"]) == args


def test_marker_formats_ask_the_detokenizer_to_keep_special_tokens():
    assert get_parser("hermes").skip_special_tokens is True
    assert get_parser("llama3_json").skip_special_tokens is False
    assert get_parser("mistral").skip_special_tokens is False


def test_unknown_parser_name_is_a_value_error_naming_the_choices():
    with pytest.raises(UnknownToolParser, match="hermes, llama3_json, mistral") as e:
        get_parser("qwen")
    assert isinstance(e.value, ValueError) and e.value.param == "tool_call_parser"


# -- prompt side ----------------------------------------------------------------------------------

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "Local time",
    "parameters": {"type": "object", "properties": {"days_ahead": {"type": "integer", "minimum": 0,
                                                                   "maximum": 9},
                                                    "dst": {"type": "boolean"}},
                   "required": ["days_ahead"], "additionalProperties": False}}}
TOOLS = [WEATHER_TOOL, TIME_TOOL]
CONVERSATION = [
    {"role": "user", "content": "Weather and time in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_a", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_b", "type": "function",
         "function": {"name": "get_time", "arguments": '{"days_ahead": 0}'}}]},
    {"role": "tool", "tool_call_id": "call_a", "content": "22 C, sunny"},
    {"role": "tool", "tool_call_id": "call_b", "content": [{"type": "text", "text": "14:05"}]},
]

# A minimal tools-aware ChatML template, written the way transformers' docs describe tool use.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t.function.name }};{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} city={{ c.function.arguments.city }}"
    " {{ c.function.arguments | tojson }}{% endfor %}"
    "{% if m.role == 'tool' %} FROM {{ m.name }} ID {{ m.tool_call_id }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("builtin")


def test_builtin_template_has_no_tools_section_and_fails_on_null_content(tokenizer):
    assert not template_supports_tools(tokenizer)
    with pytest.raises((TypeError, jinja2.UndefinedError)):  # why prepare_messages exists
        tokenizer.apply_chat_template(CONVERSATION[:2], tokenize=False)


def test_templates_that_name_tools_are_detected_also_among_named_templates():
    assert template_supports_tools(SimpleNamespace(chat_template=TOOLS_TEMPLATE))
    assert template_supports_tools(SimpleNamespace(chat_template={"default": "{{ x }}", "tool_use": TOOLS_TEMPLATE}))
    assert not template_supports_tools(SimpleNamespace(chat_template=None))


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral"])
def test_conversation_with_calls_and_results_renders_in_the_builtin_template(tokenizer, parser):
    p = get_parser(parser)
    messages, tools = prepare_messages(CONVERSATION, TOOLS, p, supports_tools=False)
    assert tools is None
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    system, user, assistant, results = messages
    assert system["role"] == "system" and '"name": "get_weather"' in system["content"]
    assert '"maxLength": 8' in system["content"], "the parameters' JSON schema is shown"
    assert user == CONVERSATION[0]
    # the history's calls are written so that the parser reads them back
    content, calls = p.extract(assistant["content"])
    assert content is None
    assert _names_args(calls) == [("get_weather", '{"city":"Paris"}'), ("get_time", '{"days_ahead":0}')]
    assert results["role"] == "user"  # both results in one turn
    assert "22 C, sunny" in results["content"] and "14:05" in results["content"]
    for part in (system["content"], assistant["content"], results["content"]):
        assert part in text
    assert "SmolLM" not in text, "our system prompt replaces the template's default one"


def test_hermes_results_are_tool_response_blocks_and_mistral_results_carry_call_ids():
    hermes_msgs, _ = prepare_messages(CONVERSATION, TOOLS, get_parser("hermes"), False)
    assert hermes_msgs[-1]["content"] == ("<tool_response>\n22 C, sunny\n</tool_response>\n"
                                          "<tool_response>\n14:05\n</tool_response>")
    mistral_msgs, _ = prepare_messages(CONVERSATION, TOOLS, get_parser("mistral"), False)
    assert mistral_msgs[-1]["content"].startswith(
        '[TOOL_RESULTS]{"content": "22 C, sunny", "call_id": "call_a"}[/TOOL_RESULTS]')
    llama_msgs, _ = prepare_messages(CONVERSATION, TOOLS, get_parser("llama3_json"), False)
    assert llama_msgs[-1]["content"].splitlines()[1] == '{"name": "get_time", "output": "14:05"}'


def test_tools_extend_an_existing_system_message_and_the_input_is_not_modified():
    conversation = [{"role": "system", "content": "Be brief."}] + CONVERSATION
    before = copy.deepcopy(conversation)
    messages, _ = prepare_messages(conversation, TOOLS, get_parser("hermes"), False)
    assert messages[0]["content"].startswith("Be brief.\n\n# Tools\n")
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert conversation == before


def test_without_tools_no_system_prompt_is_added_but_tool_turns_still_render(tokenizer):
    messages, tools = prepare_messages(CONVERSATION, None, get_parser("hermes"), False)
    assert tools is None and [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert "<tool_response>" in tokenizer.apply_chat_template(messages, tokenize=False)


def test_assistant_text_before_calls_is_kept():
    turn = {**CONVERSATION[1], "content": "Checking."}
    messages, _ = prepare_messages([CONVERSATION[0], turn], TOOLS, get_parser("hermes"), False)
    assert messages[-1]["content"].startswith("Checking.\n<tool_call>\n")


def test_tools_aware_template_gets_tools_and_calls_in_transformers_shape(tokenizer):
    messages, tools = prepare_messages(CONVERSATION, TOOLS, get_parser("hermes"), supports_tools=True)
    assert tools == TOOLS
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert messages[1]["content"] == ""
    assert messages[2] == {"role": "tool", "tool_call_id": "call_a", "content": "22 C, sunny",
                           "name": "get_weather"}
    text = tokenizer.apply_chat_template(messages, tools=tools, chat_template=TOOLS_TEMPLATE,
                                         tokenize=False, add_generation_prompt=True)
    assert "get_weather;get_time;" in text
    assert 'CALL get_weather city=Paris {"city": "Paris"}' in text
    assert "14:05 FROM get_time ID call_b" in text


@pytest.mark.parametrize("supports_tools", [False, True])
def test_tool_result_answering_no_earlier_call_is_an_error_naming_the_message(supports_tools):
    bad = CONVERSATION[:3] + [{"role": "tool", "tool_call_id": "call_zzz", "content": "?"}]
    with pytest.raises(ToolCallError, match="call_zzz") as e:
        prepare_messages(bad, TOOLS, get_parser("hermes"), supports_tools)
    assert (e.value.param, e.value.code) == ("messages[3].tool_call_id", None)


def test_call_arguments_that_are_not_a_json_object_are_an_error_naming_the_field():
    turn = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "[1]"}}]}
    with pytest.raises(ToolCallError) as e:
        prepare_messages([CONVERSATION[0], turn], TOOLS, get_parser("hermes"), False)
    assert e.value.param == "messages[1].tool_calls[0].function.arguments"


# -- grammar side ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ll_tokenizer(tokenizer):
    return llguidance.hf.from_tokenizer(tokenizer)


def _matcher(ll_tokenizer, grammar):
    compiled = llguidance.LLMatcher.grammar_from_lark(grammar)
    is_error, warnings = llguidance.LLMatcher.validate_grammar_with_warnings(compiled, ll_tokenizer)
    assert not is_error and not warnings, warnings
    return llguidance.LLMatcher(ll_tokenizer, compiled, log_level=0)


def _accepts(tokenizer, ll_tokenizer, grammar, text) -> bool:
    m = _matcher(ll_tokenizer, grammar)
    return m.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and m.is_accepting()


def _written(parser, *calls):
    return render_calls(get_parser(parser).format, list(calls))


PARIS = ("get_weather", {"city": "Paris", "unit": "celsius"})
TOMORROW = ("get_time", {"days_ahead": 1})


@pytest.mark.parametrize("choice", ["none", "auto", None])
def test_no_grammar_unless_a_call_is_required(choice):
    assert grammar_for(get_parser("hermes"), TOOLS, choice) is None


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral"])
def test_required_grammar_accepts_calls_in_the_format_and_rejects_wrong_ones(tokenizer, ll_tokenizer, parser):
    g = grammar_for(get_parser(parser), TOOLS, "required")
    ok = lambda *calls: _accepts(tokenizer, ll_tokenizer, g, _written(parser, *calls))  # noqa: E731
    assert ok(PARIS) and ok(TOMORROW) and ok(PARIS, TOMORROW)
    assert not ok(("get_wether", {"city": "Paris"})), "a name not among the tools"
    assert not ok(("get_weather", {"unit": "celsius"})), "a required argument missing"
    assert not ok(("get_weather", {"city": 5})), "an argument of the wrong type"
    assert not ok(("get_time", {"days_ahead": 12})), "an argument out of range"
    assert not ok(("get_time", {"days_ahead": 1, "tz": "UTC"})), "an argument the schema excludes"
    assert not _accepts(tokenizer, ll_tokenizer, g, "Sure! " + _written(parser, PARIS)), "content"
    assert not _accepts(tokenizer, ll_tokenizer, g, ""), "no call at all"


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral"])
def test_required_without_parallel_calls_allows_exactly_one(tokenizer, ll_tokenizer, parser):
    g = grammar_for(get_parser(parser), TOOLS, "required", parallel_tool_calls=False)
    assert _accepts(tokenizer, ll_tokenizer, g, _written(parser, TOMORROW))
    assert not _accepts(tokenizer, ll_tokenizer, g, _written(parser, PARIS, TOMORROW))


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral"])
def test_named_function_grammar_allows_that_function_once(tokenizer, ll_tokenizer, parser):
    g = grammar_for(get_parser(parser), TOOLS, {"type": "function", "function": {"name": "get_time"}})
    assert _accepts(tokenizer, ll_tokenizer, g, _written(parser, TOMORROW))
    assert not _accepts(tokenizer, ll_tokenizer, g, _written(parser, PARIS)), "another declared tool"
    assert not _accepts(tokenizer, ll_tokenizer, g, _written(parser, TOMORROW, TOMORROW))


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral"])
def test_whatever_the_grammar_lets_a_model_write_parses_into_schema_valid_calls(tokenizer, ll_tokenizer, parser):
    """A random walk over the allowed tokens (a model that picks anything the mask allows)."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    rng = np.random.default_rng(0)
    g = grammar_for(get_parser(parser), TOOLS, "required")
    for _ in range(4):
        m, ids = _matcher(ll_tokenizer, g), []
        while not (m.is_accepting() and ids and rng.random() < 0.5):
            assert len(ids) < 400, tokenizer.decode(ids)
            allowed = np.flatnonzero(np.unpackbits(np.frombuffer(m.compute_bitmask(), np.uint8),
                                                   bitorder="little"))
            allowed = allowed[allowed != tokenizer.eos_token_id]
            if not len(allowed):  # only the end is left
                break
            ids.append(int(rng.choice(allowed)))
            assert m.consume_token(ids[-1])
        content, calls = get_parser(parser).extract(tokenizer.decode(ids))
        assert content is None and calls
        for call in calls:
            jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])


def test_parameters_without_a_schema_mean_an_object_of_anything(tokenizer, ll_tokenizer):
    tools = [{"type": "function", "function": {"name": "ping"}}]
    g = grammar_for(get_parser("hermes"), tools, "required")
    assert _accepts(tokenizer, ll_tokenizer, g, _written("hermes", ("ping", {})))
    assert _accepts(tokenizer, ll_tokenizer, g, _written("hermes", ("ping", {"any": [1]})))


# -- validation -----------------------------------------------------------------------------------


def test_valid_tools_and_choices_have_no_error():
    for choice in (None, "none", "auto", "required", {"type": "function", "function": {"name": "get_time"}}):
        assert check_tools(TOOLS, choice) is None
    assert check_tools(None, "auto") is None and check_tools([], "none") is None


@pytest.mark.parametrize("tools,choice,param", [
    ([WEATHER_TOOL, TIME_TOOL, WEATHER_TOOL], "auto", "tools[2].function.name"),
    (None, "required", "tool_choice"),
    ([], {"type": "function", "function": {"name": "get_time"}}, "tool_choice"),
    (TOOLS, {"type": "function", "function": {"name": "get_date"}}, "tool_choice"),
    (TOOLS, {"type": "function", "name": "get_date"}, "tool_choice"),  # the Responses API's shape
])
def test_invalid_tools_or_choice_is_an_error_as_data(tools, choice, param):
    error = check_tools(tools, choice)
    assert isinstance(error, ToolCallError) and isinstance(error, InvalidRequest)
    assert (error.param, error.code) == (param, None)


@pytest.mark.parametrize("schema,problem", [
    ({"type": "object", "properties": {"a": {"type": "strin"}}}, "strin"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "missing"),
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=x)y"}}}, "look-around"),
])
def test_a_schema_the_grammar_cannot_enforce_is_an_error_only_when_a_call_is_forced(schema, problem):
    tools = [TIME_TOOL, {"type": "function", "function": {"name": "bad", "parameters": schema}}]
    for choice in ("required", {"type": "function", "function": {"name": "bad"}}):
        error = check_tools(tools, choice)
        assert (error.param, error.code) == ("tools[1].function.parameters", "invalid_function_parameters")
        assert problem in str(error)
    assert check_tools(tools, "auto") is None, "shown to the model, not enforced"
    assert check_tools(tools, {"type": "function", "function": {"name": "get_time"}}) is None
