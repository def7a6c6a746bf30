"""OpenAI response bodies and stream chunks, built from engine outputs (pure functions).

Shapes follow OpenAI's API reference: ``chat.completion`` / ``chat.completion.chunk`` and
``text_completion`` objects, ``usage`` with ``prompt_tokens_details.cached_tokens``.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from slipstream.server.engine.outputs import Logprob

TokenText = Callable[[int], str]


@dataclass
class Choice:
    """One choice accumulated over a request's increments."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    logprobs: list[Logprob] = field(default_factory=list)
    prompt_index: int = 0  # completions: which prompt of the call it continues
    state: Any = None  # the endpoint's per-choice streaming state (logprob offsets, a tool-call parser)


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def body(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


def chat_logprobs(logprobs: list[Logprob], text_of: TokenText) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        text = text_of(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [dict(entry(lp.token_id, lp.logprob),
                             top_logprobs=[entry(t, v) for t, v in lp.top]) for lp in logprobs],
            "refusal": None}


def completion_logprobs(logprobs: list[Logprob], text_of: TokenText, text_offset: int) -> tuple[dict, int]:
    """Returns the legacy ``logprobs`` object and the offset after its last token."""
    tokens, offsets = [], []
    for lp in logprobs:
        tokens.append(text_of(lp.token_id))
        offsets.append(text_offset)
        text_offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{text_of(t): v for t, v in lp.top} for lp in logprobs],
            "text_offset": offsets}, text_offset


def chunk(request_id: str, created: int, model: str, obj: str, choices: list[dict],
          with_usage: bool, usage: Usage | None = None) -> dict:
    """One stream chunk; with ``with_usage`` every chunk has the ``usage`` key (null where ``usage`` is None)."""
    body = {"id": request_id, "object": obj, "created": created, "model": model, "choices": choices}
    if with_usage:
        body["usage"] = usage.body() if usage is not None else None
    return body


def chat_delta(index: int, delta: dict, logprobs: dict | None = None, finish_reason: str | None = None) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_delta(index: int, text: str, logprobs: dict | None = None,
                     finish_reason: str | None = None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
