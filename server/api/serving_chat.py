"""``POST /v1/chat/completions``: messages → the model's chat template → tokens → generate.

The conversation is rendered with the model's own chat template (Hugging Face
``apply_chat_template``), with vLLM's ``chat_template_kwargs``, ``add_generation_prompt`` and
``continue_final_message``. Responses are ``chat.completion`` objects or
``chat.completion.chunk`` streams, as OpenAI's API reference shows them.
"""
from __future__ import annotations

import asyncio
import uuid
from typing import Any

from aiohttp import web

from slipstream.server.api import render
from slipstream.server.api.errors import bad_request
from slipstream.server.api.protocol import ChatCompletionRequest, check_model, parse_chat_request
from slipstream.server.api.serving import GenerationCall, read_json
from slipstream.server.api.state import STATE, ServerState
from slipstream.server.engine.outputs import CompletionOutput


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    state: ServerState = request.app[STATE]
    state.check_accepting()
    req = parse_chat_request(await read_json(request))
    check_model(req.model, state.model_name)
    # Off the event loop: a long conversation takes a while to render and tokenize.
    prompt = await asyncio.to_thread(render_prompt, state.llm.tokenizer, req)
    call = ChatCall(state, req, f"chatcmpl-{uuid.uuid4().hex}")
    return await call.run(request, [prompt], req.params)


def render_prompt(tokenizer: Any, req: ChatCompletionRequest) -> list[int]:
    """Token ids of the conversation, rendered with the model's own chat template.

    Raises:
        APIError: 400 (param ``messages``) when the template refuses the conversation.
    """
    add_generation_prompt = req.add_generation_prompt is not False and not req.continue_final_message
    try:
        text = tokenizer.apply_chat_template(
            req.template_messages(), tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=bool(req.continue_final_message), **(req.chat_template_kwargs or {}))
    except Exception as exc:  # jinja2 errors raised by the template itself (e.g. role order)
        raise bad_request(f"messages could not be rendered with the model's chat template: {exc}",
                          "messages") from None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad_request(f"messages are not valid Unicode text: {exc.reason}", "messages") from None
    return tokenizer.encode(text, add_special_tokens=False)  # the template already holds BOS if any


class ChatCall(GenerationCall):
    chunk_object = "chat.completion.chunk"
    prompt_param = "messages"

    def opening_chunks(self, num_choices: int) -> list[dict]:
        """OpenAI opens each choice with the role and an empty content."""
        return [render.chat_delta(i, {"role": "assistant", "content": ""}) for i in range(num_choices)]

    def _logprobs(self, co: CompletionOutput) -> dict | None:
        if self.req.logprob_width is None or not co.logprobs:
            return None
        return render.chat_logprobs(co.logprobs, self.state.token_text)

    def deltas(self, choice: render.Choice, co: CompletionOutput) -> list[dict]:
        logprobs = self._logprobs(co)
        if not co.text and logprobs is None:
            return []
        return [render.chat_delta(choice.index, {"content": co.text}, logprobs)]

    def finish_delta(self, choice: render.Choice) -> dict:
        return render.chat_delta(choice.index, {}, finish_reason=choice.finish_reason)

    def response_body(self, choices: list[render.Choice]) -> dict:
        with_logprobs = self.req.logprob_width is not None
        return {
            "id": self.request_id, "object": "chat.completion", "created": self.created,
            "model": self.state.model_name,
            "choices": [{
                "index": c.index,
                "message": {"role": "assistant", "content": c.text, "refusal": None},
                "logprobs": render.chat_logprobs(c.logprobs, self.state.token_text) if with_logprobs else None,
                "finish_reason": c.finish_reason,
            } for c in choices],
            "usage": self.usage.body(),
        }
