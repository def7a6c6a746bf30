"""Tools and tool turns into the prompt.

A chat template that knows tools (it references ``tools``: Qwen2.5, Hermes 2 Pro, Llama 3.1,
Mistral's) gets them as transformers' chat-template docs describe ("Tool use / function calling"):
``tools`` as JSON schemas, assistant ``tool_calls`` with ``arguments`` as a dict, tool turns with
``tool_call_id`` and the function's ``name``. A template without (the built-in SmolLM2 ChatML one
ignores ``tools`` and fails on ``content: null``) gets plain text in the parser's format: the tools
and the reply format in the system prompt, calls as the assistant's text, results in user turns —
``<tool_response>`` (Qwen2.5's template), ``{"name": …, "output": …}`` (vLLM's Llama 3.1 JSON
template writes ``{"output": …}``) or ``[TOOL_RESULTS]`` (mistral-common).
"""
from __future__ import annotations

import json
import re

from .formats import ToolFormat
from .parsers import ToolParser
from .validate import ToolCallError

_MENTIONS_TOOLS = re.compile(r"\btools\b")


def template_supports_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders ``tools`` (its Jinja source names them).

    A template given as a dict of named templates counts if any of them does (transformers picks
    ``tool_use`` when tools are passed)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return any(_MENTIONS_TOOLS.search(t or "") for t in template.values())
    return bool(template) and bool(_MENTIONS_TOOLS.search(template))


def prepare_messages(messages: list[dict], tools: list[dict] | None, parser: ToolParser,
                     supports_tools: bool) -> tuple[list[dict], list[dict] | None]:
    """OpenAI chat messages and tools, made renderable by the model's chat template.

    Args:
        messages: OpenAI-shaped dicts; ``content`` a string, a list of text parts, or None;
            assistant turns may carry ``tool_calls`` (``arguments`` as JSON text), tool turns
            ``tool_call_id``.
        tools: OpenAI function tools ``[{"type": "function", "function": {"name", "description",
            "parameters"}}]`` to show the model, or None (e.g. for ``tool_choice`` ``none``).
        parser: the ``--tool-call-parser``; its format is what the prompt teaches.
        supports_tools: :func:`template_supports_tools` of the tokenizer.

    Returns:
        ``(messages, tools)`` for ``apply_chat_template(messages, tools=tools)``: new dicts (the
        input is not modified); ``tools`` is None when the template does not render them (they
        are then in the system prompt). Every ``content`` is a string (text parts joined; the
        server is text-only).

    Raises:
        ToolCallError: a tool turn whose ``tool_call_id`` answers no earlier assistant call
            (param ``messages[i].tool_call_id``), or call arguments that are not a JSON object
            (param ``messages[i].tool_calls[j].function.arguments``).
    """
    fmt = parser.format
    calls: dict[str, str] = {}  # tool_call_id -> function name, from the assistant turns so far
    out: list[dict] = []
    results: dict | None = None  # the user turn that collects consecutive tool results
    for i, m in enumerate(messages):
        role = m.get("role")
        if role == "tool":
            cid = m.get("tool_call_id")
            if cid not in calls:
                raise ToolCallError(f"messages[{i}]: tool_call_id {cid!r} answers no tool call of an "
                                    "earlier assistant message; use the id of the call it answers",
                                    f"messages[{i}].tool_call_id")
            if supports_tools:
                out.append({**m, "content": _text(m.get("content")), "name": calls[cid]})
                continue
            result = _render_result(fmt, calls[cid], cid, _text(m.get("content")))
            if results is None:  # parallel calls' results share one user turn
                results = {"role": "user", "content": result}
                out.append(results)
            else:
                results["content"] += "\n" + result
            continue
        results = None
        if role == "assistant" and m.get("tool_calls"):
            parsed = [(c.get("id"), c["function"]["name"], _arguments(c, i, j))
                      for j, c in enumerate(m["tool_calls"])]
            calls.update((cid, name) for cid, name, _ in parsed if cid)
            text = _text(m.get("content"))
            if supports_tools:
                out.append({**m, "content": text, "tool_calls": [
                    {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}
                    for cid, name, args in parsed]})
            else:
                rendered = render_calls(fmt, [(name, args) for _, name, args in parsed])
                out.append({"role": "assistant", "content": f"{text}\n{rendered}" if text else rendered})
        else:
            out.append({**m, "content": _text(m.get("content"))})
    if supports_tools:
        return out, tools or None
    if not tools:
        return out, None
    system = tools_system_prompt(fmt, tools)
    if out and out[0].get("role") == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{system}" if out[0]["content"] else system}
    else:
        out.insert(0, {"role": "system", "content": system})
    return out, None


def tools_system_prompt(fmt: ToolFormat, tools: list[dict]) -> str:
    """The system-prompt text that declares ``tools`` (their JSON, parameters as JSON schema), the
    exact reply format, how to make several calls and how results come back."""
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    if fmt.name == "hermes":
        listing = f"<tools>\n{listing}\n</tools>"
    elif fmt.name == "mistral":
        listing = f"[AVAILABLE_TOOLS]{json.dumps(tools, ensure_ascii=False)}[/AVAILABLE_TOOLS]"
    example = fmt.write([_call_body(fmt, "<function-name>", "<arguments-json-object>")])
    several, results = _CONVENTIONS[fmt.name]
    return ("# Tools\n\nYou may call one or more of these functions to answer. Their signatures, as "
            f"JSON schemas:\n{listing}\n\nTo call a function, reply with exactly:\n{example}\n"
            f"{several} The results come back in the next message, {results}.")


# format -> (how several calls are written, how results come back); see _render_result
_CONVENTIONS = {
    "hermes": ("Put each call in its own <tool_call></tool_call> block.",
               "each in a <tool_response></tool_response> block"),
    "llama3_json": ("Separate several calls with semicolons (;).",
                    'each as {"name": <function-name>, "output": <result>}'),
    "mistral": ("Several calls are several objects in the list, separated by commas.",
                'each as [TOOL_RESULTS]{"content": <result>, "call_id": <id>}[/TOOL_RESULTS]'),
}


def render_calls(fmt: ToolFormat, calls: list[tuple[str, dict]]) -> str:
    """``[(name, arguments)]`` as the model writes them in ``fmt`` — what the parser reads back."""
    return fmt.write([_call_body(fmt, json.dumps(name, ensure_ascii=False),
                                  json.dumps(args, ensure_ascii=False)) for name, args in calls])


def _call_body(fmt: ToolFormat, name_json: str, args_json: str) -> str:
    return f'{{"name": {name_json}, "{fmt.args_key}": {args_json}}}'


def _render_result(fmt: ToolFormat, name: str, call_id: str, content: str) -> str:
    """One tool result as the user-turn text of ``fmt``'s convention (see the module docstring)."""
    if fmt.name == "hermes":
        return f"<tool_response>\n{content}\n</tool_response>"
    if fmt.name == "mistral":
        body = json.dumps({"content": content, "call_id": call_id}, ensure_ascii=False)
        return f"[TOOL_RESULTS]{body}[/TOOL_RESULTS]"
    return json.dumps({"name": name, "output": content}, ensure_ascii=False)


def _arguments(call: dict, i: int, j: int) -> dict:
    """A call's ``arguments`` JSON text as the dict templates and renderers need."""
    try:
        args = json.loads(call["function"].get("arguments") or "{}")
    except json.JSONDecodeError:
        args = None
    if not isinstance(args, dict):
        raise ToolCallError(f"messages[{i}].tool_calls[{j}].function.arguments must be the JSON text "
                            "of an object, as the model returned it",
                            f"messages[{i}].tool_calls[{j}].function.arguments")
    return args


def _text(content) -> str:
    """Message content as text: None is empty; a list of parts is its text parts, joined."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if p.get("type") == "text")
    return content
