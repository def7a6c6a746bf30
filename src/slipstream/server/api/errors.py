"""OpenAI-shaped errors: every failure leaves the server as ``{"error": {message, type, param, code}}``."""
from __future__ import annotations

from aiohttp import web

from slipstream.server.engine.errors import InvalidRequest
from slipstream.server.openai_error import error_body, http_error_parts


class APIError(Exception):
    """A request that fails with ``status``; ``param`` names the offending field, ``code`` is
    machine-readable; ``close``: the response says ``Connection: close`` and the connection ends."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None, close: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}
        self.close = close
        self.source: InvalidRequest | None = None  # the engine's refusal this reports, if any

    def renamed(self, param: str | None) -> APIError:
        """This error under another name for its field: the engine's refusal, renamed, where it
        reports one (so the message names the field as the request does), else only ``param``."""
        if self.source is not None and param is not None:
            return refusal(self.source, param)
        self.param = param
        return self

    def body(self) -> dict:
        return error_body(self.status, self.message, param=self.param, code=self.code)

    def response(self) -> web.Response:
        response = web.json_response(self.body(), status=self.status, headers=self.headers)
        if self.close:
            response.force_close()
        return response


def refusal(exc: InvalidRequest, param: str | None = None) -> APIError:
    """The 400 for an engine (or SamplingParams) refusal, its field reported as ``param`` (the
    request's name for it) when given, else as the engine names it; ``code`` kept."""
    if param is not None and param != exc.param:
        exc = exc.renamed(param)
    error = APIError(400, str(exc), param=exc.param, code=exc.code)
    error.source = exc
    return error


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def served_routes(router: web.UrlDispatcher) -> list[str]:
    """Every route ``router`` serves, as ``METHOD /path`` (HEAD, which aiohttp adds to each GET, left out)."""
    return sorted({f"{route.method} {route.resource.canonical}" for route in router.routes()
                   if route.method != "HEAD" and route.resource is not None}, key=lambda r: (r.split()[1], r))


def from_http_exception(exc: web.HTTPException, routes: list[str] = ()) -> APIError:
    """aiohttp's own errors (unknown path, wrong method, body too large, ...) as JSON errors; a 404
    lists ``routes`` (:func:`served_routes` of the app)."""
    status = exc.status
    if status == 404:
        return APIError(404, f"Not found: no such route. This server serves: {', '.join(routes)}.",
                        code="not_found")
    if status == 405:
        allowed = ", ".join(sorted(getattr(exc, "allowed_methods", ()) or ()))
        return APIError(405, f"Method {exc.method if hasattr(exc, 'method') else ''} not allowed here; "
                        f"allowed: {allowed}.", code="method_not_allowed", headers={"Allow": allowed})
    if status in (413, 415):  # a body past the limit, or in a coding not decoded here
        message, code, headers = http_error_parts(exc)
        return APIError(status, message, code=code, headers=headers)
    return APIError(status, exc.reason or exc.text or "HTTP error", code=None)
