"""The block hashes of a request's prompt, as the pod's engine will name its KV blocks.

The gateway fetches the model's tokenizer from a ready pod (``GET /v1/tokenizer/files``, then
each file), loads it with ``AutoTokenizer``, and turns an OpenAI request body into the token ids
the pod will see: ``/v1/completions`` encodes a string prompt with the tokenizer's special tokens
(as the engine does) or takes token ids as they are; ``/v1/chat/completions`` renders the
messages with the model's chat template by the same function the server uses
(:mod:`slipstream.server.chat_template`) and encodes without special tokens. The ids' full blocks
are then hashed with the engine's chained block hash (:mod:`slipstream.server.kv_hash`).

Not hashed (``()``, so routing falls back to load): chat requests whose tools the server would
put in the prompt (``tools`` with ``tool_choice`` other than ``none``) or with tool turns — the
server renders those in its ``--tool-call-parser`` format, which the gateway does not know —,
other paths, and bodies the server would reject.
"""
from __future__ import annotations

import asyncio
import logging
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp

from slipstream.server.chat_template import render_template, template_messages
from slipstream.server.kv_hash import prompt_block_hashes

log = logging.getLogger("slipstream.gateway")

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
FILES_PATH = "/v1/tokenizer/files"


class PromptHasher:
    """Hashes prompts with the model's tokenizer, fetched once from a pod.

    Args:
        session: the HTTP session to fetch the tokenizer with (not closed by :meth:`close`).
        max_blocks: most leading blocks hashed per prompt (routing compares prefixes; a longer
            tail changes little and costs hashing time).
        headers: sent with the tokenizer requests (e.g. ``{"Authorization": "Bearer KEY"}`` for
            pods started with ``--api-key``; a caller may instead pass the client's header).
        retry_seconds: after a failed load, calls return ``()`` for this long before trying again.
        timeout: seconds for fetching the tokenizer files.

    One hasher serves one model: every endpoint of a service serves the same tokenizer.
    """

    def __init__(self, session: aiohttp.ClientSession, *, max_blocks: int = 512,
                 headers: Mapping[str, str] | None = None, retry_seconds: float = 10.0, timeout: float = 30.0):
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be at least 1, got {max_blocks}")
        self.session = session
        self.max_blocks = max_blocks
        self.headers = dict(headers or {})
        self.retry_seconds = retry_seconds
        self.timeout = timeout
        self.tokenizer: Any = None
        self._loading: asyncio.Task | None = None
        self._failed_at: float | None = None
        self._encode_lock = threading.Lock()  # a fast tokenizer is not safe to call from two threads at once

    async def block_hashes(self, path: str, body: dict, endpoint_url: str, block_size: int) -> tuple[bytes, ...]:
        """Hashes of the prompt's full blocks (at most ``max_blocks``), each 16 bytes, for a
        ``/v1/chat/completions`` or ``/v1/completions`` body; for a batch of prompts, the
        first's. ``()`` when the body is not hashable (see the module docstring) or the
        tokenizer is not available. The first call loads the tokenizer from ``endpoint_url``
        (a pod's base URL; concurrent callers wait for the same load); tokenizing runs in a
        worker thread. Never raises (but for cancellation)."""
        try:
            if block_size < 1 or not isinstance(body, dict):
                return ()
            if path == COMPLETIONS_PATH:
                prompt = _first_prompt(body.get("prompt"))
                if isinstance(prompt, list):  # token ids: no tokenizer needed
                    return tuple(prompt_block_hashes(prompt, block_size, self.max_blocks))
                if not isinstance(prompt, str):
                    return ()
            elif path != CHAT_PATH or not _chat_hashable(body):
                return ()
            tokenizer = await self._ensure_tokenizer(endpoint_url)
            if tokenizer is None:
                return ()
            return await asyncio.to_thread(self._hash, tokenizer, path, body, block_size)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a body the server would reject: route it without a prefix
            log.debug("cannot hash a %s prompt: %s: %s", path, type(exc).__name__, exc)
            return ()

    def token_ids(self, tokenizer: Any, path: str, body: dict) -> list[int]:
        """The token ids a pod computes for ``body`` (blocking; raises for a body it cannot render)."""
        if path == COMPLETIONS_PATH:
            prompt = _first_prompt(body.get("prompt"))
            if isinstance(prompt, list):
                return prompt
            with self._encode_lock:
                return tokenizer.encode(prompt, add_special_tokens=True)
        continue_final = bool(body.get("continue_final_message"))
        text = render_template(tokenizer, template_messages(body["messages"]), tools=None,
                               add_generation_prompt=body.get("add_generation_prompt") is not False
                               and not continue_final,
                               continue_final_message=continue_final,
                               chat_template_kwargs=body.get("chat_template_kwargs"))
        with self._encode_lock:
            return tokenizer.encode(text, add_special_tokens=False)

    async def close(self) -> None:
        """Stop a load in progress."""
        if self._loading is not None and not self._loading.done():
            self._loading.cancel()
            await asyncio.gather(self._loading, return_exceptions=True)

    # --- internals ----------------------------------------------------------------------------
    def _hash(self, tokenizer: Any, path: str, body: dict, block_size: int) -> tuple[bytes, ...]:
        ids = self.token_ids(tokenizer, path, body)
        return tuple(prompt_block_hashes(ids, block_size, self.max_blocks))

    async def _ensure_tokenizer(self, endpoint_url: str) -> Any:
        if self.tokenizer is not None:
            return self.tokenizer
        if self._loading is None:
            if self._failed_at is not None and time.monotonic() - self._failed_at < self.retry_seconds:
                return None
            self._loading = asyncio.get_running_loop().create_task(self._load(endpoint_url.rstrip("/")))
        loading = self._loading
        try:
            self.tokenizer = await asyncio.shield(loading)  # one caller's cancellation must not stop the load
        except asyncio.CancelledError:
            if loading.cancelled() and self._loading is loading:
                self._loading = None
            raise
        except Exception as exc:
            if self._loading is loading:
                log.warning("could not load the tokenizer from %s: %s: %s", endpoint_url, type(exc).__name__, exc)
                self._failed_at = time.monotonic()
                self._loading = None
            return None
        return self.tokenizer

    async def _load(self, base_url: str) -> Any:
        """Fetch every tokenizer file of the pod into a temporary directory and load it there.
        Raises aiohttp.ClientError / ValueError when the pod does not serve a loadable one."""
        timeout = aiohttp.ClientTimeout(total=self.timeout)
        async with self.session.get(base_url + FILES_PATH, headers=self.headers, timeout=timeout) as resp:
            if resp.status != 200:
                raise ValueError(f"GET {FILES_PATH} answered {resp.status}")
            names = (await resp.json())["files"]
        if not isinstance(names, list) or not all(_safe_name(n) for n in names):
            raise ValueError(f"GET {FILES_PATH} listed unusable file names: {names!r:.200}")
        files: dict[str, bytes] = {}
        for name in names:
            async with self.session.get(f"{base_url}{FILES_PATH}/{quote(name)}", headers=self.headers,
                                        timeout=timeout) as resp:
                if resp.status != 200:
                    raise ValueError(f"GET {FILES_PATH}/{name} answered {resp.status}")
                files[name] = await resp.read()
        tokenizer = await asyncio.to_thread(_load_tokenizer, files)
        log.info("loaded the tokenizer from %s (%d files, %d tokens)", base_url, len(names), len(tokenizer))
        return tokenizer


def _load_tokenizer(files: dict[str, bytes]) -> Any:
    """A tokenizer from its files (name → contents), written to a temporary directory that is
    removed once loaded. Blocking (seconds: imports transformers the first time)."""
    from transformers import AutoTokenizer  # heavy: imported when first needed, off the event loop

    with tempfile.TemporaryDirectory(prefix="slipstream-gateway-tokenizer-") as directory:
        for name, data in files.items():
            (Path(directory) / name).write_bytes(data)
        return AutoTokenizer.from_pretrained(directory)


def _safe_name(name: Any) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name


def _first_prompt(prompt: Any) -> str | list[int] | None:
    """A completions ``prompt``'s first prompt: a string, or token ids; None when malformed."""
    if isinstance(prompt, str):
        return prompt or None
    if isinstance(prompt, list) and prompt:
        if all(_is_id(t) for t in prompt):
            return prompt
        first = prompt[0]
        if isinstance(first, str):
            return first or None
        if isinstance(first, list) and first and all(_is_id(t) for t in first):
            return first
    return None


def _is_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def _chat_hashable(body: dict) -> bool:
    """Whether the gateway renders this chat body as the server does (no tools in the prompt)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return False
    tool_choice = body.get("tool_choice")
    if body.get("tools") and (tool_choice if tool_choice is not None else "auto") != "none":
        return False
    return not any(not isinstance(m, dict) or m.get("role") == "tool" or m.get("tool_calls") for m in messages)
