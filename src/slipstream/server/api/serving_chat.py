"""``POST /v1/chat/completions``: messages → the model's chat template → tokens → generate.

The conversation is rendered with the model's own chat template (Hugging Face
``apply_chat_template``), with vLLM's ``chat_template_kwargs``, ``add_generation_prompt`` and
``continue_final_message``. With ``tools``, the ``--tool-call-parser`` format is taught in the
prompt (or passed to a template that renders tools), ``tool_choice`` ``required`` or a named
function is enforced by a grammar, and calls in the output come back as OpenAI ``tool_calls`` —
whole, or streamed as OpenAI's tool-call deltas (with ``parallel_tool_calls: false``, the first
call only, under any ``tool_choice``). With ``--reasoning-parser``, the model's
``<think>`` block comes back as ``reasoning_content`` apart from the content (see ``reasoning``).
Responses are ``chat.completion`` objects or ``chat.completion.chunk`` streams, as OpenAI's API
reference shows them.
"""
from __future__ import annotations

import asyncio
import dataclasses
import uuid
from typing import Any

from aiohttp import web

from slipstream.server import chat_template
from slipstream.server.api import render
from slipstream.server.api.errors import bad_request
from slipstream.server.api.logprobs import chat_logprobs, drop_hidden_stop_token
from slipstream.server.api.protocol import ChatCompletionRequest, check_model, parse_chat_request
from slipstream.server.api.reasoning import ReasoningStream
from slipstream.server.api.serving import GenerationCall, read_json
from slipstream.server.api.state import STATE, ServerState
from slipstream.server.api.tools import ToolCallStream, ToolParser, grammar_for, prepare_messages
from slipstream.server.engine.errors import InvalidRequest
from slipstream.server.engine.outputs import CompletionOutput
from slipstream.server.engine.sampling_params import SamplingParams, StructuredOutputsParams


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    state: ServerState = request.app[STATE]
    state.check_accepting()
    req = parse_chat_request(await read_json(request))
    check_model(req.model, state.model_names)
    parser = state.tool_parser if req.tools and req.tool_choice_value != "none" else None
    # Off the event loop: a long conversation takes a while to render and tokenize.
    text = await asyncio.to_thread(conversation_text, state, req, parser)
    prompt = await asyncio.to_thread(state.llm.tokenizer.encode, text, add_special_tokens=False)
    params = tool_params(req, parser)
    reasoning = state.reasoning_parser
    # A grammar shapes the output from its first token: it starts outside any reasoning.
    inside = reasoning is not None and reasoning.starts_inside(text) and params.structured_outputs is None
    call = ChatCall(state, req, f"chatcmpl-{uuid.uuid4().hex}", parser, reasoning_inside=inside)
    return await call.run(request, [prompt], params)


def render_template(tokenizer: Any, messages: list[dict], *, tools: list[dict] | None = None,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    chat_template_kwargs: dict | None = None) -> str:
    """The conversation as text, by the model's own chat template (:func:`chat_template.render_template`,
    which the gateway renders with too).

    Raises:
        APIError: 400 (param ``messages``) when the template refuses the conversation.
    """
    try:
        return chat_template.render_template(tokenizer, messages, tools=tools,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message,
                                             chat_template_kwargs=chat_template_kwargs)
    except chat_template.ChatTemplateError as exc:
        raise bad_request(str(exc), exc.param) from None


def prompt_token_ids(state: ServerState, req: ChatCompletionRequest, parser: ToolParser | None) -> list[int]:
    """Token ids of the request's conversation (the template already holds BOS if any)."""
    return state.llm.tokenizer.encode(conversation_text(state, req, parser), add_special_tokens=False)


def conversation_text(state: ServerState, req: Any, parser: ToolParser | None) -> str:
    """The conversation of a chat (or ``/tokenize``) request as the model sees it. Tool turns in
    the history are rendered in the parser's format; the tools are shown when ``parser`` is given."""
    messages = req.template_messages()
    tools = req.tool_dicts()
    has_tool_turns = any(m.role == "tool" or m.tool_calls for m in req.messages or [])
    template_tools = None
    if parser is not None or has_tool_turns:
        try:
            messages, template_tools = prepare_messages(messages, tools if parser is not None else None,
                                                        parser or state.tool_parser, state.template_supports_tools)
        except InvalidRequest as exc:
            raise bad_request(str(exc), exc.param, exc.code) from None
    return render_template(state.llm.tokenizer, messages, tools=template_tools,
                           add_generation_prompt=req.add_generation_prompt is not False
                           and not req.continue_final_message,
                           continue_final_message=bool(req.continue_final_message),
                           chat_template_kwargs=req.chat_template_kwargs)


def tool_params(req: ChatCompletionRequest, parser: ToolParser | None) -> SamplingParams:
    """The request's sampling params, with the grammar of a forced ``tool_choice`` and special
    tokens kept where the parser's marker is one."""
    params = req.params
    if parser is None:
        return params
    grammar = grammar_for(parser, req.tool_dicts(), req.tool_choice_value, req.parallel_tool_calls is not False)
    if grammar is not None and params.structured_outputs is not None:
        raise bad_request("tool_choice forces a tool call; it cannot be combined with a response_format or "
                          "structured_outputs constraint", "tool_choice")
    return dataclasses.replace(
        params, skip_special_tokens=params.skip_special_tokens and parser.skip_special_tokens,
        structured_outputs=StructuredOutputsParams(grammar=grammar) if grammar else params.structured_outputs)


@dataclasses.dataclass(slots=True)
class ChoiceStreams:
    """One streamed choice's readers: the reasoning is split off first, then tool calls are read
    out of the content (either is None when not configured for the call)."""

    reasoning: ReasoningStream | None
    tools: ToolCallStream | None


class ChatCall(GenerationCall):
    """A chat completion; with ``--reasoning-parser``, ``reasoning_inside`` says whether the output
    starts inside the reasoning (:meth:`ReasoningParser.starts_inside` of the prompt)."""

    chunk_object = "chat.completion.chunk"
    prompt_param = "messages"

    def __init__(self, state: ServerState, req: ChatCompletionRequest, request_id: str,
                 parser: ToolParser | None, *, reasoning_inside: bool = False) -> None:
        super().__init__(state, req, request_id)
        self.parser = parser
        self.reasoning = state.reasoning_parser
        self.reasoning_inside = reasoning_inside

    def opening_chunks(self, num_choices: int) -> list[dict]:
        """OpenAI opens each choice with the role and an empty content."""
        return [render.chat_delta(i, {"role": "assistant", "content": ""}) for i in range(num_choices)]

    def _entries(self, logprobs: list, finish_reason: str | None, stop_reason: str | int | None) -> list:
        """A choice's (or an increment's) logprob entries without a stop token the text leaves out."""
        return drop_hidden_stop_token(logprobs, finish_reason, stop_reason, self.state.token_bytes,
                                      self.req.params.skip_special_tokens)

    def _logprobs(self, co: CompletionOutput) -> dict | None:
        if self.req.logprob_width is None or not co.logprobs:
            return None
        return chat_logprobs(self._entries(co.logprobs, co.finish_reason, co.stop_reason), self.state.token_bytes)

    def _pieces(self, choice: render.Choice, text: str, final: bool) -> list[dict]:
        """The delta bodies of one increment of text (``final``: and of the end of the output)."""
        if choice.state is None:
            choice.state = ChoiceStreams(
                self.reasoning.stream(inside=self.reasoning_inside) if self.reasoning is not None else None,
                self.parser.stream(parallel_tool_calls=self.req.parallel_tool_calls is not False)
                if self.parser is not None else None)
        streams: ChoiceStreams = choice.state
        if streams.reasoning is None:
            split = [{"content": text}] if text else []
        else:
            split = streams.reasoning.feed(text) + (streams.reasoning.finish() if final else [])
        pieces = []
        for piece in split:
            if "reasoning_content" in piece:  # newer vLLM also names it ``reasoning``
                pieces.append({**piece, "reasoning": piece["reasoning_content"]})
            elif streams.tools is not None:
                pieces += streams.tools.feed(piece["content"])
            else:
                pieces.append(piece)
        if final and streams.tools is not None:
            pieces += streams.tools.finish()
        return pieces

    def deltas(self, choice: render.Choice, co: CompletionOutput) -> list[dict]:
        logprobs = self._logprobs(co)
        pieces = self._pieces(choice, co.text, final=False)
        if not pieces and logprobs is not None:
            pieces = [{"content": ""}]
        return [render.chat_delta(choice.index, piece, logprobs if i == 0 else None)
                for i, piece in enumerate(pieces)]

    def closing_deltas(self, choice: render.Choice) -> list[dict]:
        return [render.chat_delta(choice.index, piece) for piece in self._pieces(choice, "", final=True)]

    def _finish_reason(self, choice: render.Choice, made_calls: bool) -> str | None:
        """OpenAI's ``tool_calls`` when the model stopped after calling; ``length`` stays ``length``."""
        return "tool_calls" if made_calls and choice.finish_reason == "stop" else choice.finish_reason

    def finish_delta(self, choice: render.Choice) -> dict:
        streams: ChoiceStreams | None = choice.state
        made_calls = streams is not None and streams.tools is not None and bool(streams.tools.tool_calls)
        return render.chat_delta(choice.index, {}, finish_reason=self._finish_reason(choice, made_calls))

    def _message(self, choice: render.Choice) -> tuple[dict, bool]:
        """The choice's message and whether it made tool calls: reasoning split off first, then
        calls read out of the content."""
        content: str | None = choice.text
        reasoning = None
        if self.reasoning is not None:
            reasoning, content = self.reasoning.extract(choice.text, inside=self.reasoning_inside)
        calls: list[dict] = []
        if self.parser is not None:
            content, calls = self.parser.extract(content or "",
                                                 parallel_tool_calls=self.req.parallel_tool_calls is not False)
        message = {"role": "assistant", "content": content, "refusal": None}
        if self.reasoning is not None:  # newer vLLM also names it ``reasoning``
            message["reasoning_content"] = message["reasoning"] = reasoning
        if calls:
            message["tool_calls"] = calls
        return message, bool(calls)

    def response_body(self, choices: list[render.Choice]) -> dict:
        with_logprobs = self.req.logprob_width is not None
        out = []
        for c in choices:
            message, made_calls = self._message(c)
            out.append({"index": c.index, "message": message,
                        "logprobs": chat_logprobs(self._entries(c.logprobs, c.finish_reason, c.stop_reason),
                                                  self.state.token_bytes) if with_logprobs else None,
                        "finish_reason": self._finish_reason(c, made_calls)})
        return {"id": self.request_id, "object": "chat.completion", "created": self.created,
                "model": self.state.model_name, "choices": out, "usage": self.usage.body()}
