"""Tiny random-weight Hugging Face checkpoints built in the test, and transformers' greedy output
on them: the oracle for architectures the built-in model does not cover (sliding windows, Gemma).

Weights are drawn with a large ``initializer_range`` so logits are peaked: with the default 0.02 a
random model's top two logits differ by less than summation-order noise and greedy decoding
would compare rounding, not the model. Nothing is downloaded: the tokenizer is the built-in
model's, saved next to the weights.
"""
from __future__ import annotations

from pathlib import Path

import torch

from slipstream.server.engine import LLM, SamplingParams

MAX_TOKENS = 20


def save_checkpoint(model_cls, config, path: Path, seed: int = 0, post_norm_gain: float | None = None) -> Path:
    """Build ``model_cls(config)`` with seeded random weights and save it (safetensors) with the
    built-in tokenizer into ``path``; ``config``'s vocabulary must cover the tokenizer's.

    ``post_norm_gain``: draw the weights of norms named ``post_*`` around it. Gemma's sublayer
    outputs pass such norms before the residual sum; at their initial ``1 + 0`` the scaled input
    embedding dominates the residual and, with tied embeddings, each step repeats its input token.
    """
    from slipstream.server.models.loader import load_tokenizer

    tok = load_tokenizer("builtin")
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    if post_norm_gain is not None:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if ".post_" in name and "norm" in name:
                    param.normal_(post_norm_gain, 0.5)
    model.save_pretrained(str(path), safe_serialization=True)
    tok.save_pretrained(str(path))
    return path


def prompts(path: Path, window: int) -> list[list[int]]:
    """Four prompts, three longer than ``window`` tokens (one over three windows), one shorter;
    the last two share a prefix of more than two 16-token blocks (for prefix caching)."""
    from slipstream.server.models.loader import load_tokenizer

    tok = load_tokenizer(str(path))
    shared = ("The lighthouse keeper wrote in the log every night: wind from the west, three ships, calm sea, "
              "one gull on the rail, the tide at six, the fog gone by nine, the bell rung twice, ")
    texts = ["Once upon a time",
             " ".join(f"Item {i} costs {i * 7} coins and weighs {i + 2} pounds." for i in range(8)),
             shared + "and a storm far away in the north.",
             shared + "and the lamp burning until dawn."]
    ps = [tok.encode(t) for t in texts]
    lengths = [len(p) for p in ps]
    assert min(lengths) < window < 3 * window < max(lengths), lengths
    assert ps[2][:34] == ps[3][:34], "the last two prompts must share a prefix of two full blocks and more"
    return ps


def hf_greedy(path: Path, model_cls, ps: list[list[int]], eos: int, **overrides) -> list[list[int]]:
    """transformers' ``generate(do_sample=False)`` on the saved checkpoint, eager attention (SDPA
    ignores Gemma 2's soft-cap), one prompt at a time; ``overrides`` change the config."""
    model = model_cls.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager", **overrides).eval()
    return greedy(model, ps, eos)


def greedy(model, ps: list[list[int]], eos: int, max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    """A transformers model's greedy continuation of each prompt, one at a time (the oracle)."""
    out = []
    with torch.inference_mode():
        for p in ps:
            ids = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos, pad_token_id=eos)
            out.append(ids[0, len(p):].tolist())
    return out


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def assert_not_degenerate(expected: list[list[int]]) -> None:
    """Random weights must still give varied output, or token-for-token equality proves little."""
    assert all(len(o) == MAX_TOKENS for o in expected), "an early EOS leaves too little to compare"
    assert len({t for o in expected for t in o}) >= 12, expected
    assert len({tuple(o) for o in expected}) == len(expected), "every prompt should continue differently"


def check_engine_modes(path: Path, ps: list[list[int]], expected: list[list[int]], no_leaks) -> None:
    """slipstream's greedy tokens equal ``expected`` one prompt at a time, batched, in small
    prefill chunks, under preemption and after a prefix-cache hit; no block leaks after each."""
    alone = LLM(model=str(path))
    assert [tokens(alone.generate(p, GREEDY))[0] for p in ps] == expected
    no_leaks(alone.engine)

    batched = LLM(model=str(path), max_num_batched_tokens=2048, trace=True)
    assert tokens(batched.generate(ps, GREEDY)) == expected
    assert len(batched.engine.trace[0].scheduled) == len(ps), "all prompts should share the first step"
    no_leaks(batched.engine)

    chunked = LLM(model=str(path), max_num_batched_tokens=12, trace=True)
    assert tokens(chunked.generate(ps, GREEDY)) == expected
    assert all(rec.num_tokens <= 12 for rec in chunked.engine.trace)
    assert any(rec.num_prefill_tokens and rec.num_decode_tokens for rec in chunked.engine.trace)
    no_leaks(chunked.engine)

    cfg = batched.engine.runner.model.cfg
    longest = max(len(p) for p in ps) + MAX_TOKENS
    # Behind a sliding window a request holds only the window's blocks and a chunk's: small chunks
    # keep that few, so the cache is still too small for all four at once.
    chunk = 12 if cfg.kv_window else None
    blocks = batched.engine.kv.max_blocks_held(longest, chunk or longest) + 1  # the longest request fits
    small = LLM(model=str(path), kv_cache_memory_bytes=blocks * 16 * cfg.kv_bytes_per_token(4),
                **({"max_num_batched_tokens": chunk} if chunk else {}))
    assert small.engine.kv.num_blocks == blocks
    assert tokens(small.generate(ps, GREEDY)) == expected
    assert small.engine.scheduler.num_preemptions > 0, "the cache was meant to be too small for all at once"
    no_leaks(small.engine)

    cached = LLM(model=str(path))
    assert tokens(cached.generate(ps[2], GREEDY)) == [expected[2]]
    out = cached.generate(ps[3], GREEDY)
    assert tokens(out) == [expected[3]]
    assert out[0].num_cached_tokens >= 32, "the shared prefix should come from the cache"
    no_leaks(cached.engine)
