"""``POST /v1/responses`` request bodies (OpenAI's Responses API) as pydantic models, and their
translation into the chat-completions request the rest of the API layer already serves.

A Responses request is a chat request in another shape: ``instructions`` is a system message,
``input`` items are turns (``function_call`` items are an assistant's ``tool_calls``,
``function_call_output`` items are ``tool`` turns), function tools are flat instead of nested
under ``function``, ``text.format`` is ``response_format``. :func:`chat_request` builds that
:class:`ChatCompletionRequest`, so prompts, tools, grammars and sampling are one code path, and
maps any refusal's ``param`` back to the Responses field it came from (``input[3].call_id``).

Fields are checked as in :mod:`.protocol`: unknown ones are 400 ``unknown_parameter``; known
ones that cannot be honoured here are 400 naming the field; no-op ones are accepted.
"""
from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, Field, PrivateAttr, ValidationError

from slipstream.server.api.errors import APIError, bad_request
from slipstream.server.api.protocol import (ChatCompletionRequest, _from_validation_error, _Strict,
                                            validate)

# OpenAI's documented limits on ``metadata``.
MAX_METADATA_KEYS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # a length hint for OpenAI's models; no-op


class ResponsesStreamOptions(_Strict):
    include_obfuscation: bool | None = None  # OpenAI pads events against side channels; nothing to pad here


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class _TextPart(_Strict):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # sent back with output_text parts
    logprobs: list[Any] | None = None


class _MessageItem(_Strict):
    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[dict[str, Any]]
    id: str | None = None
    status: str | None = None
    phase: str | None = None


class _FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class _FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[dict[str, Any]]
    id: str | None = None
    status: str | None = None


_ITEMS: dict[str, type[BaseModel]] = {"message": _MessageItem, "function_call": _FunctionCallItem,
                                      "function_call_output": _FunctionCallOutputItem}


class ResponsesRequest(_Strict):
    """``POST /v1/responses``. :attr:`items` holds ``input`` as plain dicts, one of
    ``{"type": "message", "role", "content": str}``, ``{"type": "function_call", "call_id", "name",
    "arguments"}`` or ``{"type": "function_call_output", "call_id", "output": str}``."""

    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: int | None = None  # its range, temperature's and top_p's are SamplingParams'
    temperature: float | None = None
    top_p: float | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None  # "none" | "auto" | "required" | {"type": "function", "name": ...}
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool | None = None
    stream_options: ResponsesStreamOptions | None = None
    store: bool | None = None  # default true: kept (bounded, in memory) for previous_response_id
    previous_response_id: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    metadata: dict[str, str] | None = None
    max_tool_calls: int | None = Field(None, ge=1)  # bounds built-in tool calls; there are none here
    # vLLM's, as in the other generation requests: the order within a tenant (lower sooner).
    priority: int = 0
    # Accepted, type-checked, and otherwise ignored: they do not change the output here.
    user: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    # Known to OpenAI, refused unless absent or a no-op value.
    reasoning: dict[str, Any] | None = None
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    top_logprobs: int | None = None

    _items: list[dict] = PrivateAttr()
    _tools: list[FunctionTool] = PrivateAttr()

    def model_post_init(self, _context: Any) -> None:
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        self._tools = [_tool(t, i) for i, t in enumerate(self.tools or [])]
        self._check_tool_choice()
        self._items = [{"type": "message", "role": "user", "content": self.input}] if isinstance(self.input, str) \
            else [_item(raw, i) for i, raw in enumerate(self.input)]
        fmt = self.text.format if self.text else None
        if fmt is not None and fmt.type == "json_schema" and fmt.schema_ is None:
            raise bad_request("text.format of type json_schema needs a schema", "text.format.schema",
                              "missing_required_parameter")
        if self.truncation == "auto":
            raise bad_request("truncation 'auto' is not supported: the input is never shortened here; send "
                              "'disabled' (a too-long input is a 400) or trim the input", "truncation")
        for name, refused in (("background", bool(self.background)), ("conversation", self.conversation is not None),
                              ("prompt", self.prompt is not None), ("top_logprobs", bool(self.top_logprobs)),
                              ("reasoning", any(v is not None for v in (self.reasoning or {}).values()))):
            if refused:
                raise bad_request(f"{name} is not supported by this server; omit it", name)
        for value in self.include or []:
            if value != "reasoning.encrypted_content":  # no reasoning items are produced: nothing to include
                raise bad_request(f"include value {value!r:.60} is not supported; omit it", "include")
        self._check_metadata()

    def _check_tool_choice(self) -> None:
        choice = self.tool_choice
        if choice is None or choice in ("none", "auto", "required"):
            return
        if not (isinstance(choice, dict) and set(choice) == {"type", "name"} and choice["type"] == "function"
                and isinstance(choice["name"], str)):
            raise bad_request('tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}',
                              "tool_choice")

    def _check_metadata(self) -> None:
        metadata = self.metadata or {}
        if len(metadata) > MAX_METADATA_KEYS:
            raise bad_request(f"metadata has {len(metadata)} keys; at most {MAX_METADATA_KEYS} are allowed", "metadata")
        for key, value in metadata.items():
            if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
                raise bad_request(f"metadata keys are at most {MAX_METADATA_KEY} characters and values at most "
                                  f"{MAX_METADATA_VALUE}; {key[:64]!r} is longer", "metadata")

    @property
    def items(self) -> list[dict]:
        """``input`` as normalized items (see the class docstring)."""
        return self._items

    @property
    def function_tools(self) -> list[FunctionTool]:
        return self._tools

    @property
    def text_format(self) -> dict:
        """``text.format`` as the response echoes it; ``{"type": "text"}`` by default."""
        fmt = self.text.format if self.text else None
        return fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}


def _validate_at(model: type[BaseModel], raw: Any, where: tuple) -> BaseModel:
    """``model.model_validate(raw)``, a failure reported under the request path ``where``."""
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        error = exc.errors()[0]
        raise _from_validation_error({**error, "loc": where + tuple(error["loc"])}) from None


def _tool(raw: Any, i: int) -> FunctionTool:
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind != "function":
        raise bad_request(f"tools[{i}] of type {kind!r:.40} is not supported; only function tools "
                          '({"type": "function", "name", "parameters"}) are', f"tools[{i}].type")
    return _validate_at(FunctionTool, raw, ("tools", i))


def _item(raw: Any, i: int) -> dict:
    """One ``input`` item, checked, as a normalized dict."""
    if not isinstance(raw, dict):
        raise bad_request(f"input[{i}] must be an object (a message or a function_call or function_call_output "
                          "item)", f"input[{i}]")
    kind = raw.get("type", "message" if "role" in raw else None)
    if kind not in _ITEMS:
        raise bad_request(f"input[{i}] of type {kind!r:.40} is not supported; send message, function_call and "
                          "function_call_output items", f"input[{i}].type")
    item = _validate_at(_ITEMS[kind], raw, ("input", i))
    if isinstance(item, _MessageItem):
        return {"type": "message", "role": item.role, "content": _text(item.content, i, "content")}
    if isinstance(item, _FunctionCallItem):
        return {"type": "function_call", "call_id": item.call_id, "name": item.name, "arguments": item.arguments}
    return {"type": "function_call_output", "call_id": item.call_id, "output": _text(item.output, i, "output")}


def _text(content: str | list[dict], i: int, field: str) -> str:
    """``input[i].<field>`` as text: a string, or its text parts joined (the server is text-only)."""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type")
        if kind not in ("input_text", "output_text"):
            raise bad_request(f"input[{i}].{field}[{j}] of type {kind!r:.40} is not supported; only text parts "
                              "(input_text, output_text) are", f"input[{i}].{field}[{j}].type")
        texts.append(_validate_at(_TextPart, part, ("input", i, field, j)).text)
    return "".join(texts)


def chat_messages(instructions: str | None, items: list[dict],
                  origins: list[str]) -> tuple[list[dict], list[list[str]]]:
    """Items as chat messages, and for each message the request paths it came from.

    A ``function_call`` joins the assistant message right before it (text then calls, or
    parallel calls) as one of its ``tool_calls``; a ``function_call_output`` is a ``tool`` turn.
    ``origins[k]`` is item ``k``'s path (``input[3]``); the returned paths of a message are its
    item's, then one per tool call.
    """
    messages: list[dict] = [{"role": "system", "content": instructions}] if instructions is not None else []
    paths: list[list[str]] = [["instructions"]] if instructions is not None else []
    for item, where in zip(items, origins):
        if item["type"] == "message":
            messages.append({"role": item["role"], "content": item["content"]})
            paths.append([where])
        elif item["type"] == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
                paths[-1].append(where)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                paths.append([where, where])
        else:
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
            paths.append([where])
    return messages, paths


# A chat-side path (as the chat request names it) -> the Responses field it came from.
_CHAT_FIELDS = [
    (re.compile(r"^tools\[(\d+)\]\.function(.*)$"), lambda m, _: f"tools[{m[1]}]{m[2]}"),
    (re.compile(r"^messages\[(\d+)\]\.tool_calls\[(\d+)\]\.function\.(\w+)$"),
     lambda m, paths: f"{paths[int(m[1])][int(m[2]) + 1]}.{m[3]}"),
    (re.compile(r"^messages\[(\d+)\]\.tool_call_id$"), lambda m, paths: f"{paths[int(m[1])][0]}.call_id"),
    (re.compile(r"^messages\[(\d+)\](.*)$"), lambda m, paths: paths[int(m[1])][0]),
    (re.compile(r"^(messages|prompt)$"), lambda m, _: "input"),
    (re.compile(r"^max_(completion_)?tokens$"), lambda m, _: "max_output_tokens"),
    (re.compile(r"^response_format.*$"), lambda m, _: "text.format"),
]


def responses_param(param: str | None, paths: list[list[str]]) -> str | None:
    """The Responses field behind a chat request's ``param`` (see :func:`chat_messages`)."""
    for pattern, to in _CHAT_FIELDS:
        match = pattern.match(param or "")
        if match:
            return to(match, paths)
    return param


_CHAT_PATH = re.compile(r"messages\[\d+\](?:\.tool_calls\[\d+\]\.function\.\w+|\.tool_call_id)?")


def as_responses_error(exc: APIError, paths: list[list[str]]) -> APIError:
    """``exc`` with its ``param``, and the message paths in its text, named as the Responses request
    names them."""
    exc = exc.renamed(responses_param(exc.param, paths))
    exc.message = _CHAT_PATH.sub(lambda m: responses_param(m[0], paths) or m[0], exc.message)
    exc.args = (exc.message,)
    return exc


def chat_request(req: ResponsesRequest, items: list[dict], origins: list[str]) -> tuple[ChatCompletionRequest,
                                                                                        list[list[str]]]:
    """The chat-completions request that generates ``req``'s response from the conversation ``items``
    (``origins`` their request paths), and each message's paths for :func:`as_responses_error`.

    Raises:
        APIError: 400, ``param`` named as the Responses request names it.
    """
    messages, paths = chat_messages(req.instructions, items, origins)
    if not messages:
        raise bad_request("input must be a string or a non-empty list of items (or give instructions)", "input")
    body: dict[str, Any] = {"messages": messages, "max_tokens": req.max_output_tokens, "temperature": req.temperature,
                            "top_p": req.top_p, "parallel_tool_calls": req.parallel_tool_calls, "stream": req.stream,
                            "priority": req.priority}
    if req.function_tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in req.function_tools]
    if isinstance(req.tool_choice, dict):
        body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice["name"]}}
    else:
        body["tool_choice"] = req.tool_choice
    fmt = req.text_format
    if fmt["type"] == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt["type"] == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {
            k: v for k, v in fmt.items() if k in ("name", "description", "schema", "strict")}}
    try:
        return validate(ChatCompletionRequest, {k: v for k, v in body.items() if v is not None}), paths
    except APIError as exc:
        raise as_responses_error(exc, paths) from None
