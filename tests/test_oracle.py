"""Greedy output equals Hugging Face transformers' token for token on the same GGUF weights —
alone, batched, preempted, chunked and after a prefix-cache hit.

The shared ``loaded`` model serves the file's Q4_1/Q8_0 blocks as stored (the CPU default);
transformers dequantizes the same file to fp32. The dequantized path (``quantization="none"``)
is checked on the batch too."""
from __future__ import annotations

import os

import pytest
import torch

from slipstream.server.engine import SamplingParams

MAX_TOKENS = 24
LONG_SYSTEM = ("You are a meticulous assistant for a shipping company. You answer questions about "
               "parcels, customs forms, delivery windows and insurance. Be brief and exact. ") * 3


def _chat(tok, messages):
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def prompts(loaded):
    tok = loaded.tokenizer
    story = " ".join(f"On day {i} the explorer walked north, counted {i * 3} birds and wrote it down." for i in range(1, 40))
    ps = [
        _chat(tok, [{"role": "user", "content": "What is the capital of France?"}]),
        _chat(tok, [{"role": "user", "content": "Write a haiku about the sea."}]),
        _chat(tok, [{"role": "system", "content": LONG_SYSTEM},
                    {"role": "user", "content": "How long does a parcel to Canada take?"}]),
        _chat(tok, [{"role": "system", "content": LONG_SYSTEM},
                    {"role": "user", "content": "Do I need a customs form for books?"}]),
        _chat(tok, [{"role": "user", "content": "Summarise this log:\n" + story}]),  # many blocks, > one chunk
        tok.encode("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"),
        tok.encode("The three primary colours are"),
        tok.encode("1, 2, 3, 4,"),
    ]
    lengths = [len(p) for p in ps]
    assert max(lengths) > 256 and min(lengths) < 16, lengths
    return ps


@pytest.fixture(scope="module")
def expected(loaded, prompts):
    """transformers' own GGUF loader and greedy ``generate`` — the oracle."""
    from transformers import AutoModelForCausalLM

    path = loaded.path
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=torch.float32)
    hf.eval()
    eos = loaded.tokenizer.eos_token_id
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=eos, pad_token_id=eos)
            out.append(ids[0, len(p):].tolist())
    assert any(len(o) == MAX_TOKENS for o in out) and any(o[-1] == eos for o in out), "want both finish kinds"
    return out


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.slow
def test_one_at_a_time_matches_transformers(make_llm, prompts, expected):
    llm = make_llm(max_num_batched_tokens=512)
    for p, want in zip(prompts, expected):
        assert _tokens(llm.generate(p, GREEDY)) == [want]


def test_one_batch_matches_transformers(make_llm, prompts, expected):
    llm = make_llm(max_num_batched_tokens=2048, trace=True)
    assert _tokens(llm.generate(prompts, GREEDY)) == expected
    first = llm.engine.trace[0]
    assert len(first.scheduled) == len(prompts), "all prompts should share the first step"


def test_every_cpu_kernel_path_matches_transformers(make_llm, prompts, expected, cpu_isa):
    """The batch on each path this CPU executes (AVX-512, AVX2, generic on x86-64), forced: the
    quantized products, the one-call decode step and the decode attention of that path."""
    llm = make_llm(max_num_batched_tokens=2048)
    assert _tokens(llm.generate(prompts, GREEDY)) == expected


def test_dequantized_fp32_weights_match_transformers_too(prompts, expected, no_leaks):
    from slipstream.server.engine import LLM
    from slipstream.server.models.loader import load_model

    dense = load_model("builtin", torch.device("cpu"), torch.float32, "none")
    assert type(dense.model.lm_head).__name__ == "Linear"
    llm = LLM(loaded=dense, max_num_batched_tokens=2048)
    assert _tokens(llm.generate(prompts, GREEDY)) == expected
    no_leaks(llm.engine)


@pytest.mark.slow
def test_preemption_keeps_output_exact(make_llm, prompts, expected):
    longest = max(len(p) for p in prompts) + MAX_TOKENS
    blocks = -(-longest // 16) + 2
    llm = make_llm(kv_cache_memory_bytes=blocks * 16 * 46080, max_num_batched_tokens=1024)
    assert llm.engine.kv.num_blocks == blocks
    assert _tokens(llm.generate(prompts, GREEDY)) == expected
    assert llm.engine.scheduler.num_preemptions > 0, "the cache was meant to be too small for all at once"


@pytest.mark.slow
def test_chunked_prefill_keeps_output_exact(make_llm, prompts, expected):
    llm = make_llm(max_num_batched_tokens=48, trace=True)
    assert _tokens(llm.generate(prompts, GREEDY)) == expected
    prefill_steps: dict[str, int] = {}
    for rec in llm.engine.trace:
        for rid, prefill, _ in rec.scheduled:
            if prefill:
                prefill_steps[rid] = prefill_steps.get(rid, 0) + 1
    assert max(prefill_steps.values()) >= 5, "the long prompt should have been prefilled in chunks"
    assert any(r.num_prefill_tokens and r.num_decode_tokens for r in llm.engine.trace), \
        "some step should carry a prefill chunk beside decode tokens"
    assert all(rec.num_tokens <= 48 for rec in llm.engine.trace)


@pytest.mark.slow
def test_long_prefill_threshold_keeps_output_exact(make_llm, prompts, expected):
    """The longest prompt first, at a threshold of 16: its chunks are cut at 16 tokens beside the
    short prompts behind it, and at the budget once alone."""
    order = [4, 6, 7, 5, 0, 1, 2, 3]  # the story, two prompts of 16 tokens or fewer, then longer ones
    assert len(prompts[4]) > 256 and [len(prompts[i]) for i in (6, 7)] == [5, 11] and len(prompts[5]) > 16
    llm = make_llm(max_num_batched_tokens=48, long_prefill_token_threshold=16, trace=True)
    assert _tokens(llm.generate([prompts[i] for i in order], GREEDY)) == [expected[i] for i in order]
    assert [p for _, p, _ in llm.engine.trace[0].scheduled] == [16, 5, 11]
    assert all(rec.num_tokens <= 48 for rec in llm.engine.trace)


@pytest.mark.slow
def test_prefix_cache_hit_keeps_output_exact(make_llm, prompts, expected):
    llm = make_llm()
    assert _tokens(llm.generate(prompts[2], GREEDY)) == [expected[2]]  # warms the long system prompt
    hits = llm.engine.kv.prefix_hits
    out = llm.generate(prompts[3], GREEDY)
    assert _tokens(out) == [expected[3]]
    assert llm.engine.kv.prefix_hits - hits >= 48, "the shared system prompt should come from the cache"
    assert out[0].num_cached_tokens >= 48
    # The same prompt again: every full block but the one holding the last token is cached.
    again = llm.generate(prompts[3], GREEDY)
    assert _tokens(again) == [expected[3]]
    assert again[0].num_cached_tokens == (len(prompts[3]) - 1) // 16 * 16


@pytest.mark.parametrize("small_batch_rows, kernel_max_rows", [(0, 0), (16, 64)])
def test_the_batch_matches_transformers_at_either_extreme_of_the_cpu_crossovers(
        make_llm, prompts, expected, monkeypatch, small_batch_rows, kernel_max_rows):
    """A machine's calibration (models/crossover.py) may move every linear to the other method:
    the dequantize-then-GEMM path for every row count, or the block kernel up to 64 rows."""
    from slipstream.server.models import layers, quant

    monkeypatch.setattr(layers, "SMALL_BATCH_ROWS", small_batch_rows)
    monkeypatch.setattr(quant, "KERNEL_MAX_ROWS", kernel_max_rows)
    llm = make_llm(max_num_batched_tokens=2048)
    assert _tokens(llm.generate(prompts, GREEDY)) == expected
