"""``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info``, as vLLM serves them.

Tools that count tokens or need the model's tokenizer (guidellm, lm-eval, aiperf) ask the server
instead of a model hub. ``/tokenize`` takes a ``prompt`` (special tokens added by default, as
``/v1/completions`` does) or chat ``messages`` (rendered with the chat template exactly as
``/v1/chat/completions`` renders them, so the count is the one a chat request will have).
"""
from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from slipstream.server.api.errors import refusal
from slipstream.server.api.protocol import DetokenizeRequest, TokenizeRequest, check_model, validate
from slipstream.server.api.serving import read_json
from slipstream.server.api.serving_chat import conversation_text
from slipstream.server.api.state import STATE, ServerState
from slipstream.server.engine.errors import InvalidRequest


async def tokenize(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE]
    state.check_accepting()
    req = validate(TokenizeRequest, await read_json(request))
    check_model(req.model, state.model_names)
    tokenizer = state.llm.tokenizer
    ids = await asyncio.to_thread(_token_ids, state, req)
    body: dict[str, Any] = {"count": len(ids), "max_model_len": state.llm.max_model_len, "tokens": ids,
                            "token_strs": tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None}
    return web.json_response(body)


def _token_ids(state: ServerState, req: TokenizeRequest) -> list[int]:
    tokenizer = state.llm.tokenizer
    if req.prompt is not None:
        return tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
    text = conversation_text(state, req, state.tool_parser if req.tools else None)
    return tokenizer.encode(text, add_special_tokens=bool(req.add_special_tokens))


async def detokenize(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE]
    state.check_accepting()
    req = validate(DetokenizeRequest, await read_json(request))
    check_model(req.model, state.model_names)
    try:
        state.llm.check_token_ids(req.tokens, "tokens")
    except InvalidRequest as exc:
        raise refusal(exc) from None
    return web.json_response({"prompt": state.llm.tokenizer.decode(req.tokens)})


async def tokenizer_info(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE]
    state.check_accepting()
    return web.json_response(describe_tokenizer(state.llm.tokenizer, state.llm.max_model_len))


def describe_tokenizer(tokenizer: Any, max_model_len: int) -> dict[str, Any]:
    """The tokenizer's configuration as ``tokenizer_config.json`` holds it (class, special tokens,
    chat template, added tokens), with the served context length as ``model_max_length``."""
    special = {name: getattr(tokenizer, name, None) for name in
               ("bos_token", "eos_token", "unk_token", "pad_token")}
    added = {str(i): {"content": t.content, "special": t.special, "lstrip": t.lstrip, "rstrip": t.rstrip,
                      "normalized": t.normalized, "single_word": t.single_word}
             for i, t in sorted(tokenizer.added_tokens_decoder.items())}
    return {"tokenizer_class": type(tokenizer).__name__, **{k: str(v) if v is not None else None
                                                             for k, v in special.items()},
            "chat_template": getattr(tokenizer, "chat_template", None), "model_max_length": max_model_len,
            "vocab_size": len(tokenizer), "added_tokens_decoder": added,
            "add_bos_token": getattr(tokenizer, "add_bos_token", None),
            "add_eos_token": getattr(tokenizer, "add_eos_token", None)}
