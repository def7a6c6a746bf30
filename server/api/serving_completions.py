"""``POST /v1/completions`` (OpenAI's legacy API): one engine request per prompt, ``n`` choices each.

With ``echo`` each choice's text starts with its prompt's text, and with ``logprobs`` the prompt's
tokens come first in the logprobs too (the first one has no logprob: nothing predicts it), as
OpenAI's legacy API and vLLM return them.
"""
from __future__ import annotations

import uuid

from aiohttp import web

from slipstream.server.api import render
from slipstream.server.api.protocol import check_model, parse_completion_request
from slipstream.server.api.serving import GenerationCall, read_json
from slipstream.server.api.state import STATE, ServerState
from slipstream.server.engine.outputs import CompletionOutput, RequestOutput


async def create_completion(request: web.Request) -> web.StreamResponse:
    state: ServerState = request.app[STATE]
    state.check_accepting()
    req = parse_completion_request(await read_json(request), vocab_size=state.vocab_size)
    check_model(req.model, state.model_name)
    call = CompletionCall(state, req, f"cmpl-{uuid.uuid4().hex}")
    return await call.run(request, req.prompts, req.params)


class CompletionCall(GenerationCall):
    chunk_object = "text_completion"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.prompt_texts: list[str] = []

    def on_first_outputs(self, outputs: list[RequestOutput]) -> None:
        if self.req.echo:  # a string prompt echoes as sent; token ids as their text
            decode = self.state.llm.tokenizer.decode
            self.prompt_texts = [p if isinstance(p, str) else decode(p) for p in self.req.prompts]

    def _echo(self, choice: render.Choice) -> str:
        """The prompt text a choice starts with, once (on its first increment)."""
        if not self.req.echo or choice.state is not None:
            return ""
        choice.state = {"text_offset": 0}
        return self.prompt_texts[choice.prompt_index]

    def deltas(self, choice: render.Choice, co: CompletionOutput) -> list[dict]:
        text = self._echo(choice) + co.text
        with_logprobs = self.req.logprobs is not None and co.logprobs
        if not text and not with_logprobs:
            return []
        logprobs = None
        if with_logprobs:
            state = choice.state if choice.state is not None else {"text_offset": 0}
            choice.state = state
            logprobs, state["text_offset"] = render.completion_logprobs(co.logprobs, self.state.token_text,
                                                                        state["text_offset"])
        return [render.completion_delta(choice.index, text, logprobs)]

    def finish_delta(self, choice: render.Choice) -> dict:
        return render.completion_delta(choice.index, "", finish_reason=choice.finish_reason)

    def response_body(self, choices: list[render.Choice]) -> dict:
        with_logprobs = self.req.logprobs is not None
        return {
            "id": self.request_id, "object": "text_completion", "created": self.created,
            "model": self.state.model_name,
            "choices": [{
                "index": c.index,
                "text": (self.prompt_texts[c.prompt_index] if self.req.echo else "") + c.text,
                "logprobs": render.completion_logprobs(c.logprobs, self.state.token_text, 0)[0]
                if with_logprobs else None,
                "finish_reason": c.finish_reason,
            } for c in choices],
            "usage": self.usage.body(),
        }
