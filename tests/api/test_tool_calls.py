"""Tool calls (issue 13, item 3): the parsers of ``--tool-call-parser`` (finished and streamed),
the prompt side for chat templates with and without tools, the grammars of ``tool_choice``, and
the validation of ``tools``/``tool_choice``. Pure functions; the tokenizer is the built-in
model's, loaded once."""
from __future__ import annotations

import json
import random
import re

import pytest

from slipstream.server.api.tools import get_parser
from slipstream.server.api.tools.formats import UnknownToolParser

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


def _stream(parser, chunks):
    """Feed ``chunks``; check the deltas' shapes; return (content, [(name, args)], ids)."""
    stream = get_parser(parser).stream()
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


def test_stream_sends_plain_text_at_once_and_holds_only_a_possible_marker():
    stream = get_parser("hermes").stream()
    assert stream.feed("Hello") == [{"content": "Hello"}]
    assert stream.feed(" <tool") == []  # may be "<tool_call>": held, with the space before it
    assert stream.feed("box>") == [{"content": " <toolbox>"}]
    assert stream.finish() == []


def test_stream_announces_a_call_once_its_name_is_known_and_streams_arguments():
    stream = get_parser("hermes").stream()
    assert stream.feed('<tool_call>\n{"name": "get_weather", ') == []
    header, first = stream.feed('"arguments": {"city": "Pa')
    call = header["tool_calls"][0]
    assert call["index"] == 0 and call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": ""}
    assert first == {"tool_calls": [{"index": 0, "function": {"arguments": '{"city":"Pa'}}]}
    assert stream.feed('ris"}}\n</tool_call>') == [
        {"tool_calls": [{"index": 0, "function": {"arguments": 'ris"}'}}]}]
    assert stream.finish() == []
    assert stream.tool_calls[0]["function"] == {"name": "get_weather", "arguments": '{"city":"Paris"}'}


@pytest.mark.parametrize("parser,text,call", BROKEN_AFTER_ANNOUNCE)
def test_output_broken_after_a_call_was_announced_is_content_to_extract_but_streamed_as_that_call(
        parser, text, call):
    assert get_parser(parser).extract(text) == (text, [])
    assert _stream(parser, list(text))[1] == [call]  # token by token, the call was sent
    for i in range(len(text) + 1):  # a delta that already holds the break lets the stream see it
        content, calls = _stream(parser, [text[:i], text[i:]])
        assert (content, calls) == (text, []) or (calls and calls[0][0] == call[0]
                                                 and call[1].startswith(calls[0][1])), f"split at {i}"


def test_marker_formats_ask_the_detokenizer_to_keep_special_tokens():
    assert get_parser("hermes").skip_special_tokens is True
    assert get_parser("llama3_json").skip_special_tokens is False
    assert get_parser("mistral").skip_special_tokens is False


def test_unknown_parser_name_is_a_value_error_naming_the_choices():
    with pytest.raises(UnknownToolParser, match="hermes, llama3_json, mistral") as e:
        get_parser("qwen")
    assert isinstance(e.value, ValueError) and e.value.param == "tool_call_parser"
