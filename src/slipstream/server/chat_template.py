"""Rendering a conversation with the model's chat template: one function the server and the gateway
share, so the gateway hashes exactly the tokens a pod will see (pure: no engine, no HTTP).

The template is the tokenizer's own (Hugging Face ``apply_chat_template``), with vLLM's
``chat_template_kwargs``, ``add_generation_prompt`` and ``continue_final_message``.
"""
from __future__ import annotations

from typing import Any


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered; ``param`` names the request field (``messages``)."""

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        self.param = param


def render_template(tokenizer: Any, messages: list[dict], *, tools: list[dict] | None = None,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    chat_template_kwargs: dict | None = None) -> str:
    """The conversation as text, by the model's own chat template.

    messages: chat-template dicts (see :func:`template_messages`); tools: what the template
    should render, or None. Raises ChatTemplateError when the template refuses the conversation
    (a jinja2 error raised by the template itself, e.g. on role order) or the text is not valid
    Unicode.
    """
    try:
        text = tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, **(chat_template_kwargs or {}))
    except Exception as exc:
        raise ChatTemplateError(f"messages could not be rendered with the model's chat template: {exc}") from None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ChatTemplateError(f"messages are not valid Unicode text: {exc.reason}") from None
    return text


def template_messages(messages: list[dict]) -> list[dict[str, Any]]:
    """OpenAI chat messages (plain dicts, as sent) as a chat template takes them: ``developer``
    read as ``system``, text parts joined as they are (an array of parts is exactly the text of
    the same content sent as one string), ``name``, ``tool_calls`` and
    ``tool_call_id`` kept — what the server's request model yields for the same body
    (``protocol.template_messages``). Raises KeyError/TypeError for a message that is not an
    object with a ``role`` or has a non-text part (the server rejects those with a 400)."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(part["text"] for part in content)
        entry: dict[str, Any] = {"role": "system" if m["role"] == "developer" else m["role"],
                                 "content": content if content is not None else ""}
        if m.get("name") is not None:
            entry["name"] = m["name"]
        if m.get("tool_calls"):
            entry["tool_calls"] = m["tool_calls"]
        if m.get("tool_call_id") is not None:
            entry["tool_call_id"] = m["tool_call_id"]
        out.append(entry)
    return out
