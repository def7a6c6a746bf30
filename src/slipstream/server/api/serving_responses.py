"""``POST /v1/responses``: OpenAI's Responses API over the chat-completions path.

The request becomes a chat request (:func:`.protocol_responses.chat_request`): the same chat
template, tools, ``tool_choice`` grammars, structured outputs and sampling. The model's text
becomes output items — a ``message`` with one ``output_text`` part, and one ``function_call``
item per tool call the ``--tool-call-parser`` reads (the first only, with ``parallel_tool_calls:
false``) — in a ``response`` object, or, streamed, as OpenAI's named events (``event: <type>``,
each with a ``sequence_number``): ``response.created``, ``response.in_progress``,
``response.output_item.added``, ``response.content_part.added``, ``response.output_text.delta``
…, ``response.function_call_arguments.delta`` …, the matching ``.done`` events, then
``response.completed`` or, cut at ``max_output_tokens``, ``response.incomplete`` with the whole
response. As OpenAI's, the stream ends without ``data: [DONE]``.

``store`` (default true) keeps a response — the ``response`` object and its conversation, input
items and output items — in a bounded in-memory :class:`ResponseStore` (an LRU of 1024 responses
and 64 MiB of their JSON), so ``GET /v1/responses/{id}`` returns it and ``previous_response_id``
continues it. The store is per server process: behind a Service with several replicas a request
may reach one that never saw the response, and gets a 404 (retrieve) or a 400 naming
``previous_response_id``.
"""
from __future__ import annotations

import asyncio
import copy
import json
import time
import uuid
from collections import OrderedDict
from typing import Any

from aiohttp import web

from slipstream.server.api import render
from slipstream.server.api.errors import APIError
from slipstream.server.api.protocol import ChatCompletionRequest, check_model, validate
from slipstream.server.api.protocol_responses import ResponsesRequest, as_responses_error, chat_request
from slipstream.server.api.serving import GenerationCall, read_json
from slipstream.server.api.serving_chat import prompt_token_ids, tool_params
from slipstream.server.api.sse import SSEStream
from slipstream.server.api.state import STATE, ServerState
from slipstream.server.api.tools import ToolCallStream, ToolParser
from slipstream.server.engine.outputs import CompletionOutput


class ResponseStore:
    """Stored responses (the ``response`` object and its conversation), least recently used
    dropped first.

    Bounded by ``max_responses`` entries and ``max_bytes`` of their JSON (bytes); a response larger
    than ``max_bytes`` alone is not kept.
    """

    def __init__(self, max_responses: int = 1024, max_bytes: int = 64 << 20) -> None:
        self.max_responses, self.max_bytes = max_responses, max_bytes
        self._items: OrderedDict[str, tuple[list[dict], dict, int]] = OrderedDict()
        self._bytes = 0

    def put(self, response_id: str, items: list[dict], response: dict) -> None:
        """Keep ``items`` (input then output, as input items) and the ``response`` object under ``response_id``."""
        size = len(json.dumps([items, response], ensure_ascii=False).encode())
        if size > self.max_bytes:
            return
        self._items[response_id] = (items, copy.deepcopy(response), size)
        self._bytes += size
        while len(self._items) > self.max_responses or self._bytes > self.max_bytes:
            _, (_, _, dropped) = self._items.popitem(last=False)
            self._bytes -= dropped

    def get(self, response_id: str) -> list[dict] | None:
        """The conversation of ``response_id`` (a copy), or None when unknown or dropped."""
        entry = self._entry(response_id)
        return copy.deepcopy(entry[0]) if entry is not None else None

    def response(self, response_id: str) -> dict | None:
        """The ``response`` object of ``response_id`` (a copy), or None when unknown or dropped."""
        entry = self._entry(response_id)
        return copy.deepcopy(entry[1]) if entry is not None else None

    def _entry(self, response_id: str) -> tuple[list[dict], dict, int] | None:
        entry = self._items.get(response_id)
        if entry is not None:
            self._items.move_to_end(response_id)
        return entry

    def __len__(self) -> int:
        return len(self._items)


class ResponsesAPI:
    """The endpoint with its store; route :meth:`create` as ``POST /v1/responses`` and
    :meth:`retrieve` as ``GET /v1/responses/{response_id}``."""

    def __init__(self, store: ResponseStore | None = None) -> None:
        self.store = store if store is not None else ResponseStore()

    async def create(self, request: web.Request) -> web.StreamResponse:
        """A ``response`` object, or its event stream with ``stream: true``.

        Raises:
            APIError: 400 naming the Responses field (``input[2].call_id``, ``previous_response_id``
                unknown, ...), 404 for another ``model``, 429/503 from admission.
        """
        state: ServerState = request.app[STATE]
        state.check_accepting()
        req = validate(ResponsesRequest, await read_json(request))
        check_model(req.model, state.model_names)
        history: list[dict] = []
        if req.previous_response_id is not None:
            history = self.store.get(req.previous_response_id)
            if history is None:
                raise APIError(400, f"Previous response with id {req.previous_response_id!r:.80} not found: it was "
                               "created with store=false, dropped from this server's bounded store, or served by "
                               "another replica; send the conversation as input instead", param="previous_response_id",
                               code="previous_response_not_found")
        items = history + req.items
        origins = ["previous_response_id"] * len(history) + (
            ["input"] if isinstance(req.input, str) else [f"input[{i}]" for i in range(len(req.items))])
        chat, paths = chat_request(req, items, origins)
        parser = state.tool_parser if chat.tools and chat.tool_choice_value != "none" else None
        try:
            params = tool_params(chat, parser)
            # Off the event loop: a long conversation takes a while to render and tokenize.
            prompt = await asyncio.to_thread(prompt_token_ids, state, chat, parser)
        except APIError as exc:
            raise as_responses_error(exc, paths) from None
        call = ResponsesCall(state, chat, f"resp_{uuid.uuid4().hex}", req, parser, items, self.store)
        try:
            return await call.run(request, [prompt], params)
        except APIError as exc:  # the engine's refusals, named as the Responses request names them
            raise as_responses_error(exc, paths) from None


    async def retrieve(self, request: web.Request) -> web.Response:
        """A stored ``response`` object (the openai client's ``responses.retrieve``).

        Raises:
            APIError: 404 for an id never stored here (``store: false``, dropped from the bounded
                store, or created by another replica).
        """
        request.app[STATE].check_accepting()
        response_id = request.match_info["response_id"]
        body = self.store.response(response_id)
        if body is None:
            raise APIError(404, f"Response with id {response_id!r:.80} not found: it was created with store=false, "
                           "dropped from this server's bounded store, or served by another replica.",
                           param="response_id", code="not_found")
        return web.json_response(body, dumps=render.json_text)


class EventStream(SSEStream):
    """Server-sent events as the Responses API sends them: ``event: <type>`` and ``data: <json>``
    per event, and no ``[DONE]`` at the end."""

    async def send(self, payload: dict) -> None:
        await self.response.write(f"event: {payload['type']}\n".encode() + b"data: "
                                  + render.json_text(payload).encode() + b"\n\n")

    async def comment(self, payload: dict) -> None:
        """An SSE comment after ``response.completed`` (which carries the usage too, but before
        fields the request echoes, of any length): the last bytes, where a gateway reads it."""
        await self.response.write(b": " + render.json_text(payload).encode() + b"\n\n")

    async def done(self) -> web.StreamResponse:
        await self.response.write_eof()
        return self.response


class OutputItems:
    """The output items of one generation and the stream events that build them, from text deltas.

    Without a tool-call reader every delta is the message's text. With one, its ``content``
    deltas are message text and its calls ``function_call`` items, in the order generated (text
    after a call opens a new message). Events are dicts without ``sequence_number``.

    Args:
        calls: the parser's :class:`ToolCallStream` of this generation, or None without tools.
    """

    def __init__(self, calls: ToolCallStream | None) -> None:
        self.items: list[dict] = []
        self._calls = calls
        self._open: dict | None = None

    def feed(self, text: str) -> list[dict]:
        """Events for the next piece of generated text."""
        if self._calls is None:
            return self._apply([{"content": text}] if text else [])
        return self._apply(self._calls.feed(text))

    def finish(self, incomplete: bool) -> list[dict]:
        """Events that close the output; an output without items gets an empty message. With
        ``incomplete`` (cut at the token limit) the last item's status is ``incomplete``."""
        events = self._apply(self._calls.finish()) if self._calls is not None else []
        if not self.items:
            events += self._open_message()
        return events + self._close("incomplete" if incomplete else "completed")

    def _apply(self, pieces: list[dict]) -> list[dict]:
        events: list[dict] = []
        for piece in pieces:
            if "content" in piece:
                if self._open is None or self._open["type"] != "message":
                    events += self._close("completed") + self._open_message()
                part = self._open["content"][0]
                part["text"] += piece["content"]
                events.append(self._event("response.output_text.delta", content_index=0, delta=piece["content"],
                                          logprobs=[]))
                continue
            call = piece["tool_calls"][0]
            if "id" in call:
                events += self._close("completed") + self._open_item({
                    "id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": "in_progress",
                    "call_id": call["id"], "name": call["function"]["name"], "arguments": ""})
            fragment = call["function"]["arguments"]
            if fragment:
                self._open["arguments"] += fragment
                events.append(self._event("response.function_call_arguments.delta", delta=fragment))
        return events

    def _event(self, kind: str, **fields: Any) -> dict:
        return {"type": kind, "item_id": self._open["id"], "output_index": len(self.items) - 1, **fields}

    def _open_item(self, item: dict) -> list[dict]:
        self.items.append(item)
        self._open = item
        return [{"type": "response.output_item.added", "output_index": len(self.items) - 1,
                 "item": copy.deepcopy(item)}]

    def _open_message(self) -> list[dict]:
        events = self._open_item({"id": f"msg_{uuid.uuid4().hex}", "type": "message", "status": "in_progress",
                                  "role": "assistant", "content": []})
        part = {"type": "output_text", "text": "", "annotations": []}
        self._open["content"].append(part)
        return events + [self._event("response.content_part.added", content_index=0, part=dict(part))]

    def _close(self, status: str) -> list[dict]:
        item, events = self._open, []
        if item is None:
            return []
        if item["type"] == "message":
            part = item["content"][0]
            events += [self._event("response.output_text.done", content_index=0, text=part["text"], logprobs=[]),
                       self._event("response.content_part.done", content_index=0, part=dict(part))]
        else:
            events.append(self._event("response.function_call_arguments.done", arguments=item["arguments"]))
        item["status"] = status
        events.append({"type": "response.output_item.done", "output_index": len(self.items) - 1,
                       "item": copy.deepcopy(item)})
        self._open = None
        return events


def as_input_item(item: dict) -> dict:
    """An output item as the input item that feeds it back (what the store keeps)."""
    if item["type"] == "message":
        return {"type": "message", "role": "assistant", "content": "".join(p["text"] for p in item["content"])}
    return {"type": "function_call", "call_id": item["call_id"], "name": item["name"], "arguments": item["arguments"]}


class ResponsesCall(GenerationCall):
    """One ``POST /v1/responses``: the chat request generates; this renders a ``response``."""

    prompt_param = "input"

    def __init__(self, state: ServerState, chat: ChatCompletionRequest, request_id: str, req: ResponsesRequest,
                 parser: ToolParser | None, items: list[dict], store: ResponseStore) -> None:
        super().__init__(state, chat, request_id)
        self.responses_req, self.parser, self.items, self.store = req, parser, items, store
        self.sequence_number = 0

    def open_sse(self, request: web.Request) -> SSEStream:
        return EventStream(request)

    def chunk(self, choices: list[dict], usage: render.Usage | None = None) -> dict:
        """The event as sent: numbered in stream order."""
        event = {**choices[0], "sequence_number": self.sequence_number}
        self.sequence_number += 1
        return event

    def error_chunk(self, error: APIError) -> dict:
        return self.chunk([{"type": "error", "code": error.code, "message": error.message, "param": error.param}])

    def opening_chunks(self, num_choices: int) -> list[dict]:
        snapshot = self.response([], "in_progress")
        return [{"type": "response.created", "response": snapshot},
                {"type": "response.in_progress", "response": snapshot}]

    def _output(self, choice: render.Choice) -> OutputItems:
        if choice.state is None:
            calls = None
            if self.parser is not None:
                # parallel_tool_calls false: the first function_call item only (the grammar of a
                # forced tool_choice already allows one; under "auto" later calls are dropped)
                calls = self.parser.stream(parallel_tool_calls=self.req.parallel_tool_calls is not False)
            choice.state = OutputItems(calls)
        return choice.state

    def deltas(self, choice: render.Choice, co: CompletionOutput) -> list[dict]:
        return self._output(choice).feed(co.text)

    def closing_deltas(self, choice: render.Choice) -> list[dict]:
        return self._output(choice).finish(choice.finish_reason == "length")

    def finish_delta(self, choice: render.Choice) -> dict:
        body = self._finished(choice)
        return {"type": f"response.{body['status']}", "response": body}

    def response_body(self, choices: list[render.Choice]) -> dict:
        output = self._output(choices[0])
        output.feed(choices[0].text)  # whole: a call cut off inside its arguments stays text, as extract()
        output.finish(choices[0].finish_reason == "length")
        return self._finished(choices[0])

    def _finished(self, choice: render.Choice) -> dict:
        """The final response of a generation whose items are closed; stored unless ``store`` is false."""
        items = choice.state.items
        body = self.response(items, "incomplete" if choice.finish_reason == "length" else "completed")
        if self.responses_req.store is not False:
            self.store.put(self.request_id, self.items + [as_input_item(i) for i in items], body)
        return body

    def response(self, output: list[dict], status: str) -> dict:
        """The ``response`` object, as OpenAI's API reference shows it."""
        req = self.responses_req
        usage = None
        if status != "in_progress":
            usage = {"input_tokens": self.usage.prompt_tokens,
                     # cache_write_tokens: OpenAI counts explicit cache writes; the prefix cache's are not counted
                     "input_tokens_details": {"cached_tokens": self.usage.cached_tokens, "cache_write_tokens": 0},
                     "output_tokens": self.usage.completion_tokens,
                     "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": self.usage.prompt_tokens + self.usage.completion_tokens}
        return {
            "id": self.request_id, "object": "response", "created_at": self.created, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "background": False, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": req.max_tool_calls, "model": self.state.model_name, "output": copy.deepcopy(output),
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id, "reasoning": None,
            "service_tier": "default", "store": req.store is not False,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": {"format": req.text_format, "verbosity": (req.text.verbosity if req.text else None) or "medium"},
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": [t.model_dump() for t in req.function_tools],
            "top_p": 1.0 if req.top_p is None else req.top_p, "truncation": "disabled",
            "usage": usage, "user": req.user, "metadata": req.metadata or {},
            "prompt_cache_key": req.prompt_cache_key, "safety_identifier": req.safety_identifier,
        }
