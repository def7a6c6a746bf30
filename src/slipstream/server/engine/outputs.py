"""What the engine hands back: per request, per choice, cumulative (offline) or as increments (async)."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class FinishReason(str, Enum):
    STOP = "stop"      # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"    # aborted by the caller (client gone) or failed inside a step


@dataclass
class Logprob:
    """Log-probability (natural log, from the model's raw logits) of one token, and the top-N."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class CompletionOutput:
    """One choice. Offline: cumulative. From ``AsyncLLM.generate``: the increment since the last one."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    logprobs: list[Logprob] | None = None


@dataclass
class RequestMetrics:
    """Wall-clock times (``time.monotonic()``, seconds) of a request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    """One request's output (all its choices); ``outputs[i]`` is choice ``i``'s (or its increment)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    error: str | None = None  # set when a step failed for this request (finish_reason "abort")
    # With ``SamplingParams.prompt_logprobs``: one entry per prompt token, the first None (nothing
    # predicts it), as vLLM. Only in the request's first output (the one with its first token).
    prompt_logprobs: list[Logprob | None] | None = None
