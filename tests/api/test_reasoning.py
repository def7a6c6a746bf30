"""Reasoning apart from content (issue 13, item 5): ``--reasoning-parser qwen3 | deepseek_r1`` —
the parsers (whole and streamed at every split point), their composition with the tool-call
stream, and the chat endpoint over HTTP with the built-in model."""
from __future__ import annotations

from typing import Any

import pytest

from slipstream.server.api.reasoning import (PARSERS, ReasoningParser, UnknownReasoningParser,
                                             get_reasoning_parser)
from slipstream.server.api.state import ServerOptions, ServerState
from slipstream.server.api.tools import get_parser

from .harness import Http, assert_engine_idle, serve_app
from .test_api_vllm_fields import stream_chunks

QWEN3 = get_reasoning_parser("qwen3")
R1 = get_reasoning_parser("deepseek_r1")


def streamed(parser: ReasoningParser, pieces: list[str], inside: bool | None = None) -> tuple[str | None, str | None]:
    """Reasoning and content as a stream of ``pieces`` sends them (None when nothing was sent)."""
    stream = parser.stream(inside=inside)
    deltas = [d for p in pieces for d in stream.feed(p)] + stream.finish()
    for d in deltas:
        assert len(d) == 1 and next(iter(d.values())), d  # one non-empty field per delta
    kinds = [next(iter(d)) for d in deltas]
    assert kinds == sorted(kinds, key=["reasoning_content", "content"].index), kinds  # reasoning first
    reasoning = "".join(d["reasoning_content"] for d in deltas if "reasoning_content" in d)
    content = "".join(d["content"] for d in deltas if "content" in d)
    return reasoning or None, content or None


# (parser, inside, output, reasoning, content)
CASES = [
    (QWEN3, None, "<think>\nLet me see.\n</think>\n\nParis.", "\nLet me see.\n", "\n\nParis."),
    (QWEN3, None, "  \n<think>a</think>b", "a", "b"),  # whitespace before the opening tag goes with it
    (QWEN3, None, "Paris.", None, "Paris."),  # thinking disabled: no tags, all content
    (QWEN3, None, "  Paris.", None, "  Paris."),
    (QWEN3, None, "<think>cut off at max_tok", "cut off at max_tok", None),  # unterminated: all reasoning
    (QWEN3, None, "<think></think>Paris.", None, "Paris."),
    (QWEN3, None, "<think>a</think>", "a", None),
    (QWEN3, None, "Say <think>x</think> y", None, "Say <think>x</think> y"),  # a later tag is text
    (QWEN3, None, "<thin", None, "<thin"),  # a partial tag at the end is text once the output ends
    (QWEN3, None, "<think>a</thin", "a</thin", None),
    (QWEN3, None, "<think>a</think>b</think>c", "a", "b</think>c"),  # the first close ends it
    (QWEN3, True, "still thinking</think>Paris.", "still thinking", "Paris."),  # the prompt opened it
    (R1, None, "I think.\n</think>\n\nParis.", "I think.\n", "\n\nParis."),  # the template opened it
    (R1, None, "<think>\nI think.</think>Paris.", "\nI think.", "Paris."),  # R1-0528 writes it again
    (R1, None, "unterminated at max_tokens", "unterminated at max_tokens", None),
    (R1, None, "</think>Paris.", None, "Paris."),
    (R1, False, "Paris.", None, "Paris."),  # the prompt closed it (thinking disabled)
    (R1, False, "<think>a</think>b", "a", "b"),
    (QWEN3, None, "", None, None),
]


@pytest.mark.parametrize("parser, inside, text, reasoning, content", CASES)
def test_extract_splits_reasoning_from_content(parser, inside, text, reasoning, content):
    assert parser.extract(text, inside=inside) == (reasoning, content)


@pytest.mark.parametrize("parser, inside, text, reasoning, content", CASES)
def test_a_stream_split_at_any_two_points_sends_what_extract_returns(parser, inside, text, reasoning, content):
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            assert streamed(parser, [text[:i], text[i:j], text[j:]], inside) == (reasoning, content), (i, j)


def test_a_stream_of_single_characters_sends_what_extract_returns():
    text = " <think>x < y </thi </think> ok </think"
    for parser in PARSERS.values():
        for inside in (True, False):
            assert streamed(parser, list(text), inside) == parser.extract(text, inside=inside)


def test_a_stream_holds_back_only_a_possible_tag():
    stream = QWEN3.stream()
    assert stream.feed("  <thi") == []  # may still open the reasoning
    assert stream.feed("nk>Hm, a<") == [{"reasoning_content": "Hm, a"}]  # "<" may begin "</think>"
    assert stream.feed("b") == [{"reasoning_content": "<b"}]
    assert stream.feed("</th") == []
    assert stream.feed("ink>\nSo") == [{"content": "\nSo"}]
    assert stream.feed(" <think>") == [{"content": " <think>"}]  # content is never held
    assert stream.finish() == []


def test_content_without_a_tag_streams_at_once_after_the_first_word():
    stream = QWEN3.stream()
    assert stream.feed(" ") == []
    assert stream.feed("Paris") == [{"content": " Paris"}]
    assert stream.feed(" is") == [{"content": " is"}]


def test_the_prompt_decides_where_the_output_starts():
    assert QWEN3.starts_inside("<|im_start|>assistant\n<think>\n")  # Qwen3-Thinking-2507
    assert not QWEN3.starts_inside("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # enable_thinking false
    assert not QWEN3.starts_inside("<|im_start|>assistant\n")  # Qwen3 writes <think> itself
    assert R1.starts_inside("<｜Assistant｜>")  # R1 may skip writing <think>
    assert not R1.starts_inside("<｜Assistant｜><think>\n\n</think>\n\n")
    assert QWEN3.starts_inside("<|im_start|>assistant\n<think>I am thinking")  # continue_final_message


@pytest.mark.parametrize("fmt, call_text", [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'),
])
def test_a_tool_call_after_the_reasoning_is_read_from_the_content(fmt, call_text):
    text = "<think>I should call get_weather.</think>\n\n" + call_text
    reasoning, content = QWEN3.extract(text)
    assert reasoning == "I should call get_weather."
    tools = get_parser(fmt)
    rest, calls = tools.extract(content)
    assert rest is None and [c["function"] for c in calls] == [{"name": "get_weather", "arguments": '{"city":"Paris"}'}]
    for cut in range(len(text) + 1):  # the content deltas' text fed on into the tool-call stream
        split, calls = QWEN3.stream(), tools.stream()
        out = []
        for piece in [text[:cut], text[cut:]]:
            for d in split.feed(piece):
                out += [d] if "reasoning_content" in d else calls.feed(d["content"])
        for d in split.finish():
            out += [d] if "reasoning_content" in d else calls.feed(d["content"])
        out += calls.finish()
        assert "".join(d.get("reasoning_content", "") for d in out) == "I should call get_weather."
        assert not any("content" in d for d in out), (cut, out)
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls.tool_calls] \
            == [("get_weather", '{"city":"Paris"}')], cut


def test_an_unknown_parser_is_a_value_error_naming_the_option():
    with pytest.raises(UnknownReasoningParser, match="deepseek_r1, qwen3") as e:
        get_reasoning_parser("granite")
    assert isinstance(e.value, ValueError) and e.value.param == "reasoning_parser"
    with pytest.raises(UnknownReasoningParser):
        ServerState(ServerOptions(reasoning_parser="granite"))
    assert ServerState(ServerOptions()).reasoning_parser is None


def test_the_cli_offers_every_parser():
    from slipstream.server.cli import serve_parser

    action = next(a for a in serve_parser()._actions if a.dest == "reasoning_parser")
    assert sorted(action.choices) == sorted(PARSERS) and action.default is None


# --- over HTTP, with the built-in model ------------------------------------------------------------

THINK_THEN_ANSWER = {"regex": "<think>[a-z ]{1,20}</think>[A-Z][a-z ]{1,20}"}
ASK = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def http(loop_thread, engine):
    with serve_app(loop_thread, engine, reasoning_parser="qwen3") as served, Http(served.url) as client:
        yield client
    assert_engine_idle(engine)


def chat(http: Http, **fields: Any) -> dict:
    r = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 60, "temperature": 0, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def stream_parts(http: Http, **fields: Any) -> tuple[str, str, list[dict]]:
    """Reasoning and content as streamed, and the choice deltas."""
    chunks = stream_chunks(http, "/v1/chat/completions",
                           {"messages": ASK, "max_tokens": 60, "temperature": 0, **fields})
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    for d in deltas:
        assert d.get("reasoning") == d.get("reasoning_content"), d
    return ("".join(d.get("reasoning_content") or "" for d in deltas),
            "".join(d.get("content") or "" for d in deltas), deltas)


def test_reasoning_forced_by_a_regex_comes_back_apart_whole_and_streamed(http):
    body = chat(http, structured_outputs=THINK_THEN_ANSWER)
    message = body["choices"][0]["message"]
    reasoning, content = message["reasoning_content"], message["content"]
    assert message["reasoning"] == reasoning
    assert reasoning and content and "<think>" not in reasoning + content and "</think>" not in reasoning + content
    assert content[0].isupper() and len(reasoning) <= 20
    streamed_reasoning, streamed_content, deltas = stream_parts(http, structured_outputs=THINK_THEN_ANSWER)
    assert (streamed_reasoning, streamed_content) == (reasoning, content)
    kinds = [k for d in deltas for k in ("reasoning_content", "content") if d.get(k)]
    assert kinds == sorted(kinds, key=["reasoning_content", "content"].index)  # reasoning, then content


def test_an_output_continuing_an_open_think_block_is_reasoning_until_it_closes(http, server):
    messages = ASK + [{"role": "assistant", "content": "<think>I am thinking"}]
    fields = dict(messages=messages, continue_final_message=True, add_generation_prompt=False,
                  max_tokens=12, ignore_eos=True)
    with Http(server.url) as plain:  # the same engine without a reasoning parser: the raw output
        raw = chat(plain, **fields)["choices"][0]["message"]["content"]
    message = chat(http, **fields)["choices"][0]["message"]
    expected = QWEN3.extract(raw, inside=True)
    assert expected[0] is not None  # the output starts inside the reasoning the prompt opened
    assert (message["reasoning_content"], message["content"]) == expected
    assert stream_parts(http, **fields)[:2] == (expected[0] or "", expected[1] or "")


def test_without_a_reasoning_parser_the_message_has_no_reasoning_fields(server):
    with Http(server.url) as client:
        message = chat(client, structured_outputs=THINK_THEN_ANSWER)["choices"][0]["message"]
    assert message["content"].startswith("<think>") and "reasoning_content" not in message


def test_a_grammar_shaped_output_starts_outside_the_reasoning_even_for_deepseek_r1(loop_thread, engine):
    with serve_app(loop_thread, engine, reasoning_parser="deepseek_r1") as served, Http(served.url) as client:
        plain = chat(client, structured_outputs={"regex": "[A-Z][a-z ]{1,20}"})["choices"][0]["message"]
        free = chat(client, max_tokens=6, ignore_eos=True)["choices"][0]["message"]
    assert plain["content"] and plain["reasoning_content"] is None  # the grammar allowed no <think>
    assert free["reasoning_content"] and free["content"] is None  # R1: unclosed reasoning from the start
