"""``POST /v1/completions`` (OpenAI's legacy API): one engine request per prompt, ``n`` choices each.

With ``echo`` each choice's text starts with its prompt's text, and with ``logprobs`` the prompt's
tokens come first in the logprobs too (the first one has no logprob: nothing predicts it), as
OpenAI's legacy API and vLLM return them. ``echo`` with ``max_tokens: 0`` answers the prompt alone
(``finish_reason`` ``length``, ``completion_tokens`` 0), for clients that score prompts.
"""
from __future__ import annotations

import dataclasses
import uuid

from aiohttp import web

from slipstream.server.api import render
from slipstream.server.api.logprobs import CompletionLogprobs, concat_completion_logprobs, drop_hidden_stop_token, \
    vllm_prompt_logprobs
from slipstream.server.api.protocol import check_model, parse_completion_request
from slipstream.server.api.serving import GenerationCall, read_json
from slipstream.server.api.state import STATE, ServerState
from slipstream.server.engine.outputs import CompletionOutput, FinishReason, RequestOutput


async def create_completion(request: web.Request) -> web.StreamResponse:
    state: ServerState = request.app[STATE]
    state.check_accepting()
    req = parse_completion_request(await read_json(request))
    check_model(req.model, state.model_names)
    call = CompletionCall(state, req, f"cmpl-{uuid.uuid4().hex}")
    return await call.run(request, req.prompts, req.params)


class CompletionCall(GenerationCall):
    chunk_object = "text_completion"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.prompt_texts: list[str] = []
        self.prompts: list[RequestOutput] = []

    def _absorb(self, prompt_index: int, out: RequestOutput) -> list:
        if self.req.prompt_only:  # the one token the engine generated is not part of the answer
            out = dataclasses.replace(out, outputs=[
                CompletionOutput(co.index, "", [], None if co.finish_reason is None
                                 else FinishReason.ABORT.value if co.finish_reason == FinishReason.ABORT.value
                                 else FinishReason.LENGTH.value) for co in out.outputs])
        return super()._absorb(prompt_index, out)

    def on_first_outputs(self, outputs: list[RequestOutput]) -> None:
        self.prompts = outputs  # prompt token ids and, when asked, their logprobs
        if self.req.echo:  # a string prompt echoes as sent; token ids as their text
            decode = self.state.llm.tokenizer.decode
            self.prompt_texts = [p if isinstance(p, str) else decode(p) for p in self.req.prompts]

    def _start(self, choice: render.Choice) -> tuple[str, dict | None]:
        """A choice's opening: its echoed prompt text and that text's logprobs fragment (once)."""
        if choice.state is not None:
            return "", None
        choice.state = CompletionLogprobs(self.state.token_bytes, self.req.params.skip_special_tokens)
        if not self.req.echo:
            return "", None
        text = self.prompt_texts[choice.prompt_index]
        if self.req.logprobs is None:
            return text, None
        prompt = self.prompts[choice.prompt_index]
        return text, choice.state.add_prompt(prompt.prompt_token_ids, prompt.prompt_logprobs or [], text)

    def _entries(self, logprobs: list, finish_reason: str | None, stop_reason: str | int | None) -> list:
        """Without a stop token the text leaves out — except with ``echo``: log-likelihood clients
        (lm-eval) read ``token_logprobs[len(prompt):-1]`` and count on one entry per generated token,
        as OpenAI's legacy API and vLLM give them."""
        if self.req.echo:
            return logprobs
        return drop_hidden_stop_token(logprobs, finish_reason, stop_reason, self.state.token_bytes,
                                      self.req.params.skip_special_tokens)

    def deltas(self, choice: render.Choice, co: CompletionOutput) -> list[dict]:
        first = choice.state is None
        echoed, fragment = self._start(choice)
        text = echoed + co.text
        with_logprobs = self.req.logprobs is not None
        with_prompt_logprobs = first and self.req.prompt_logprobs is not None
        if not text and not (with_logprobs and co.logprobs) and not with_prompt_logprobs:
            return []
        logprobs = None
        if with_logprobs:
            entries = self._entries(co.logprobs or [], co.finish_reason, co.stop_reason)
            fragments = ([fragment] if fragment else []) + [choice.state.add(entries, co.text)]
            logprobs = concat_completion_logprobs(fragments)
        delta = render.completion_delta(choice.index, text, logprobs)
        if with_prompt_logprobs:  # vLLM sends them with the choice's first chunk
            delta["prompt_logprobs"] = self._prompt_logprobs(choice)
        return [delta]

    def finish_delta(self, choice: render.Choice) -> dict:
        return render.completion_delta(choice.index, "", finish_reason=choice.finish_reason)

    def _choice_body(self, choice: render.Choice) -> dict:
        echoed, fragment = self._start(choice)
        logprobs = None
        if self.req.logprobs is not None:
            entries = self._entries(choice.logprobs, choice.finish_reason, choice.stop_reason)
            logprobs = concat_completion_logprobs(([fragment] if fragment else [])
                                                  + [choice.state.add(entries, choice.text)])
        body = {"index": choice.index, "text": echoed + choice.text, "logprobs": logprobs,
                "finish_reason": choice.finish_reason}
        if self.req.prompt_logprobs is not None:
            body["prompt_logprobs"] = self._prompt_logprobs(choice)
        return body

    def _prompt_logprobs(self, choice: render.Choice) -> list[dict | None]:
        prompt = self.prompts[choice.prompt_index]
        return vllm_prompt_logprobs(prompt.prompt_token_ids, prompt.prompt_logprobs or [], self.state.token_bytes)

    def response_body(self, choices: list[render.Choice]) -> dict:
        return {"id": self.request_id, "object": "text_completion", "created": self.created,
                "model": self.state.model_name, "choices": [self._choice_body(c) for c in choices],
                "usage": self.usage.body()}
