"""Server-sent events as OpenAI streams them: ``data: <json>\\n\\n`` per chunk, then ``data: [DONE]``.

A stream that did not ask for usage (``stream_options.include_usage``) still ends with its usage,
in an SSE *comment* (``: {"usage": {...}}``): clients skip comment lines (the WHATWG SSE
format: a line starting with a colon is ignored), and the gateway reads the token counts there
for its tenants' counters and the autoscaler's demand."""
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

    async def comment(self, payload: dict) -> None:
        """An SSE comment line with ``payload`` as JSON (ignored by clients)."""
        await self.response.write(b": " + json_text(payload).encode() + b"\n\n")

    async def done(self) -> web.StreamResponse:
        await self.response.write(b"data: [DONE]\n\n")
        await self.response.write_eof()
        return self.response
