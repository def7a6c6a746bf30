"""``GET /v1/tokenizer/files`` and ``GET /v1/tokenizer/files/{name}``: the served model's tokenizer
as Hugging Face tokenizer files, so a gateway tokenizes prompts exactly as this server does
whatever the model source (built-in, GGUF, a checkpoint directory, ``sim:``).

The files are what ``slipstream tokenizer export`` writes (``tokenizer.json``,
``tokenizer_config.json`` with the chat template, special tokens): saved once, on the first
request, into a temporary directory the server removes when it stops. A client lists them, then
fetches each by name into one directory and loads it with ``AutoTokenizer.from_pretrained``.
``GET /v1/tokenizer/files`` answers ``{"files": ["tokenizer.json", …]}``; a name not in that list
is 404 (no path is ever built from the request). 503 while the model loads; ``--api-key`` applies.
"""
from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

from aiohttp import web

from slipstream.server.api.errors import APIError
from slipstream.server.api.state import STATE


class TokenizerFiles:
    """The tokenizer files of one app, saved lazily."""

    def __init__(self) -> None:
        self._dir: tempfile.TemporaryDirectory | None = None
        self._files: dict[str, Path] | None = None
        self._lock = asyncio.Lock()

    async def files(self, tokenizer) -> dict[str, Path]:
        """File name → path of the saved tokenizer (saved off the event loop on the first call)."""
        async with self._lock:
            if self._files is None:
                directory = tempfile.TemporaryDirectory(prefix="slipstream-tokenizer-")
                try:
                    await asyncio.to_thread(tokenizer.save_pretrained, directory.name)
                except BaseException:
                    directory.cleanup()
                    raise
                self._dir = directory
                self._files = {p.name: p for p in sorted(Path(directory.name).iterdir()) if p.is_file()}
            return self._files

    async def list(self, request: web.Request) -> web.Response:
        state = request.app[STATE]
        state.check_accepting()
        return web.json_response({"files": list(await self.files(state.llm.tokenizer))})

    async def get(self, request: web.Request) -> web.StreamResponse:
        state = request.app[STATE]
        state.check_accepting()
        name = request.match_info["name"]
        path = (await self.files(state.llm.tokenizer)).get(name)
        if path is None:
            raise APIError(404, f"The tokenizer has no file {name[:100]!r}; GET /v1/tokenizer/files lists them.",
                           param="name", code="not_found")
        return web.FileResponse(path, headers={"Content-Type": "application/octet-stream"})

    async def close(self, app: web.Application) -> None:
        """``on_cleanup``: remove the saved files."""
        if self._dir is not None:
            self._dir.cleanup()
            self._dir, self._files = None, None


def add_routes(app: web.Application) -> TokenizerFiles:
    """Serve the two routes on ``app``."""
    api = TokenizerFiles()
    app.router.add_get("/v1/tokenizer/files", api.list)
    app.router.add_get("/v1/tokenizer/files/{name}", api.get)
    app.on_cleanup.append(api.close)
    return api
