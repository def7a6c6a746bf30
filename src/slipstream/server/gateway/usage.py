"""The token counts of a relayed response, for the gateway's demand counters (pure).

An OpenAI-style response carries ``"usage": {"prompt_tokens": N, "completion_tokens": M, ...}``
at its end: in the JSON body, or in the last SSE event of a stream that asked for it
(``stream_options.include_usage``). The proxy keeps the last :data:`TAIL_BYTES` of the body
and reads the last usage object there; a response without one adds no tokens (the autoscaler
still counts the request).
"""
from __future__ import annotations

import re

TAIL_BYTES = 4096
_USAGE = re.compile(rb'"usage"\s*:\s*\{([^{}]*)\}')
_FIELD = re.compile(rb'"(prompt_tokens|completion_tokens|input_tokens|output_tokens)"\s*:\s*(\d+)')


def usage_tokens(tail: bytes) -> tuple[int, int] | None:
    """(prompt tokens, generated tokens) of the last ``usage`` object in ``tail`` (the end of a
    response body); None when there is none. The Responses API's ``input_tokens`` /
    ``output_tokens`` are read as well."""
    found = list(_USAGE.finditer(tail))
    if not found:
        return None
    fields = {name.decode(): int(value) for name, value in _FIELD.findall(found[-1].group(1))}
    prompt = fields.get("prompt_tokens", fields.get("input_tokens"))
    generated = fields.get("completion_tokens", fields.get("output_tokens"))
    if prompt is None and generated is None:
        return None
    return prompt or 0, generated or 0
