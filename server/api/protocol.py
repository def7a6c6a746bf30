"""OpenAI request bodies -> validated requests: every field type- and range-checked, nothing ignored.

A field that the server knows but cannot honour (``tools``, a ``response_format`` other than
text, a non-empty ``logit_bias``, ...) is a 400 naming it; so is a field it does not know, as
OpenAI does ("Unrecognized request argument supplied", ``code: unknown_parameter``). Fields that
change nothing here (``user``, ``prompt_cache_key``, ``service_tier``, ...), no-op values that
clients send by default, and explicit ``null`` for any optional field are accepted.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from slipstream.server.api.errors import APIError, bad_request
from slipstream.server.engine.sampling_params import SamplingParams

MAX_N = 128
MAX_LOGPROBS = 20

# Accepted, type-checked, and otherwise ignored: they do not change the output here.
_NO_OP_FIELDS = {"user": "string", "prompt_cache_key": "string", "safety_identifier": "string",
                 "service_tier": "string", "store": "boolean", "metadata": "object",
                 "parallel_tool_calls": "boolean"}
_SAMPLING_FIELDS = {
    "model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stop", "stop_token_ids", "seed",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos", "min_tokens", "stream",
    "stream_options", "logit_bias", "best_of", "skip_special_tokens", "logprobs", "include_stop_str_in_output",
}
CHAT_FIELDS = _SAMPLING_FIELDS | set(_NO_OP_FIELDS) | {
    "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "functions", "function_call",
    "response_format", "modalities", "audio", "prediction", "reasoning_effort", "web_search_options",
}
COMPLETION_FIELDS = _SAMPLING_FIELDS | set(_NO_OP_FIELDS) | {"prompt", "echo", "suffix"}
_CHAT_ROLES = {"system", "developer", "user", "assistant"}


@dataclass
class GenerationRequest:
    """What one API call asks of the engine.

    prompts: chat: one normalized message list (templated later, with the tokenizer);
        completions: one entry per prompt, a string or a list of token ids.
    """

    model: str | None
    params: SamplingParams
    stream: bool
    include_usage: bool  # a last, usage-only chunk
    continuous_usage: bool = False  # usage so far on every chunk that carries choices
    prompts: list[str | list[int]] | None = None
    messages: list[dict[str, str]] | None = None
    logprobs: int | None = None


# --- field readers: None (absent or explicit null) returns the default --------------------------

def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return "null"


def _typed(body: dict, name: str, expected: str, default: Any = None, *, where: str | None = None) -> Any:
    """``body[name]`` checked to be of JSON type ``expected``; ``where`` is its path in the request."""
    value = body.get(name)
    if value is None:
        return default
    where = where or name
    kind = _kind(value)
    if expected == "number" and kind == "integer":
        return float(value)
    if kind != expected:
        raise bad_request(f"{where} must be {'an' if expected[0] in 'aeiou' else 'a'} {expected}, "
                          f"got {kind} {value!r:.60}", where)
    if expected == "number" and not math.isfinite(value):
        raise bad_request(f"{where} must be a finite number, got {value}", where)
    return value


def _in_range(body: dict, name: str, expected: str, default: Any, low: float | None = None,
              high: float | None = None) -> Any:
    value = _typed(body, name, expected, default)
    if body.get(name) is None:
        return value
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"in [{low}, {high}]" if low is not None and high is not None else (
            f">= {low}" if low is not None else f"<= {high}")
        raise bad_request(f"{name} must be {bounds}, got {value}", name)
    return value


def _string_list(body: dict, name: str) -> list[str]:
    value = body.get(name)
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise bad_request(f"{name} must be a string or an array of strings", name)
    if any(s == "" for s in value):
        raise bad_request(f"{name} must not contain empty strings", name)
    return value


def _int_list(body: dict, name: str) -> list[int]:
    value = _typed(body, name, "array", [])
    if not all(_kind(v) == "integer" for v in value):
        raise bad_request(f"{name} must be an array of integers", name)
    return value


def _reject_unsupported(body: dict, allowed: set[str]) -> None:
    for name in body:
        if name not in allowed:
            raise bad_request(f"Unrecognized request argument supplied: {name}", name, "unknown_parameter")
    if body.get("logit_bias"):
        raise bad_request("logit_bias is not supported; send {} or omit it", "logit_bias")
    _typed(body, "logit_bias", "object")
    for name in ("tools", "functions"):
        if _typed(body, name, "array"):
            raise bad_request(f"{name} (tool calling) is not supported by this server; omit it", name)
    for name in ("tool_choice", "function_call"):
        value = body.get(name)
        if value is not None and value not in ("none", "auto"):
            raise bad_request(f"{name}={value!r:.60} is not supported (no tool calling); omit it", name)
    response_format = body.get("response_format")
    if response_format is not None and (not isinstance(response_format, dict)
                                        or response_format.get("type") != "text" or len(response_format) > 1):
        raise bad_request("response_format other than {\"type\": \"text\"} is not supported", "response_format")
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise bad_request("modalities other than [\"text\"] are not supported", "modalities")
    for name in ("audio", "prediction", "reasoning_effort", "web_search_options", "suffix"):
        if body.get(name) not in (None, ""):
            raise bad_request(f"{name} is not supported by this server; omit it", name)
    if body.get("echo") is not None and _typed(body, "echo", "boolean"):
        raise bad_request("echo=true is not supported; omit it or send false", "echo")
    for name, kind in _NO_OP_FIELDS.items():
        _typed(body, name, kind)


def _stream_options(body: dict, stream: bool) -> tuple[bool, bool]:
    """``(include_usage, continuous_usage_stats)``; each option works without the other."""
    options = _typed(body, "stream_options", "object")
    if options is None:
        return False, False
    if not stream:  # as OpenAI and vLLM: options for a stream that will not be sent
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    for key in options:
        if key not in ("include_usage", "continuous_usage_stats"):
            raise bad_request(f"Unrecognized request argument supplied: stream_options.{key}",
                              f"stream_options.{key}", "unknown_parameter")
    include_usage = _typed(options, "include_usage", "boolean", False, where="stream_options.include_usage")
    continuous = _typed(options, "continuous_usage_stats", "boolean", False,
                        where="stream_options.continuous_usage_stats")
    return bool(include_usage), bool(continuous)


def _sampling_params(body: dict, *, max_tokens: int | None, default_max_tokens: int | None,
                     logprobs: int | None) -> SamplingParams:
    n = _in_range(body, "n", "integer", 1, 1, MAX_N)
    best_of = _typed(body, "best_of", "integer")
    if best_of is not None and best_of != n:
        raise bad_request(f"best_of ({best_of}) different from n ({n}) is not supported; omit best_of",
                          "best_of")
    temperature = _in_range(body, "temperature", "number", 1.0, 0.0)
    top_p = _in_range(body, "top_p", "number", 1.0, 0.0, 1.0)
    if top_p == 0.0:  # the limit of nucleus sampling as p -> 0 keeps only the most likely token
        temperature, top_p = 0.0, 1.0
    top_k = _typed(body, "top_k", "integer", 0)
    if top_k < -1:
        raise bad_request(f"top_k must be -1, 0 (off) or >= 1, got {top_k}", "top_k")
    kwargs = dict(
        n=n, temperature=temperature, top_p=top_p, top_k=top_k,
        min_p=_in_range(body, "min_p", "number", 0.0, 0.0, 1.0),
        seed=_typed(body, "seed", "integer"),
        presence_penalty=_in_range(body, "presence_penalty", "number", 0.0, -2.0, 2.0),
        frequency_penalty=_in_range(body, "frequency_penalty", "number", 0.0, -2.0, 2.0),
        repetition_penalty=_typed(body, "repetition_penalty", "number", 1.0),
        max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
        min_tokens=_in_range(body, "min_tokens", "integer", 0, 0),
        stop=_string_list(body, "stop"),
        stop_token_ids=_int_list(body, "stop_token_ids"),
        ignore_eos=_typed(body, "ignore_eos", "boolean", False),
        logprobs=logprobs,
        skip_special_tokens=_typed(body, "skip_special_tokens", "boolean", True),
        include_stop_str_in_output=_typed(body, "include_stop_str_in_output", "boolean", False),
    )
    if kwargs["repetition_penalty"] <= 0:
        raise bad_request(f"repetition_penalty must be > 0, got {kwargs['repetition_penalty']}",
                          "repetition_penalty")
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:  # the engine's own checks; its message starts with the field's name
        message = str(exc)
        field = message.split(" ", 1)[0].split("(")[0]
        raise bad_request(message, field if field in kwargs else None) from None


def _max_tokens(body: dict, *names: str) -> int | None:
    values = {name: _in_range(body, name, "integer", None, 1) for name in names}
    given = {name: value for name, value in values.items() if value is not None}
    if len(set(given.values())) > 1:
        raise bad_request(f"{' and '.join(given)} disagree ({', '.join(map(str, given.values()))}); send one",
                          names[0])
    return next(iter(given.values()), None)


def _common(body: Any, allowed: set[str]) -> dict[str, Any]:
    """The fields every endpoint shares, as keyword arguments of :class:`GenerationRequest`."""
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object")
    _reject_unsupported(body, allowed)
    model = _typed(body, "model", "string")
    stream = _typed(body, "stream", "boolean", False)
    include_usage, continuous_usage = _stream_options(body, stream)
    return dict(model=model, stream=stream, include_usage=include_usage, continuous_usage=continuous_usage)


def parse_chat_request(body: Any) -> GenerationRequest:
    """Validate a ``POST /v1/chat/completions`` body. Raises :class:`APIError` (400) naming the field."""
    common = _common(body, CHAT_FIELDS)
    messages = _messages(body)
    logprobs_on = _typed(body, "logprobs", "boolean", False)
    top_logprobs = _in_range(body, "top_logprobs", "integer", None, 0, MAX_LOGPROBS)
    if top_logprobs is not None and not logprobs_on:
        raise bad_request("top_logprobs requires logprobs=true", "top_logprobs")
    logprobs = (top_logprobs or 0) if logprobs_on else None
    max_tokens = _max_tokens(body, "max_completion_tokens", "max_tokens")
    params = _sampling_params(body, max_tokens=max_tokens, default_max_tokens=None, logprobs=logprobs)
    return GenerationRequest(params=params, messages=messages, logprobs=logprobs, **common)


def parse_completion_request(body: Any, vocab_size: int | None = None) -> GenerationRequest:
    """Validate a ``POST /v1/completions`` body. Raises :class:`APIError` (400) naming the field."""
    common = _common(body, COMPLETION_FIELDS)
    prompts = _prompts(body, vocab_size)
    logprobs = _in_range(body, "logprobs", "integer", None, 0, MAX_LOGPROBS)
    max_tokens = _max_tokens(body, "max_tokens")
    params = _sampling_params(body, max_tokens=max_tokens, default_max_tokens=16, logprobs=logprobs)
    return GenerationRequest(params=params, prompts=prompts, logprobs=logprobs, **common)


def _messages(body: dict) -> list[dict[str, str]]:
    messages = body.get("messages")
    if messages is None:
        raise bad_request("messages is required: a non-empty array of {role, content}", "messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty array of {role, content}", "messages")
    normalized = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_request(f"{where} must be an object with role and content", where)
        role = message.get("role")
        if role not in _CHAT_ROLES:
            raise bad_request(f"{where}.role must be one of {sorted(_CHAT_ROLES)}, got {role!r:.40}",
                              f"{where}.role")
        for key in message:
            if key not in ("role", "content", "name", "refusal"):
                if key == "tool_calls" and not message[key]:
                    continue
                raise bad_request(f"{where}.{key} is not supported", f"{where}.{key}")
        content = message.get("content")
        if content is None and role != "assistant":
            raise bad_request(f"{where}.content is required", f"{where}.content")
        normalized.append({"role": "system" if role == "developer" else role,
                           "content": _content_text(content, f"{where}.content")})
        name = message.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise bad_request(f"{where}.name must be a string", f"{where}.name")
            normalized[-1]["name"] = name
    return normalized


def _content_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or an array of text parts", where)
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else _kind(part)
            raise bad_request(f"{where}[{j}] of type {kind!r:.40} is not supported; only text parts are",
                              f"{where}[{j}].type")
        texts.append(part["text"])
    return "\n".join(texts)


def _prompts(body: dict, vocab_size: int | None) -> list[str | list[int]]:
    prompt = body.get("prompt")
    if prompt is None:
        raise bad_request("prompt is required: a string, an array of strings, or token ids", "prompt")
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif isinstance(prompt, list) and prompt and all(_kind(p) == "integer" for p in prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) and p and all(
            _kind(t) == "integer" for t in p) for p in prompt):
        prompts = list(prompt)
    else:
        raise bad_request("prompt must be a non-empty string, array of strings, array of token ids, "
                          "or array of arrays of token ids", "prompt")
    for p in prompts:
        if p == "":
            raise bad_request("prompt must not be empty", "prompt")
        if isinstance(p, list) and vocab_size is not None and any(not 0 <= t < vocab_size for t in p):
            raise bad_request(f"prompt token ids must be in [0, {vocab_size})", "prompt")
    return prompts


def check_model(requested: str | None, served: str) -> None:
    """404 ``model_not_found`` unless ``requested`` is absent or names the served model."""
    if requested is not None and requested != served:
        raise APIError(404, f"The model `{requested}` does not exist. This server serves `{served}` "
                       "(see GET /v1/models).", param="model", code="model_not_found")
