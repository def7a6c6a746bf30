"""Incremental text: stop strings never partly emitted, multi-byte characters never broken."""
from __future__ import annotations

from slipstream.server.engine import SamplingParams
from slipstream.server.engine.detokenizer import IncrementalDetokenizer


def stream(tok, ids, stop=(), include_stop=False):
    d = IncrementalDetokenizer(tok, [], list(stop), include_stop=include_stop)
    pieces = []
    for i, t in enumerate(ids):
        hit = d.append(t)
        pieces.append(d.take(finished=hit is not None or i == len(ids) - 1))
        if hit:
            break
    return pieces, d


def test_multibyte_character_split_across_tokens_streams_intact(loaded):
    tok = loaded.tokenizer
    text = "Tea 🍵 and café ☕ in 東京"
    ids = tok.encode(text, add_special_tokens=False)
    singles = [tok.decode([t]) for t in ids]
    assert any("\ufffd" in s for s in singles), "the test needs a character split across tokens"
    pieces, _ = stream(tok, ids)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text


def test_stop_string_spanning_two_tokens_is_found_and_never_partly_emitted(loaded):
    tok = loaded.tokenizer
    text = "alpha beta gamma delta epsilon"
    ids = tok.encode(text, add_special_tokens=False)
    stop = "ma del"  # ends one token, starts the next
    assert not any(stop in tok.decode([t]) for t in ids)
    pieces, d = stream(tok, ids, stop=[stop])
    assert d.stopped_by == stop
    assert "".join(pieces) == "alpha beta gam"
    for i in range(1, len(pieces) + 1):  # at no point did anything past the cut leave
        assert "alpha beta gam".startswith("".join(pieces[:i]))


def test_included_stop_string_spanning_two_tokens_ends_the_text_and_nothing_after_it_leaves(loaded):
    tok = loaded.tokenizer
    ids = tok.encode("alpha beta gamma delta epsilon", add_special_tokens=False)
    pieces, d = stream(tok, ids, stop=["ma del"], include_stop=True)
    assert d.stopped_by == "ma del"
    assert "".join(pieces) == "alpha beta gamma del"


def test_text_without_stop_is_held_back_only_while_it_could_still_match(loaded):
    tok = loaded.tokenizer
    ids = tok.encode("one two three", add_special_tokens=False)
    pieces, d = stream(tok, ids, stop=["threes"])
    assert d.stopped_by is None and "".join(pieces) == "one two three"


def test_engine_applies_stop_strings(make_llm):
    llm = make_llm()
    full = llm.generate("1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    assert " 6," in full.text, full.text
    cut = llm.generate("1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=12, stop=[" 6,"]))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == " 6,"
    assert cut.text == full.text[:full.text.index(" 6,")]
