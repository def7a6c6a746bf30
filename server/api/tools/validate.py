"""Checks of ``tools`` and ``tool_choice`` beyond their shapes (which the request model checks),
returned as data: a :class:`ToolCallError` carries ``param`` and ``code`` to the HTTP response.

Follows OpenAI's chat-completions rules: ``tool_choice`` is ``"none"``, ``"auto"``,
``"required"`` or ``{"type": "function", "function": {"name": ...}}`` naming a declared tool;
function names are unique.
"""
from __future__ import annotations

from slipstream.server.engine.errors import InvalidRequest


class ToolCallError(InvalidRequest):
    """A problem with ``tools``, ``tool_choice`` or the tool turns of ``messages``: ``param`` names
    the field (``tool_choice``, ``tools[2].function.name``, ``messages[3].tool_call_id``),
    ``code`` is ``invalid_value``."""

    def __init__(self, message: str, param: str):
        super().__init__(message, param, "invalid_value")


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
    (param ``tool_choice``).
    """
    names = tool_names(tools)
    seen: set[str] = set()
    for i, name in enumerate(names):
        if name in seen:
            return ToolCallError(f"tools[{i}]: function name {name!r} is declared twice; tool names "
                                 "must be unique", f"tools[{i}].function.name")
        seen.add(name)
    named = chosen_function(tool_choice)
    if (tool_choice == "required" or named is not None) and not names:
        return ToolCallError(f"tool_choice {tool_choice!r} needs tools; declare them in tools or "
                             "use tool_choice 'none' or 'auto'", "tool_choice")
    if named is not None and named not in seen:
        return ToolCallError(f"tool_choice names function {named!r}, which is not in tools "
                             f"({', '.join(names)}); name one of those", "tool_choice")
    return None
