"""OpenAI response bodies and stream chunks, built from engine outputs (pure functions).

Shapes follow OpenAI's API reference: ``chat.completion`` / ``chat.completion.chunk`` and
``text_completion`` objects, ``usage`` with ``prompt_tokens_details.cached_tokens``.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from slipstream.server.engine.outputs import Logprob

def json_text(body: Any) -> str:
    """``body`` as strict JSON text (UTF-8 as is). Python's json writes ``NaN`` and ``Infinity``,
    which JSON has not (jq, JavaScript and Go refuse the whole body). The engine fails a request
    whose logits are not finite, so logprobs should never carry them; this is the last guard:
    ``-inf`` becomes -9999.0 (vLLM's floor for logprobs), ``inf`` 9999.0 and ``NaN`` null."""
    try:
        return json.dumps(body, ensure_ascii=False, allow_nan=False)
    except ValueError:
        return json.dumps(_finite(body), ensure_ascii=False, allow_nan=False)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else math.copysign(9999.0, value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


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
