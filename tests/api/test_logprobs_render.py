"""Exact logprobs objects (server/api/logprobs.py): each entry's own bytes, so the bytes of the
entries join to the text even where a character is split over tokens; legacy ``text_offset``
consistent with the text across stream chunks and with ``echo``; no entry for a hidden EOS."""
from __future__ import annotations

import pytest

from slipstream.server.api.logprobs import (CompletionLogprobs, TokenBytes, chat_logprobs,
                                            concat_completion_logprobs, drop_hidden_stop_token)
from slipstream.server.engine.outputs import Logprob
from slipstream.server.models.loader import load_tokenizer

TEXT = "Tea 🍵 and 世界 — “naïve” ✓"
EOS = 2  # <|im_end|>, SmolLM2's EOS and a special token


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("builtin")


@pytest.fixture(scope="module")
def tb(tokenizer):
    return TokenBytes(tokenizer)


@pytest.fixture(scope="module")
def ids(tokenizer, tb):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    split = [i for i in ids if not _valid(tb.bytes_of(i))]
    assert len(split) >= 3, "the text must spread characters over several byte-level tokens"
    return ids


def _valid(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def entries(ids, top=()):
    """One entry per token, each with logprob -i/10 and the given top alternatives."""
    return [Logprob(t, -i / 10, [(a, -5.0) for a in top]) for i, t in enumerate(ids)]


def char_offset(text: str, byte_pos: int) -> int:
    """The character of ``text`` that holds UTF-8 byte ``byte_pos`` (the end: ``len(text)``)."""
    return len(text.encode()[:byte_pos].decode("utf-8", errors="ignore"))


def expected_offsets(tb, ids, text):
    pos, out = 0, []
    for t in ids:
        out.append(char_offset(text, pos))
        pos += len(tb.bytes_of(t))
    return out


def stream_deltas(tb, ids):
    """The text a detokenizer hands out token by token: a character once its last byte came."""
    data, shown, deltas = b"", "", []
    for t in ids:
        data += tb.bytes_of(t)
        complete = data.decode("utf-8", errors="ignore")
        deltas.append(complete[len(shown):])
        shown = complete
    return deltas


def test_token_bytes_are_each_tokens_own_bytes(tb, tokenizer, ids):
    assert b"".join(tb.bytes_of(t) for t in ids).decode() == TEXT
    assert tb.bytes_of(EOS) == b"<|im_end|>" and tb.is_special(EOS) and not tb.is_special(ids[0])
    for t in range(0, len(tokenizer), 97):  # where a token decodes alone, the bytes are its text
        text = tokenizer.decode([t])
        if "\ufffd" not in text:
            assert tb.bytes_of(t).decode() == text


def test_chat_bytes_join_to_the_text_where_a_character_spans_tokens(tb, ids):
    body = chat_logprobs(entries(ids, top=[ids[0]]), tb)
    content = body["content"]
    assert body["refusal"] is None and len(content) == len(ids)
    assert b"".join(bytes(e["bytes"]) for e in content).decode() == TEXT
    assert all("\ufffd" not in e["token"] for e in content)
    partial = [e for e in content if not _valid(bytes(e["bytes"]))]
    assert partial and all("\\x" in e["token"] for e in partial)  # escaped, as OpenAI shows them
    assert [e["logprob"] for e in content] == [-i / 10 for i in range(len(ids))]
    assert all(e["top_logprobs"] == [{"token": tb.token(ids[0]), "logprob": -5.0,
                                      "bytes": list(tb.bytes_of(ids[0]))}] for e in content)


def test_a_partial_character_token_is_escaped_and_marked_in_legacy_tokens(tb):
    dash_start = next(t for t in range(len(tb)) if tb.bytes_of(t) == b"\xe2\x80")  # the first 2 of 3 bytes of "—"
    assert tb.token(dash_start) == "\\xe2\\x80"
    assert tb.legacy_token(dash_start) == "bytes:\\xe2\\x80"
    assert tb.legacy_token(EOS) == "<|im_end|>"


def test_text_offset_is_each_tokens_character_never_past_the_end(tb, ids):
    lp = CompletionLogprobs(tb).add(entries(ids), TEXT)
    assert lp["text_offset"] == expected_offsets(tb, ids, TEXT)
    assert lp["text_offset"] == sorted(lp["text_offset"]) and max(lp["text_offset"]) < len(TEXT)
    assert lp["token_logprobs"] == [-i / 10 for i in range(len(ids))]
    assert lp["tokens"] == [tb.legacy_token(t) for t in ids]


def test_stream_chunks_continue_the_offsets(tb, ids):
    state = CompletionLogprobs(tb)
    pieces = [state.add([e], delta) for e, delta in zip(entries(ids), stream_deltas(tb, ids))]
    whole = CompletionLogprobs(tb).add(entries(ids), TEXT)
    assert concat_completion_logprobs(pieces) == whole
    assert all(len(p["tokens"]) == 1 for p in pieces)


def test_top_logprobs_hold_the_top_n_and_the_chosen_token(tb, ids):
    lp = CompletionLogprobs(tb).add([Logprob(ids[0], -0.5, [(ids[1], -0.1), (ids[2], -0.7)])], "x")
    assert lp["top_logprobs"] == [{tb.legacy_token(ids[1]): -0.1, tb.legacy_token(ids[2]): -0.7,
                                   tb.legacy_token(ids[0]): -0.5}]


def test_echo_renders_prompt_then_completion_with_offsets_through_both(tb, tokenizer, ids):
    prompt_text = "Q: tea?\nA:"
    prompt = tokenizer.encode(prompt_text, add_special_tokens=False)
    prompt_lps = [None] + [Logprob(t, -1.0, [(t, -1.0)]) for t in prompt[1:]]
    state = CompletionLogprobs(tb)
    lp = concat_completion_logprobs([state.add_prompt(prompt, prompt_lps, prompt_text),
                                     state.add(entries(ids), TEXT)])
    n = len(prompt)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n + len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:n] == [-1.0] * (n - 1)
    assert lp["top_logprobs"][1] == {tb.legacy_token(prompt[1]): -1.0}
    assert lp["text_offset"] == expected_offsets(tb, prompt + ids, prompt_text + TEXT)
    assert lp["text_offset"][n] == len(prompt_text)


def test_echo_needs_one_entry_per_prompt_token(tb):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        CompletionLogprobs(tb).add_prompt([1, 2, 3], [None, Logprob(2, -1.0)], "abc")


def test_eos_entry_is_dropped_when_the_text_leaves_it_out(tb, ids):
    ended = entries(ids[:3] + [EOS])
    assert drop_hidden_stop_token(ended, "stop", None, tb) == ended[:3]
    assert drop_hidden_stop_token(ended, "stop", EOS, tb) == ended[:3]  # EOS given as a stop token id
    # "<|im_end|>" is in the text:
    assert drop_hidden_stop_token(ended, "stop", None, tb, skip_special_tokens=False) == ended
    assert drop_hidden_stop_token(ended, "length", None, tb) == ended
    plain_stop = entries(ids[:3])
    assert drop_hidden_stop_token(plain_stop, "stop", ids[2], tb) == plain_stop  # its text is in the output
    assert drop_hidden_stop_token(plain_stop, "stop", "na", tb) == plain_stop  # a stop string
    assert drop_hidden_stop_token([], "stop", None, tb) == []


def test_tokens_after_a_cut_stop_string_point_at_the_end(tb, tokenizer):
    ids = tokenizer.encode("Hello\n\n", add_special_tokens=False)
    lp = CompletionLogprobs(tb).add(entries(ids), "Hello")  # the stop string "\n\n" was cut
    assert lp["text_offset"][0] == 0 and all(o <= len("Hello") for o in lp["text_offset"])
    assert lp["text_offset"][-1] == len("Hello")


def test_skipped_special_token_takes_no_room_in_the_text(tb, tokenizer):
    hello = tokenizer.encode("Hi", add_special_tokens=False)
    world = tokenizer.encode(" there", add_special_tokens=False)
    ids = hello + [1] + world  # <|im_start|> in the middle, left out of the text
    lp = CompletionLogprobs(tb).add(entries(ids), "Hi there")
    after = [2 + o for o in expected_offsets(tb, world, " there")]
    assert lp["text_offset"] == expected_offsets(tb, hello, "Hi") + [2] + after
    kept = CompletionLogprobs(tb, skip_special_tokens=False).add(entries(ids), "Hi<|im_start|> there")
    assert kept["text_offset"][len(hello) + 1] == len("Hi<|im_start|>")


def test_sentencepiece_byte_fallback_and_word_boundary():
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "\u2581Hello": 3, "<0xE4>": 4, "<0xB8>": 5, "<0x96>": 6, "\u2581": 7}
    raw = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    raw.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tb = TokenBytes(tok)
    assert [tb.bytes_of(i) for i in (3, 4, 5, 6, 7)] == [b" Hello", b"\xe4", b"\xb8", b"\x96", b" "]
    assert tb.bytes_of(2) == b"</s>" and tb.is_special(2) and tb.bytes_of(99) == b""
    body = chat_logprobs(entries([3, 7, 4, 5, 6]), tb)
    assert b"".join(bytes(e["bytes"]) for e in body["content"]).decode() == " Hello 世"
    assert CompletionLogprobs(tb).add(entries([3, 7, 4, 5, 6]), " Hello 世")["text_offset"] == [0, 6, 7, 7, 7]
