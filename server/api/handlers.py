"""``POST /v1/chat/completions`` and ``POST /v1/completions``: validate, admit, generate, respond.

One flow for both: parse the body (400 naming the field), check the model (404), admit (503
while draining, 429 over ``--max-waiting``), start the engine requests (400 when the engine
refuses, before any stream starts), then either collect one JSON body or stream SSE chunks.
Leaving the flow early for any reason — client gone, error — aborts the engine requests.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any

from aiohttp import web

from slipstream.server.api import render
from slipstream.server.api.errors import APIError, bad_request
from slipstream.server.api.generation import GenerationGroup
from slipstream.server.api.protocol import GenerationRequest, check_model, parse_chat_request, \
    parse_completion_request
from slipstream.server.api.sse import SSEStream
from slipstream.server.api.state import STATE, ServerState
from slipstream.server.engine.outputs import FinishReason, RequestOutput

logger = logging.getLogger("slipstream.server")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


async def read_json(request: web.Request) -> Any:
    """The body as JSON. Raises 400 for malformed JSON, 413 (from aiohttp) for an oversized body."""
    raw = await request.read()
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}") from None
    except RecursionError:  # nesting deeper than the parser's stack
        raise bad_request("The request body is not valid JSON: nested too deeply") from None


def _chat_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of the conversation, rendered with the model's own chat template."""
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # jinja2 errors raised by the template itself (e.g. role order)
        raise bad_request(f"messages could not be rendered with the model's chat template: {exc}",
                          "messages") from None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad_request(f"messages are not valid Unicode text: {exc.reason}", "messages") from None
    return tokenizer.encode(text, add_special_tokens=False)  # the template already holds BOS if any


async def _generate(request: web.Request, *, chat: bool) -> web.StreamResponse:
    state: ServerState = request.app[STATE]
    state.check_accepting()
    body = await read_json(request)
    llm = state.llm
    if chat:
        req = parse_chat_request(body)
        check_model(req.model, state.model_name)
        # Off the event loop: a long conversation takes a while to render and tokenize.
        prompts: list = [await asyncio.to_thread(_chat_prompt, llm.tokenizer, req.messages)]
    else:
        req = parse_completion_request(body, vocab_size=state.vocab_size)
        check_model(req.model, state.model_name)
        prompts = req.prompts
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    with state.admit(request_id, len(prompts), req.params.n) as record:
        async with GenerationGroup(llm, prompts, req.params, request_id) as group:
            try:
                await group.start()
            except ValueError as exc:  # RequestRejected carries code and param
                raise APIError(400, str(exc), param=_prompt_param(exc, chat),
                               code=getattr(exc, "code", None)) from None
            for out in group.first_outputs:  # failed at its first step: a real status, not a 200 stream
                failure = _failure(state, out)
                if failure is not None:
                    raise failure
            call = _Call(state, req, request_id, chat, record)
            if req.stream:
                return await call.stream(request, group)
            return await call.collect(group)


def _prompt_param(exc: ValueError, chat: bool) -> str | None:
    """The field an engine refusal names, in this endpoint's terms (``messages`` or ``prompt``)."""
    param = getattr(exc, "param", None) or ("prompt" if str(exc).startswith("prompt") else None)
    if param in ("messages", "prompt"):
        return "messages" if chat else "prompt"
    return param


def _failure(state: ServerState, out: RequestOutput) -> APIError | None:
    """The error a finished-by-abort output stands for: a drain that ran out (503) or a failed step (500)."""
    aborted = out.error or any(c.finish_reason == FinishReason.ABORT for c in out.outputs)
    if not aborted:
        return None
    if state.drain_expired:
        return APIError(503, "The request was aborted: the server is shutting down. Retry it.",
                        code="server_shutting_down")
    return APIError(500, f"The request failed inside the engine: {out.error or 'aborted'}", code="engine_error")


class _Call:
    """One API call's accumulated choices and usage, rendered as a body or as stream chunks."""

    def __init__(self, state: ServerState, req: GenerationRequest, request_id: str, chat: bool, record: Any):
        self.state, self.req, self.request_id, self.chat, self.record = state, req, request_id, chat, record
        self.created = int(time.time())
        self.n = req.params.n
        self.choices: dict[int, render.Choice] = {}
        self.usage = render.Usage()
        self._seen_prompts: set[int] = set()

    def _count_prompt(self, prompt_index: int, out: RequestOutput) -> None:
        """Add a prompt's tokens to the usage, once per prompt."""
        if prompt_index not in self._seen_prompts:
            self._seen_prompts.add(prompt_index)
            self.usage.prompt_tokens += len(out.prompt_token_ids)
            self.usage.cached_tokens += out.num_cached_tokens

    def _absorb(self, prompt_index: int, out: RequestOutput) -> list[tuple[render.Choice, Any]]:
        """Account one increment; returns the (choice, increment) pairs it touched."""
        self.record.observe(prompt_index, out)
        self._count_prompt(prompt_index, out)
        touched = []
        for co in out.outputs:
            index = prompt_index * self.n + co.index
            choice = self.choices.setdefault(index, render.Choice(index))
            choice.text += co.text
            choice.num_tokens += len(co.token_ids)
            self.usage.completion_tokens += len(co.token_ids)
            if co.logprobs:
                choice.logprobs.extend(co.logprobs)
            if co.finish_reason is not None:
                choice.finish_reason = str(co.finish_reason.value if isinstance(co.finish_reason, FinishReason)
                                           else co.finish_reason)
            touched.append((choice, co))
        return touched

    async def collect(self, group: GenerationGroup) -> web.Response:
        async for prompt_index, out in group:
            self._absorb(prompt_index, out)
            failure = _failure(self.state, out) if out.finished or out.error else None
            if failure is not None:
                raise failure
        build = render.chat_response if self.chat else render.completion_response
        choices = [self.choices[i] for i in sorted(self.choices)]
        body = build(self.request_id, self.created, self.state.model_name, choices, self.usage,
                     self.state.token_text, self.req.logprobs is not None)
        return web.json_response(body)

    def _chunk(self, choices: list[dict], usage: render.Usage | None = None) -> dict:
        """A stream chunk; with ``continuous_usage_stats`` each one that has choices carries the usage so far."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        if self.req.continuous_usage and choices:
            usage = self.usage
        return render.chunk(self.request_id, self.created, self.state.model_name, obj, choices,
                            self.req.include_usage or self.req.continuous_usage, usage)

    def _deltas(self, choice: render.Choice, co: Any) -> list[dict]:
        with_logprobs = self.req.logprobs is not None and co.logprobs
        deltas = []
        if co.text or with_logprobs:
            if self.chat:
                logprobs = render.chat_logprobs(co.logprobs, self.state.token_text) if with_logprobs else None
                deltas.append(render.chat_delta(choice.index, {"content": co.text}, logprobs))
            else:
                logprobs = None
                if with_logprobs:
                    logprobs, choice.text_offset = render.completion_logprobs(
                        co.logprobs, self.state.token_text, choice.text_offset)
                deltas.append(render.completion_delta(choice.index, co.text, logprobs))
        if co.finish_reason is not None and choice.finish_reason != FinishReason.ABORT.value:
            deltas.append(render.chat_delta(choice.index, {}, finish_reason=choice.finish_reason) if self.chat
                          else render.completion_delta(choice.index, "", finish_reason=choice.finish_reason))
        return deltas

    async def stream(self, request: web.Request, group: GenerationGroup) -> web.StreamResponse:
        sse = SSEStream(request)
        try:
            await sse.open()
            for prompt_index, out in enumerate(group.first_outputs):  # prompt_tokens fixed from the first chunk
                self._count_prompt(prompt_index, out)
            if self.chat:  # OpenAI opens each choice with the role and an empty content
                num_choices = self.n * len(group.request_ids)
                for index in range(num_choices):
                    await sse.send(self._chunk([render.chat_delta(index, {"role": "assistant", "content": ""})]))
            async for prompt_index, out in group:
                for choice, co in self._absorb(prompt_index, out):
                    for delta in self._deltas(choice, co):
                        await sse.send(self._chunk([delta]))
                failure = _failure(self.state, out) if out.finished or out.error else None
                if failure is not None:
                    logger.warning("request %s failed mid-stream: %s", self.request_id, failure.message)
                    await sse.send(failure.body())
                    return await sse.done()
            if self.req.include_usage:
                await sse.send(self._chunk([], self.usage))
            return await sse.done()
        except ConnectionError:  # the client went away; leaving aborts the engine requests
            self.record.client_gone = True
            return sse.response
        except Exception:  # once the stream is open, the only way to report is an error event
            if not sse.response.prepared:
                raise
            logger.exception("request %s failed mid-stream", self.request_id)
            try:
                await sse.send(APIError(500, "Internal server error; see the server log.",
                                        code="internal_error").body())
                return await sse.done()
            except ConnectionError:
                return sse.response
