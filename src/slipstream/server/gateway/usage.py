"""The token counts of a relayed response, for the gateway's demand counters (pure).

An OpenAI-style response carries ``"usage": {"prompt_tokens": N, "completion_tokens": M, ...}``
at its end (with nested details such as ``prompt_tokens_details``): in the JSON body, in the
last SSE event of a stream that asked for it (``stream_options.include_usage``), or, from a
slipstream pod, in the SSE comment that ends a stream that did not (``: {"usage": ...}``). The proxy keeps
the last :data:`TAIL_BYTES` of the body and reads the last usage object there; a response
without one adds no tokens (the autoscaler still counts the request). A slipstream pod also sends a
non-streamed response's usage in the ``x-slipstream-usage`` header
(:data:`~slipstream.api_types.tenancy.USAGE_HEADER`), read first: the body's end may be fields the
client echoes (the Responses API's ``metadata``), long enough to push the usage out of the tail.
"""
from __future__ import annotations

import json

TAIL_BYTES = 4096
_KEY = b'"usage"'
_DECODER = json.JSONDecoder()


def usage_header(value: str | None) -> tuple[int, int] | None:
    """(prompt tokens, generated tokens) of a usage header's JSON object; None when absent or
    not a usage object."""
    return usage_tokens(b'"usage":' + value.encode("utf-8", "replace")) if value else None


def usage_tokens(tail: bytes) -> tuple[int, int] | None:
    """(prompt tokens, generated tokens) of the last ``usage`` object in ``tail`` (the end of a
    response body); None when there is none that parses. The Responses API's ``input_tokens`` /
    ``output_tokens`` are read as well."""
    end = len(tail)
    while (at := tail.rfind(_KEY, 0, end)) >= 0:
        end = at
        rest = tail[at + len(_KEY):].lstrip()
        if not rest.startswith(b":"):
            continue
        try:
            usage, _ = _DECODER.raw_decode(rest[1:].lstrip().decode("utf-8", "replace"))
        except ValueError:
            continue
        if not isinstance(usage, dict):
            continue
        prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
        generated = usage.get("completion_tokens", usage.get("output_tokens"))
        if isinstance(prompt, int) or isinstance(generated, int):
            return (prompt if isinstance(prompt, int) else 0), (generated if isinstance(generated, int) else 0)
    return None
