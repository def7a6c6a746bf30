"""The request-body limit, applied to what a client declares as well as to what it sends.

aiohttp enforces ``client_max_size`` while it reads a body, so a request that declares a huge
``Content-Length`` and sends a few bytes holds its connection until the client gives up. The
server's and the gateway's error middlewares call :func:`refuse_declared_oversize` first.
"""
from __future__ import annotations

from aiohttp import web


def refuse_declared_oversize(request: web.Request) -> None:
    """Raises ``web.HTTPRequestEntityTooLarge`` (413) when the request's ``Content-Length`` header
    exceeds the app's ``client_max_size`` (bytes), before any of the body is read."""
    declared = request.content_length
    if declared is not None and declared > request.client_max_size:
        raise web.HTTPRequestEntityTooLarge(
            max_size=request.client_max_size, actual_size=declared,
            text=f"Content-Length {declared} exceeds the limit of {request.client_max_size} bytes.")
