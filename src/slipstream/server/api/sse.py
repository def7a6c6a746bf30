"""Server-sent events as OpenAI streams them: ``data: <json>\\n\\n`` per chunk, then ``data: [DONE]``."""
from __future__ import annotations

from aiohttp import web

from .render import json_text


class SSEStream:
    """One ``text/event-stream`` response. Writing to a client that has gone raises ``ConnectionError``."""

    def __init__(self, request: web.Request) -> None:
        self._request = request
        self.response = web.StreamResponse(status=200, headers={
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",  # proxies (nginx) must not hold chunks back
        })

    async def open(self) -> None:
        self.response.enable_chunked_encoding()
        await self.response.prepare(self._request)

    async def send(self, payload: dict) -> None:
        await self.response.write(b"data: " + json_text(payload).encode() + b"\n\n")

    async def done(self) -> web.StreamResponse:
        await self.response.write(b"data: [DONE]\n\n")
        await self.response.write_eof()
        return self.response
