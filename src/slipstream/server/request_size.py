"""The request-body limit, applied to what a client declares as well as to what it sends.

aiohttp enforces ``client_max_size`` while it reads a body, so a request that declares a huge
``Content-Length`` and sends a few bytes held its connection until the client gave up, and one
that sent ``Expect: 100-continue`` was told to upload before being refused. The server's and the
gateway's error middlewares call :func:`refuse_declared_oversize` first, and their POST routes
answer ``Expect`` with :func:`continue_within_limit`.
"""
from __future__ import annotations

from aiohttp import web
from aiohttp.http import HttpVersion11

TOO_LARGE_CODE = "request_too_large"  # the 413's error code, server and gateway


def too_large_message(exc: web.HTTPRequestEntityTooLarge) -> str:
    """The 413's message, the same from the server and the gateway, for a body declared past the
    limit (:func:`refuse_declared_oversize`'s text) or read past it (aiohttp's)."""
    return f"Request body too large: {(exc.text or exc.reason).rstrip('.')}. Send a smaller request."


def declared_oversize(request: web.Request) -> bool:
    """Whether the ``Content-Length`` header (bytes) exceeds the app's ``client_max_size``."""
    declared = request.content_length
    return declared is not None and declared > request.client_max_size


def refuse_declared_oversize(request: web.Request) -> None:
    """Raises ``web.HTTPRequestEntityTooLarge`` (413) when the request's ``Content-Length`` header
    exceeds the app's ``client_max_size`` (bytes), before any of the body is read."""
    if declared_oversize(request):
        raise web.HTTPRequestEntityTooLarge(
            max_size=request.client_max_size, actual_size=request.content_length,
            text=f"Content-Length {request.content_length} exceeds the limit of {request.client_max_size} bytes.")


async def continue_within_limit(request: web.Request) -> None:
    """A route's ``expect_handler``: ``100 Continue`` as aiohttp's default sends it, except to a
    request declaring a body past the limit, which gets no 100 and then the middleware's 413
    (RFC 9110 §10.1.1: a server may answer with a final status instead of 100). Expectations other
    than 100-continue are ignored, as the RFC allows."""
    if (request.version == HttpVersion11 and request.headers.get("Expect", "").lower() == "100-continue"
            and not declared_oversize(request)):
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the 100 is not part of the response that follows
