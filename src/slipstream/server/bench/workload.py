"""A seeded synthetic workload shared by the benchmarks: random prompts and forced output lengths.

Every request is a prompt of random token ids (32–256 tokens) and an output length drawn from
{16, 32, 64, 128, 256, 512} with a heavy tail: most requests are short, but the few long ones
produce most of the tokens (as in chat traces, where a handful of long answers dominate). Every
system under test must generate exactly ``max_tokens`` tokens per request (EOS ignored), so they
all do the same work. Pure Python and deterministic in ``seed``: ``slipstream bench`` and the
side-by-side runs in the repository's ``benchmarks/`` all draw from it.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

OUTPUT_LENGTHS = (16, 32, 64, 128, 256, 512)
# P(length): a long tail, so 512-token requests are ~6% of requests but ~1/3 of the output tokens.
OUTPUT_WEIGHTS = (0.30, 0.25, 0.18, 0.12, 0.09, 0.06)
PROMPT_RANGE = (32, 256)
# Ids below this are the SmolLM2 tokenizer's special tokens (<|endoftext|>, <|im_start|>, …).
FIRST_ORDINARY_ID = 17


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    """One request: ``prompt`` token ids and the exact number of tokens to generate."""

    prompt: list[int]
    max_tokens: int


def make_workload(num_requests: int = 32, seed: int = 0, vocab_size: int = 49152,
                  max_output: int = 512, prompt_range: tuple[int, int] = PROMPT_RANGE) -> list[WorkloadRequest]:
    """Seeded requests for a throughput run.

    Args:
        num_requests: how many requests.
        seed: the same seed gives the same prompts and lengths on every machine.
        vocab_size: prompt ids are drawn uniformly from ``[FIRST_ORDINARY_ID, vocab_size)``.
        max_output: cap on output lengths (a quick run: ``max_output=64`` keeps the shape of the
            draw but clips the tail to 64 tokens).
        prompt_range: inclusive bounds of the prompt length, tokens.

    Returns:
        ``num_requests`` requests in arrival order.

    Raises:
        ValueError: ``num_requests`` < 1, ``max_output`` < 1 or ``vocab_size`` <= ``FIRST_ORDINARY_ID``.
    """
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if max_output < 1:
        raise ValueError(f"max_output must be >= 1, got {max_output}")
    if vocab_size <= FIRST_ORDINARY_ID:
        raise ValueError(f"vocab_size must be > {FIRST_ORDINARY_ID}, got {vocab_size}")
    rng = random.Random(seed)
    out = []
    for _ in range(num_requests):
        n_prompt = rng.randint(*prompt_range)
        prompt = [rng.randrange(FIRST_ORDINARY_ID, vocab_size) for _ in range(n_prompt)]
        n_out = rng.choices(OUTPUT_LENGTHS, OUTPUT_WEIGHTS)[0]
        out.append(WorkloadRequest(prompt, min(n_out, max_output)))
    return out


def parse_range(text: str) -> tuple[int, int]:
    """``"32-256"`` → ``(32, 256)``; ``"128"`` → ``(128, 128)``.

    Raises:
        ValueError: not one or two positive integers, or the low bound above the high one.
    """
    low, _, high = text.partition("-")
    try:
        bounds = (int(low), int(high or low))
    except ValueError:
        raise ValueError(f"not a length or a range of lengths: {text!r} (e.g. 128 or 32-256)") from None
    if bounds[0] < 1 or bounds[0] > bounds[1]:
        raise ValueError(f"lengths must be >= 1 and low <= high, got {text!r}")
    return bounds


def describe(workload: list[WorkloadRequest]) -> str:
    """One line: request count, prompt and output token totals, the output-length histogram."""
    hist: dict[int, int] = {}
    for r in workload:
        hist[r.max_tokens] = hist.get(r.max_tokens, 0) + 1
    lengths = ", ".join(f"{n}×{k}" for k, n in sorted(hist.items()))
    return (f"{len(workload)} requests, {sum(len(r.prompt) for r in workload)} prompt tokens, "
            f"{sum(r.max_tokens for r in workload)} output tokens (outputs: {lengths})")
