"""Checks of ``tools`` and ``tool_choice`` beyond their shapes (which the request model checks),
returned as data: a :class:`ToolCallError` carries ``param`` and ``code`` to the HTTP response.

Follows OpenAI's chat-completions rules: ``tool_choice`` is ``"none"``, ``"auto"``,
``"required"`` or ``{"type": "function", "function": {"name": ...}}`` naming a declared tool;
function names are unique.
"""
from __future__ import annotations

import llguidance

from slipstream.server.engine.errors import InvalidRequest


class ToolCallError(InvalidRequest):
    """A problem with ``tools``, ``tool_choice`` or the tool turns of ``messages``: ``param`` names
    the field (``tool_choice``, ``tools[2].function.name``, ``messages[3].tool_call_id``),
    ``code`` is None (as for other bad values) or, for a schema the grammar cannot enforce, OpenAI's
    ``invalid_function_parameters``."""

    def __init__(self, message: str, param: str, code: str | None = None):
        super().__init__(message, param, code)


def tool_names(tools: list[dict] | None) -> list[str]:
    """The function names of ``tools`` (OpenAI shape ``{"type": "function", "function": {...}}``)."""
    return [t["function"]["name"] for t in tools or ()]


def chosen_function(tool_choice) -> str | None:
    """The function a ``tool_choice`` names, or None for ``"none"``/``"auto"``/``"required"``/None.
    Accepts the chat shape ``{"type": "function", "function": {"name": n}}`` and the Responses
    API's ``{"type": "function", "name": n}``."""
    if isinstance(tool_choice, dict):
        return (tool_choice.get("function") or {}).get("name") or tool_choice.get("name")
    return None


def check_tools(tools: list[dict] | None, tool_choice) -> ToolCallError | None:
    """The first problem of a request's ``tools`` and ``tool_choice``, or None.

    Problems: two tools with one name (param ``tools[i].function.name``); ``tool_choice``
    ``"required"`` or a named function without ``tools``, or naming a function not in ``tools``
    (param ``tool_choice``); when ``tool_choice`` makes the grammar enforce a tool's
    ``parameters``, a schema llguidance cannot compile (param ``tools[i].function.parameters``,
    code ``invalid_function_parameters``; e.g. an unknown type, a dangling ``$ref``, a regex
    look-around). With ``auto`` schemas are only shown to the model and not checked.
    """
    names = tool_names(tools)
    seen: set[str] = set()
    for i, name in enumerate(names):
        if name in seen:
            return ToolCallError(f"tools[{i}]: function name {name!r} is declared twice; tool names "
                                 "must be unique", f"tools[{i}].function.name")
        seen.add(name)
    for i, tool in enumerate(tools or ()):
        kind = (tool["function"].get("parameters") or {}).get("type", "object")
        if kind != "object":  # calls carry their arguments as a JSON object (OpenAI's rule, every format's)
            return ToolCallError(f"tools[{i}].function.parameters must be a JSON schema of type object, got "
                                 f"type {kind!r:.40}", f"tools[{i}].function.parameters", "invalid_function_parameters")
    named = chosen_function(tool_choice)
    if (tool_choice == "required" or named is not None) and not names:
        return ToolCallError(f"tool_choice {tool_choice!r} needs tools; declare them in tools or "
                             "use tool_choice 'none' or 'auto'", "tool_choice")
    if named is not None and named not in seen:
        return ToolCallError(f"tool_choice names function {named!r}, which is not in tools "
                             f"({', '.join(names)}); name one of those", "tool_choice")
    if tool_choice == "required" or named is not None:
        for i, tool in enumerate(tools):
            if named is None or tool["function"]["name"] == named:
                problem = _schema_problem(parameters_schema(tool["function"]))
                if problem:
                    return ToolCallError(
                        f"tools[{i}].function.parameters of {tool['function']['name']!r} cannot be "
                        f"enforced: {problem}; fix the JSON schema", f"tools[{i}].function.parameters",
                        "invalid_function_parameters")
    return None


def parameters_schema(function: dict) -> dict:
    """The JSON schema that a call's arguments must match: the function's ``parameters``; none
    means any object (OpenAI's rule), and the type is always object (the parsers' rule)."""
    params = dict(function.get("parameters") or {})
    params.setdefault("type", "object")
    return params


def _schema_problem(schema: dict) -> str | None:
    """llguidance's error for a JSON schema, or None."""
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    except Exception as e:  # a schema that is not even JSON-serialisable
        return str(e)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    return messages[0] if is_error else None
