"""``tool_choice`` enforced by the engine's grammar: an llguidance Lark grammar of the parser's
exact format, with each call's ``name`` one of the allowed tools and its arguments valid against
that tool's ``parameters`` schema (``%json`` embeds a JSON schema; llguidance docs/syntax.md).

vLLM enforces ``required`` with a JSON array schema of its own, whatever the parser; writing the
parser's own format instead keeps one path: the prompt teaches it, the grammar forces it, the
parser reads it.

Markers are text literals: where the served model has them as one special token (Mistral's
``[TOOL_CALLS]``), the grammar makes it spell the marker in ordinary tokens, which the parser reads
the same; ``llama3_json`` calls need no marker.
"""
from __future__ import annotations

import json

from slipstream.server.engine.structured_outputs import closed_objects

from .parsers import ToolParser
from .validate import chosen_function, parameters_schema

# Fixed separators: a small model under a flexible-whitespace grammar can spin on spaces forever.
_JSON_STYLE = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


def grammar_for(parser: ToolParser, tools: list[dict] | None, tool_choice,
                parallel_tool_calls: bool = True) -> str | None:
    """The Lark grammar (llguidance dialect) that ``tool_choice`` imposes on the output, or None.

    Args:
        parser: the ``--tool-call-parser``; the grammar produces exactly its format.
        tools: OpenAI function tools; already checked by :func:`.validate.check_tools`.
        tool_choice: ``"none"``/``"auto"``/None → None (free text); ``"required"`` → one or more
            calls (exactly one when ``parallel_tool_calls`` is false) of any declared tool;
            ``{"type": "function", "function": {"name": n}}`` → exactly one call of ``n``.

    Returns:
        Lark text for ``StructuredOutputsParams(grammar=...)``; the output is the calls and
        nothing else (no content around them).

    Raises:
        KeyError: ``tool_choice`` names a function not in ``tools`` (check_tools reports it first).
    """
    named = chosen_function(tool_choice)
    if named is None and tool_choice != "required":
        return None
    by_name = {t["function"]["name"]: t["function"] for t in tools or ()}
    functions = [by_name[named]] if named is not None else list(by_name.values())
    fmt = parser.format
    before, each_before, each_after, between, after = fmt.frame()
    call = f"{_lit(each_before)} call_body {_lit(each_after)}".strip()
    many = named is None and parallel_tool_calls
    start = f"{_lit(before)} call ({_lit(between)} call)* {_lit(after)}" if many else \
        f"{_lit(before)} call {_lit(after)}"
    lines = [f"start: {start.strip()}", f"call: {call}",
             "call_body: " + " | ".join(f"call_{i}" for i in range(len(functions)))]
    for i, f in enumerate(functions):
        lines.append(f"call_{i}: %json {json.dumps(_call_schema(fmt.args_key, f))}")
    return "\n".join(lines) + "\n"


def _call_schema(args_key: str, function: dict) -> dict:
    """JSON schema of one call object: ``{"name": <const>, <args_key>: <parameters>}``, in order."""
    params = closed_objects(parameters_schema(function))
    return {"type": "object", "properties": {"name": {"const": function["name"]}, args_key: params},
            "required": ["name", args_key], "additionalProperties": False, "x-guidance": _JSON_STYLE}


def _lit(text: str) -> str:
    """A Lark string literal, or nothing for empty text."""
    return json.dumps(text) if text else ""
