"""What every generation endpoint shares: admit, start the engine requests, then either collect one
JSON body or stream SSE chunks.

The flow: admit (503 while draining, 429 over ``--max-waiting``), start the engine requests (400
when the engine refuses, before any stream starts: its ``param`` and ``code`` come as data), then
:class:`GenerationCall` accumulates choices and usage and renders them through the endpoint's
hooks. Leaving the flow early for any reason — client gone, error — aborts the engine requests.
The endpoint modules (``serving_chat``, ``serving_completions``) hold only what differs.
"""
from __future__ import annotations

import json
import logging
import time
from typing import Any

from aiohttp import web

from slipstream.api_types.tenancy import FAIRNESS_ID_HEADER, USAGE_HEADER, tenant_of
from slipstream.server.api import render
from slipstream.server.api.errors import APIError, bad_request, refusal
from slipstream.server.api.generation import GenerationGroup
from slipstream.server.api.sse import SSEStream
from slipstream.server.api.state import ServerState
from slipstream.server.engine.errors import InvalidRequest
from slipstream.server.engine.outputs import CompletionOutput, FinishReason, RequestOutput
from slipstream.server.engine.sampling_params import SamplingParams

logger = logging.getLogger("slipstream.server")


async def read_json(request: web.Request) -> Any:
    """The body as JSON. Raises 400 for malformed JSON, 413 (from aiohttp) for an oversized body."""
    raw = await request.read()
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}") from None
    except RecursionError:  # nesting deeper than the parser's stack
        raise bad_request("The request body is not valid JSON: nested too deeply") from None


def failure(state: ServerState, out: RequestOutput) -> APIError | None:
    """The error a finished-by-abort output stands for: an engine that stopped for good (503: a
    rank of a parallel group died and the server is exiting; the request is not at fault, so a
    gateway retries it on another replica before the first byte), a drain that ran out (503) or
    a failed step (500)."""
    aborted = out.error or any(c.finish_reason == FinishReason.ABORT for c in out.outputs)
    if not aborted:
        return None
    stopped = getattr(state.llm, "failure", None)
    if stopped is not None:
        return APIError(503, f"The request was aborted: this replica's engine stopped ({stopped}). Retry it; "
                        "another replica, or this one once restarted, will serve it.", code="engine_failed",
                        headers={"Retry-After": "1"})
    if state.drain_expired:
        return APIError(503, "The request was aborted: the server is shutting down. Retry it.",
                        code="server_shutting_down")
    return APIError(500, f"The request failed inside the engine: {out.error or 'aborted'}", code="engine_error")


class GenerationCall:
    """One API call's accumulated choices and usage, rendered as a body or as stream chunks.

    Subclasses (one per endpoint) set :attr:`chunk_object` and implement :meth:`deltas`,
    :meth:`finish_delta` and :meth:`response_body`; :meth:`opening_chunks` and :meth:`closing_deltas`
    are optional.

    Args:
        prompt_param: the request field an engine refusal of the prompt is reported under.
    """

    chunk_object = ""
    prompt_param = "prompt"

    def __init__(self, state: ServerState, req: Any, request_id: str) -> None:
        self.state, self.req, self.request_id = state, req, request_id
        self.created = int(time.time())
        self.n = req.params.n
        self.choices: dict[int, render.Choice] = {}
        self.usage = render.Usage()
        self.record: Any = None
        self._seen_prompts: set[int] = set()

    # --- endpoint hooks ------------------------------------------------------------------------
    def opening_chunks(self, num_choices: int) -> list[dict]:
        """Choice deltas sent before any token (chat opens each choice with its role)."""
        return []

    def deltas(self, choice: render.Choice, co: CompletionOutput) -> list[dict]:
        """The stream deltas of one increment of one choice (without its finish)."""
        raise NotImplementedError

    def closing_deltas(self, choice: render.Choice) -> list[dict]:
        """Deltas held back until the choice finished (e.g. a tool call's tail)."""
        return []

    def finish_delta(self, choice: render.Choice) -> dict:
        raise NotImplementedError

    def response_body(self, choices: list[render.Choice]) -> dict:
        raise NotImplementedError

    def on_first_outputs(self, outputs: list[RequestOutput]) -> None:
        """Called once every engine request has its first output (prompt-side data is there)."""

    def open_sse(self, request: web.Request) -> SSEStream:
        """The event stream the chunks are written to (the Responses API names each event)."""
        return SSEStream(request)

    def error_chunk(self, error: APIError) -> dict:
        """What a stream sends when it fails after opening: OpenAI's error body."""
        return error.body()

    # --- the flow ------------------------------------------------------------------------------
    async def run(self, request: web.Request, prompts: list, params: SamplingParams) -> web.StreamResponse:
        """Admit, start and answer; raises :class:`APIError` for anything refused before a stream opens."""
        state = self.state
        try:
            tenant = tenant_of(request.headers.get(FAIRNESS_ID_HEADER))
        except ValueError as exc:
            raise bad_request(str(exc), code="invalid_tenant") from None
        with state.admit(self.request_id, len(prompts), params.n, tenant) as record:
            self.record = record
            priority = getattr(self.req, "priority", 0)
            async with GenerationGroup(state.llm, prompts, params, self.request_id, tenant, priority) as group:
                try:
                    await group.start()
                except InvalidRequest as exc:
                    param = self.prompt_param if exc.param in ("prompt", "messages") else self.req.engine_param(exc.param)
                    raise refusal(exc, param) from None
                for out in group.first_outputs:  # failed at its first step: a real status, not a 200 stream
                    error = failure(state, out)
                    if error is not None:
                        for i, first in enumerate(group.first_outputs):  # counted and logged like any other
                            record.observe(i, first)
                        raise error
                self.on_first_outputs(group.first_outputs)
                if self.req.stream:
                    return await self.stream(request, group)
                return await self.collect(group)

    def _count_prompt(self, prompt_index: int, out: RequestOutput) -> None:
        """Add a prompt's tokens to the usage, once per prompt."""
        if prompt_index not in self._seen_prompts:
            self._seen_prompts.add(prompt_index)
            self.usage.prompt_tokens += len(out.prompt_token_ids)
            self.usage.cached_tokens += out.num_cached_tokens

    def _absorb(self, prompt_index: int, out: RequestOutput) -> list[tuple[render.Choice, CompletionOutput]]:
        """Account one increment; returns the (choice, increment) pairs it touched."""
        self.record.observe(prompt_index, out)
        self._count_prompt(prompt_index, out)
        touched = []
        for co in out.outputs:
            index = prompt_index * self.n + co.index
            choice = self.choices.setdefault(index, render.Choice(index, prompt_index=prompt_index))
            choice.text += co.text
            choice.token_ids.extend(co.token_ids)
            self.usage.completion_tokens += len(co.token_ids)
            if co.logprobs:
                choice.logprobs.extend(co.logprobs)
            if co.finish_reason is not None:
                choice.finish_reason = str(co.finish_reason.value if isinstance(co.finish_reason, FinishReason)
                                           else co.finish_reason)
                choice.stop_reason = co.stop_reason
            touched.append((choice, co))
        return touched

    async def collect(self, group: GenerationGroup) -> web.Response:
        async for prompt_index, out in group:
            self._absorb(prompt_index, out)
            error = failure(self.state, out) if out.finished or out.error else None
            if error is not None:
                raise error
        return web.json_response(self.response_body([self.choices[i] for i in sorted(self.choices)]),
                                 dumps=render.json_text, headers={USAGE_HEADER: render.json_text(self.usage.body())})

    def chunk(self, choices: list[dict], usage: render.Usage | None = None) -> dict:
        """A stream chunk; with ``continuous_usage_stats`` each one that has choices carries the usage so far."""
        if self.req.continuous_usage and choices:
            usage = self.usage
        return render.chunk(self.request_id, self.created, self.state.model_name, self.chunk_object, choices,
                            self.req.include_usage or self.req.continuous_usage, usage)

    async def stream(self, request: web.Request, group: GenerationGroup) -> web.StreamResponse:
        sse = self.open_sse(request)
        try:
            await sse.open()
            for prompt_index, out in enumerate(group.first_outputs):  # prompt_tokens fixed from the first chunk
                self._count_prompt(prompt_index, out)
            for delta in self.opening_chunks(self.n * len(group.request_ids)):
                await sse.send(self.chunk([delta]))
            async for prompt_index, out in group:
                for choice, co in self._absorb(prompt_index, out):
                    deltas = self.deltas(choice, co)
                    if co.finish_reason is not None and choice.finish_reason != FinishReason.ABORT.value:
                        deltas += self.closing_deltas(choice) + [self.finish_delta(choice)]
                    for delta in deltas:
                        await sse.send(self.chunk([delta]))
                error = failure(self.state, out) if out.finished or out.error else None
                if error is not None:
                    logger.warning("request %s failed mid-stream: %s", self.request_id, error.message)
                    await sse.send(self.error_chunk(error))
                    return await sse.done()
            if self.req.include_usage:
                await sse.send(self.chunk([], self.usage))
            else:  # for the gateway's counters (sse.py): clients skip comments
                await sse.comment({"usage": self.usage.body()})
            return await sse.done()
        except ConnectionError:  # the client went away; leaving aborts the engine requests
            self.record.client_gone = True
            return sse.response
        except Exception:  # once the stream is open, the only way to report is an error event
            if not sse.response.prepared:
                raise
            logger.exception("request %s failed mid-stream", self.request_id)
            try:
                await sse.send(self.error_chunk(APIError(500, "Internal server error; see the server log.",
                                                         code="internal_error")))
                return await sse.done()
            except ConnectionError:
                return sse.response
