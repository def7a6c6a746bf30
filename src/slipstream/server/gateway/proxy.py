"""Forwarding one request: route, hold it while no endpoint can take it, send, relay the answer.

A request's path through the gateway:

1. Read the body (bounded by ``max_request_bytes``) and build a :class:`RouteRequest` from it
   (the prompt's block hashes for the prefix policies, a session key) for the inference paths;
   every other path goes to the least-loaded endpoint.
2. A tenant past its tokens-per-minute limit (``--tenant-token-limits``) gets 429 with the
   ``Retry-After`` of its bucket (:mod:`.token_limits`); else its estimated prompt is charged.
3. Take a slot (:meth:`WaitQueue.acquire`): at once, or after waiting in the gateway's queue
   until the request's deadline (429 when the queue is full or a sheddable request finds every
   pod busy, 503 past the deadline); waiting requests are served by criticality, then fairly
   between tenants (the ``x-gateway-inference-fairness-id`` header, forwarded to the pods too).
4. Send it with the client's end-to-end headers (``Authorization`` included: the pods enforce
   their ``--api-key``) and a request id. A connection error or a 503 before the first response
   byte moves it to another endpoint (that one excluded, at most ``max_tries`` endpoints), and so
   does a 429 (that pod's own queue is full); once a byte went to the client it is never sent
   again.
5. Relay the response chunk by chunk as it arrives; each write waits for the client (backpressure
   reaches the pod through TCP). A pod that fails mid-stream ends an event stream with an
   OpenAI-shaped error event; a client that goes away closes the upstream connection, so the pod
   aborts the request and frees its KV blocks.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from slipstream.api_types.tenancy import (CRITICALITIES, CRITICALITY_HEADER, DEFAULT_CRITICALITY, DEFAULT_TENANT,
                                          FAIRNESS_ID_HEADER, USAGE_HEADER, tenant_of)
from slipstream.server.openai_error import error_body

from .config import GatewayConfig
from .endpoints import DEFAULT_BLOCK_SIZE, EndpointSet
from .metrics import GatewayMetrics
from .routing import Choice, RouteRequest, Router
from .token_limits import TokenLimits
from .usage import TAIL_BYTES, usage_header, usage_tokens
from .wait_queue import DeadlineExceeded, QueueFull, Shed, WaitQueue

log = logging.getLogger("slipstream.gateway")

# Paths whose POST bodies are routed by the configured policy; all others go least-loaded.
ROUTED_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})
HASHED_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
# RFC 9110 §7.6.1: meaningful for one connection only, never forwarded.
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
                        "trailer", "trailers", "transfer-encoding", "upgrade", "proxy-connection"})
REQUEST_ID = "X-Request-Id"
SESSION_ID = "X-Session-Id"
_UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError)
CLIENT_CLOSED = 499  # the requests counter's code for a client that left before its answer (nginx's)


def error_response(status: int, message: str, *, code: str | None = None,
                   headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(error_body(status, message, code=code), status=status, headers=headers)


def _forward_headers(request: web.Request, request_id: str) -> CIMultiDict:
    """The client's end-to-end headers for the pod: hop-by-hop ones (and those the Connection
    header names), Host, Content-Length and Content-Encoding dropped (the body is forwarded as
    aiohttp read it, decoded); the request id and X-Forwarded-For added."""
    named = {h.strip().lower() for h in request.headers.get("Connection", "").split(",") if h.strip()}
    headers = [(k, v) for k, v in request.headers.items()
               if k.lower() not in HOP_BY_HOP and k.lower() not in named
               and k.lower() not in ("host", "content-length", "content-encoding", "x-request-id")]
    headers.append((REQUEST_ID, request_id))
    peer = request.remote
    if peer:
        prior = request.headers.get("X-Forwarded-For")
        headers = [(k, v) for k, v in headers if k.lower() != "x-forwarded-for"]
        headers.append(("X-Forwarded-For", f"{prior}, {peer}" if prior else peer))
    return CIMultiDict(headers)


def _output_cap(payload: dict) -> int:
    """Tokens a request may generate at most, as it says (``max_tokens``, chat's
    ``max_completion_tokens``, the Responses API's ``max_output_tokens``, times ``n`` and times
    the prompts of a completions request's list); 0 when it does not say (the pod's default
    applies) or says something the pod will refuse."""
    cap = next((v for k in ("max_completion_tokens", "max_tokens", "max_output_tokens")
                if isinstance(v := payload.get(k), int) and not isinstance(v, bool) and v > 0), 0)
    n = payload.get("n")
    return cap * (n if isinstance(n, int) and not isinstance(n, bool) and 0 < n <= 128 else 1) * _prompts(payload)


def _prompts(payload: dict) -> int:
    """How many prompts ``prompt`` holds: a list of strings or of token-id lists is one each (the
    pod generates for every one); anything else counts as one."""
    prompt = payload.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return len(prompt)
    return 1


def _session_key(request: web.Request, payload: dict) -> str | None:
    """The session for affinity: the X-Session-Id header, else ``prompt_cache_key``, else ``user``."""
    for value in (request.headers.get(SESSION_ID), payload.get("prompt_cache_key"), payload.get("user")):
        if isinstance(value, str) and value:
            return value
    return None


class Proxy:
    """Forwards requests to the endpoints of ``endpoints`` chosen by ``router``, holding them in
    ``queue`` while none can take them.

    hasher: a ``PromptHasher`` (``block_hashes(path, body, endpoint_url, block_size)``) or None
    (then every request routes by load and session only).
    """

    def __init__(self, config: GatewayConfig, endpoints: EndpointSet, queue: WaitQueue, router: Router,
                 session: aiohttp.ClientSession, metrics: GatewayMetrics, hasher: Any = None):
        self.config = config
        self.endpoints = endpoints
        self.queue = queue
        self.router = router
        self.fallback = Router("least-loaded")
        self.session = session
        self.metrics = metrics
        self.hasher = hasher
        self._hashing = hasher is not None and router.reads_prompt_blocks
        self.token_limits = TokenLimits(config.tenant_token_limits)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        start = time.monotonic()
        request_id = request.headers.get(REQUEST_ID) or uuid.uuid4().hex
        code = CLIENT_CLOSED  # unless an answer comes back: the client left (its handler was cancelled)
        try:
            response = await self._handle(request, request_id, start)
            code = response.status
            return response
        finally:
            # every request counts, the ones whose client left too: the autoscaler's arrivals
            self.metrics.requests.labels(str(code)).inc()

    async def _handle(self, request: web.Request, request_id: str, start: float) -> web.StreamResponse:
        body = await request.read()  # bounded by client_max_size (413 past it)
        route, router, output_cap = await self._route_request(request, body)
        headers = _forward_headers(request, request_id)
        try:
            tenant = tenant_of(request.headers.get(FAIRNESS_ID_HEADER))
        except ValueError as exc:
            return self._reject(400, "invalid_tenant", request_id, f"{exc}.")
        criticality = (request.headers.get(CRITICALITY_HEADER) or "").strip().lower() or DEFAULT_CRITICALITY
        if criticality not in CRITICALITIES:
            return self._reject(400, "invalid_criticality", request_id,
                                f"The {CRITICALITY_HEADER} header must be one of {', '.join(CRITICALITIES)}, "
                                f"got {criticality!r}.")
        # The prompt's size for the tenant's share, before the pod counts it: its hashed blocks, else
        # about 4 bytes of body per token.
        prompt_tokens = len(route.block_hashes) * self._block_size() if route.block_hashes else len(body) // 4
        charged = 0  # tokens reserved from the tenant's token limit, given back unless it is served
        if self.token_limits and request.method == "POST" and request.path in ROUTED_PATHS:
            wait = self.token_limits.retry_after(tenant, time.monotonic())
            if wait is not None:
                self.queue.count_refusal(tenant)
                return self._reject(429, "token_limit", request_id,
                                    f"Tenant {tenant!r} used its {self.token_limits.limits[tenant]} tokens a minute; "
                                    f"retry after {wait}s.", retry_after=wait)
            # Reserved: the prompt and all the request may generate (the usage replaces it at the end),
            # so a burst sent at once cannot run far past the limit before any response ends.
            charged = max(1, prompt_tokens + output_cap)
            self.token_limits.charge(tenant, charged, time.monotonic())
        return await self._send(request, request_id, start, body, route, router, headers, tenant, criticality,
                                prompt_tokens, charged, output_cap)

    async def _send(self, request: web.Request, request_id: str, start: float, body: bytes, route: RouteRequest,
                    router: Router, headers: CIMultiDict, tenant: str, criticality: str, prompt_tokens: int,
                    charged: int, output_cap: int) -> web.StreamResponse:
        """Steps 3–5 of the module docstring; ``charged``: tokens reserved from the token limit
        (``output_cap`` of them for the output), given back when the request is not served."""
        deadline = start + self.config.queue_timeout

        def refuse(status: int, reason: str, message: str) -> web.Response:
            self.token_limits.charge(tenant, -charged, time.monotonic())
            return self._reject(status, reason, request_id, message)

        tried: list[str] = []
        last_error = ""
        for attempt in range(self.config.max_tries):
            try:
                choice = await self.queue.acquire(lambda loads: router.pick(route, loads), deadline, tried,
                                                  tenant=tenant, criticality=criticality,
                                                  prompt_tokens=prompt_tokens if attempt == 0 else 0)
            except Shed:
                return refuse(429, "shed", "Every model server is busy and the request is sheddable "
                              f"({CRITICALITY_HEADER}: sheddable); retry after a while.")
            except QueueFull:
                return refuse(429, "queue_full", f"The gateway holds {self.config.max_queue} requests waiting for a "
                              "model server already; retry after a while.")
            except DeadlineExceeded:
                return refuse(503, "deadline", f"No model server could take the request within "
                              f"{self.config.queue_timeout:g}s (none ready, or all at their limit); retry after a while.")
            except asyncio.CancelledError:  # the client went away while waiting: nothing served
                self.token_limits.charge(tenant, -charged, time.monotonic())
                raise
            if attempt == 0:
                self.metrics.queue_time.observe(time.monotonic() - start)
            self._count_decision(router, route, choice)
            try:
                upstream = await self.session.request(
                    request.method, URL(choice.endpoint + request.raw_path, encoded=True), headers=headers,
                    data=body if body else None, allow_redirects=False)
            except _UPSTREAM_ERRORS as exc:
                self.queue.release(choice.endpoint, tenant)
                self.endpoints.mark_unready(choice.endpoint, "connection failed")
                last_error = f"{choice.endpoint}: {exc!r}"
                log.warning("request %s: %s failed before the response (%r); trying another endpoint",
                            request_id, choice.endpoint, exc)
                tried.append(choice.endpoint)
                self.metrics.retries.labels("connection").inc()
                continue
            except BaseException:  # cancelled (the client went away) while connecting
                self.queue.release(choice.endpoint, tenant)
                self.token_limits.charge(tenant, -charged, time.monotonic())
                raise
            if upstream.status == 503 and attempt + 1 < self.config.max_tries:
                upstream.release()
                self.queue.release(choice.endpoint, tenant)
                self.endpoints.mark_unready(choice.endpoint, "answered 503")
                log.info("request %s: %s answered 503; trying another endpoint", request_id, choice.endpoint)
                tried.append(choice.endpoint)
                self.metrics.retries.labels("unavailable").inc()
                continue
            if upstream.status == 429 and attempt + 1 < self.config.max_tries:
                # the pod's own queue is full (requests from another gateway replica, or n > 1
                # sequences each): another pod may take it; the last 429 goes to the client
                upstream.release()
                self.queue.release(choice.endpoint, tenant)
                log.info("request %s: %s answered 429; trying another endpoint", request_id, choice.endpoint)
                tried.append(choice.endpoint)
                self.metrics.retries.labels("busy").inc()
                continue
            try:
                if upstream.status < 400:
                    router.record(route, choice)
                return await self._relay(request, upstream, request_id, start, tenant, charged,
                                         output_cap if charged else 0)
            finally:
                upstream.close()  # no-op once released; else the pod sees the connection go and aborts
                self.queue.release(choice.endpoint, tenant)
        return refuse(502, "upstream_failed", f"No model server answered after {self.config.max_tries} tries "
                      f"(last: {last_error}); retry the request.")

    async def _route_request(self, request: web.Request, body: bytes) -> tuple[RouteRequest, Router, int]:
        """The routing input, the router, and the most tokens the request asks to generate (0:
        not said, or not an inference request)."""
        if request.method != "POST" or request.path not in ROUTED_PATHS:
            return RouteRequest(), self.fallback, 0
        try:
            payload = json.loads(body)
        except (ValueError, RecursionError):  # RecursionError: nested too deeply for the parser
            payload = None
        if not isinstance(payload, dict):  # the pod answers the 400
            return RouteRequest(session=request.headers.get(SESSION_ID) or None), self.router, 0
        hashes: tuple[bytes, ...] = ()
        if self._hashing and request.path in HASHED_PATHS:
            reference = self._reference_endpoint()
            if reference is not None:
                try:
                    hashes = tuple(await self.hasher.block_hashes(request.path, payload, reference.name,
                                                                  reference.block_size))
                except Exception:  # routing by load alone is still right, only less cache-friendly
                    log.exception("hashing the prompt failed; routing by load")
        return RouteRequest(hashes, _session_key(request, payload)), self.router, _output_cap(payload)

    def _reference_endpoint(self):
        """The routable endpoint whose tokenizer and block size stand for all (the first by name)."""
        return min(self.endpoints.routable_endpoints(), key=lambda e: e.name, default=None)

    def _block_size(self) -> int:
        reference = self._reference_endpoint()
        return reference.block_size if reference is not None else DEFAULT_BLOCK_SIZE

    def _count_decision(self, router: Router, route: RouteRequest, choice: Choice) -> None:
        self.metrics.decisions.labels(router.policy, choice.reason).inc()
        if route.block_hashes:
            self.metrics.prefix_blocks_requested.inc(len(route.block_hashes))
            self.metrics.prefix_blocks_matched.inc(choice.matched_blocks)

    def _reject(self, status: int, reason: str, request_id: str, message: str,
                retry_after: int | None = None) -> web.Response:
        self.metrics.rejections.labels(reason).inc()
        log.info("request %s rejected (%d, %s)", request_id, status, reason)
        headers = {REQUEST_ID: request_id}
        if status in (429, 503):
            headers["Retry-After"] = str(self.config.retry_after if retry_after is None else retry_after)
        return error_response(status, message, code=reason, headers=headers)

    async def _relay(self, request: web.Request, upstream: aiohttp.ClientResponse, request_id: str,
                     start: float, tenant: str = DEFAULT_TENANT, charged: int = 0,
                     output_cap: int = 0) -> web.StreamResponse:
        """Copy ``upstream``'s status, end-to-end headers and body to the client as it arrives;
        the output tokens its usage reports are charged to ``tenant``. Its token limit was
        reserved ``charged`` tokens (``output_cap`` of them for the output): the usage replaces
        them; after an error status they are given back; a stream cut short (the client left, the
        pod failed) is charged the events it relayed, about one token each, in place of
        ``output_cap``, and so is its tenant's fair share; a body cut short whose usage header
        came is charged that usage; a response without usage keeps the reservation."""
        response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
        for key, value in upstream.headers.items():
            if key.lower() not in HOP_BY_HOP and key.lower() not in ("content-length", "x-request-id"):
                response.headers.add(key, value)
        response.headers[REQUEST_ID] = request_id
        event_stream = upstream.content_type == "text/event-stream"
        if upstream.content_length is not None and not event_stream:
            response.content_length = upstream.content_length
        first, settled = True, False
        tail = b""  # the body's end, where the usage object is (the demand counters)
        events = 0  # SSE data events relayed
        try:
            await response.prepare(request)
            while True:
                try:
                    chunk = await upstream.content.readany()
                except _UPSTREAM_ERRORS as exc:
                    self.metrics.stream_errors.inc()
                    log.warning("request %s: %s failed mid-response (%r)", request_id, upstream.url.origin(), exc)
                    if event_stream:  # the client's SSE parser reads this as an API error, not a hang
                        message = "The model server failed while streaming the response; retry the request."
                        event = error_body(502, message, code="upstream_failed")
                        await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")
                        await response.write_eof()
                    elif request.transport is not None:  # a truncated body must not look complete
                        request.transport.close()
                    return response
                if not chunk:
                    break
                if first:
                    first = False
                    self.metrics.ttft.observe(time.monotonic() - start)
                tail = (tail + chunk)[-TAIL_BYTES:]
                events += chunk.count(b"data: ")
                await response.write(chunk)
            upstream.release()
            await response.write_eof()
            self.metrics.e2e.observe(time.monotonic() - start)
            settled = True
            tokens = None
            if upstream.status < 400:
                tokens = usage_header(upstream.headers.get(USAGE_HEADER)) or usage_tokens(tail)
            if tokens is not None:
                self.metrics.prompt_tokens.inc(tokens[0])
                self.metrics.generation_tokens.inc(tokens[1])
                self.queue.charge_output(tenant, tokens[1])
                self.token_limits.charge(tenant, sum(tokens) - charged, time.monotonic())
            elif upstream.status >= 400:
                self.token_limits.charge(tenant, -charged, time.monotonic())
            return response
        except ConnectionResetError:  # the client left while a chunk was written to it
            log.info("request %s: the client left during the response", request_id)
            return response  # aiohttp finishes a response whose connection is gone quietly
        finally:
            if not settled and upstream.status < 400:
                # cut short: a body not streamed was generated whole (its usage header says how
                # much); of a stream, each event relayed is about one token the tenant got
                tokens = usage_header(upstream.headers.get(USAGE_HEADER))
                self.queue.charge_output(tenant, tokens[1] if tokens else events)
                if charged:
                    used = sum(tokens) if tokens else charged - output_cap + events
                    self.token_limits.charge(tenant, used - charged, time.monotonic())
