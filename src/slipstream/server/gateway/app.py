"""The gateway's aiohttp application: its own probes and metrics, every other path proxied.

``/health`` answers from the first moment; ``/ready`` once the gateway has started, with or
without endpoints (scale from zero needs the gateway Ready while no pod exists: requests wait
in it until one does). ``/metrics`` is the gateway's own (:mod:`.metrics`); the pods' metrics stay
on the pods.
"""
from __future__ import annotations

import asyncio
import logging
import signal

import aiohttp
from aiohttp import web

from slipstream.server.content_coding import refuse_undecodable_coding
from slipstream.server.openai_error import http_error_parts
from slipstream.server.parse_errors import PAYLOAD_ERROR_CODE, payload_error_message
from slipstream.server.request_size import continue_within_limit, refuse_declared_oversize

from .config import GatewayConfig
from .endpoints import EndpointSet
from .endpointslices import EndpointSliceWatcher
from .kv_events import KVEventSubscriber
from .load import LoadScraper
from .metrics import CONTENT_TYPE, GatewayMetrics
from .proxy import REQUEST_ID, Proxy, error_response
from .routing import BlockIndex, Router
from .wait_queue import WaitQueue
from .tokenize import PromptHasher

log = logging.getLogger("slipstream.gateway")

GATEWAY = web.AppKey("gateway", object)
_OWN_PATHS = ("/health", "/ready", "/metrics")


class Gateway:
    """Everything one gateway process holds; built by :func:`build_app`, started on app startup."""

    def __init__(self, config: GatewayConfig):
        self.config = config
        self.endpoints = EndpointSet(config)
        self.queue = WaitQueue(self.endpoints, tenant_weights=config.tenant_weights,
                               fair=config.scheduling_policy == "fair")
        self.metrics = GatewayMetrics(self.endpoints, self.queue)
        self.block_index = BlockIndex(config.block_index_capacity)
        self.router = Router(config.policy, weights=config.weights, block_index=self.block_index,
                             prefix_capacity=config.prefix_capacity, sessions=config.sessions)
        self.endpoints.add_listener(on_removed=self.router.forget)
        self.ready = False
        self.session: aiohttp.ClientSession | None = None
        self.scraper: LoadScraper | None = None
        self.proxy: Proxy | None = None
        self.subscriber: KVEventSubscriber | None = None
        self.hasher: PromptHasher | None = None
        self.watcher: EndpointSliceWatcher | None = None

    async def start(self) -> None:
        # No total timeout (a stream lasts as long as the generation); a short connect timeout,
        # so a dead address is retried elsewhere at once. limit=0: the queue bounds concurrency.
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, enable_cleanup_closed=True),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.config.connect_timeout),
            auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar())
        if self.router.reads_prompt_blocks:
            self.hasher = PromptHasher(self.session, max_blocks=self.config.max_prompt_blocks,
                                       headers=self.config.upstream_headers)
        if self.router.reads_kv_events:
            self.subscriber = KVEventSubscriber(self.block_index, self.session, headers=self.config.upstream_headers)
            self.endpoints.add_listener(lambda name: self.subscriber.watch(name, name), self.subscriber.unwatch,
                                        self.subscriber.nudge)
        self.proxy = Proxy(self.config, self.endpoints, self.queue, self.router, self.session, self.metrics, self.hasher)
        self.scraper = LoadScraper(self.endpoints, self.session)
        self.scraper.start()
        if self.config.service is not None:
            self.watcher = EndpointSliceWatcher(
                self.config.namespace, self.config.service, self.endpoints.set_endpoints,
                port=self.config.target_port, port_name=self.config.target_port_name)
            self.watcher.start()
        else:
            self.endpoints.set_endpoints(self.config.endpoints)
        self.ready = True
        log.info("gateway ready: policy %s, %d endpoints", self.config.policy, len(self.endpoints))

    async def close(self) -> None:
        self.ready = False
        for part in (self.watcher, self.scraper, self.subscriber, self.hasher):
            if part is not None:
                try:
                    await part.close()
                except Exception:
                    log.exception("closing %s failed", type(part).__name__)
        if self.session is not None:
            await self.session.close()


@web.middleware
async def json_errors(request: web.Request, handler) -> web.StreamResponse:
    """The gateway's own failures (body too large, a bug) in OpenAI's error shape."""
    try:
        refuse_declared_oversize(request)
        refuse_undecodable_coding(request)
        return await handler(request)
    except web.RequestPayloadError as exc:  # a body aiohttp could not decode, e.g. gzip that is not
        message = payload_error_message(exc)
        log.info("%s %s -> 400 %s", request.method, request.path, message)
        response = error_response(400, message, code=PAYLOAD_ERROR_CODE)
        response.force_close()  # aiohttp closes the connection after an unreadable body: say so
        return response
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message, code, headers = http_error_parts(exc)
        if request_id := request.headers.get(REQUEST_ID):
            headers[REQUEST_ID] = request_id
        log.info("%s %s -> %d %s", request.method, request.path, exc.status, message)
        return error_response(exc.status, message, code=code, headers=headers or None)
    except (ConnectionError, asyncio.CancelledError):  # the client went away: nobody to answer
        raise
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(500, "Internal gateway error; see the gateway log.", code="internal_error")


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    gateway = request.app[GATEWAY]
    if not gateway.ready:
        return web.json_response({"status": "starting"}, status=503)
    return web.json_response({"status": "ready", "endpoints": len(gateway.endpoints),
                              "routable": len(gateway.endpoints.routable_endpoints()),
                              "waiting": gateway.queue.waiting})


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[GATEWAY].metrics.render(), headers={"Content-Type": CONTENT_TYPE})


async def forward(request: web.Request) -> web.StreamResponse:
    return await request.app[GATEWAY].proxy.handle(request)


def build_app(config: GatewayConfig) -> web.Application:
    """The gateway app; its startup starts the scraper (and the KV-event subscriber), its
    cleanup stops them. ``app[GATEWAY]`` is the :class:`Gateway`."""
    app = web.Application(middlewares=[json_errors], client_max_size=config.max_request_bytes)
    gateway = Gateway(config)
    app[GATEWAY] = gateway

    async def lifecycle(app: web.Application):
        await gateway.start()
        yield
        await gateway.close()

    app.cleanup_ctx.append(lifecycle)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_route("*", "/{tail:.*}", forward, expect_handler=continue_within_limit)
    return app


async def serve(config: GatewayConfig, host: str, port: int) -> int:
    """Serve until SIGTERM/SIGINT; then stop taking connections and give in-flight requests up
    to ``shutdown_timeout``. Returns the process exit code."""
    app = build_app(config)
    # handler_cancellation: a client that disconnects cancels its handler, which closes the
    # upstream connection, so the pod aborts the request.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                           shutdown_timeout=config.shutdown_timeout)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port, backlog=4096).start()
    except OSError as exc:
        log.error("cannot listen on %s:%d: %s", host, port, exc.strerror or exc)
        await runner.cleanup()
        return 1
    log.info("gateway listening on http://%s:%d", host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    log.info("stopping: up to %.0fs for in-flight requests", config.shutdown_timeout)
    await runner.cleanup()
    return 0
