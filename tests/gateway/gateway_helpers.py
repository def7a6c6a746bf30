"""Helpers of the gateway tests: real ``slipstream serve --model sim:tiny`` pods on 127.0.0.x
(started once per session and in parallel by conftest.py's ``pods``), the gateway in-process on
an aiohttp test server, and reading /metrics.

One sim:tiny step takes ~13 ms at ``time_scale=1``, so a 200-token answer takes ~3 s.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Awaitable, Callable

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer
from prometheus_client.parser import text_string_to_metric_families

from loadgen import free_port
from slipstream.server.gateway.app import GATEWAY, Gateway, build_app
from slipstream.server.gateway.config import GatewayConfig

MODEL = "sim-tiny"
API_KEY = "gateway-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
# name -> address; every pod enforces API_KEY, so every test also shows the header passed through
PODS = {"a": "127.0.0.31", "b": "127.0.0.32", "victim": "127.0.0.34"}


@dataclass
class Pod:
    name: str
    url: str
    process: subprocess.Popen
    log: Path

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)


def start_pods(addresses: dict[str, str], timeout: float = 90) -> dict[str, Pod]:
    """``slipstream serve --model sim:tiny`` on each address of ``addresses`` (name -> address,
    one port for all), started together; returns them once every one is ready. Raises
    RuntimeError (after killing them) if one exits or is not ready within ``timeout`` seconds."""
    port = free_port(list(addresses.values()))
    logs = Path(tempfile.mkdtemp(prefix="slipstream-gateway-"))
    started: dict[str, Pod] = {}
    for name, address in addresses.items():
        log = logs / f"{name}.log"
        process = subprocess.Popen(
            [sys.executable, "-m", "slipstream.server", "serve", "--model", "sim:tiny,time_scale=1",
             "--host", address, "--port", str(port), "--max-num-seqs", "8", "--log-interval", "0",
             "--shutdown-timeout", "5", "--api-key", API_KEY],
            stdout=log.open("wb"), stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
        started[name] = Pod(name, f"http://{address}:{port}", process, log)
    try:
        deadline = time.monotonic() + timeout
        waiting = set(started)
        while waiting:
            for name in list(waiting):
                pod = started[name]
                if pod.process.poll() is not None:
                    raise RuntimeError(f"pod {name} exited: {pod.log.read_text()[-2000:]}")
                if pod_ready(pod.url):
                    waiting.discard(name)
            if time.monotonic() > deadline:
                raise RuntimeError(f"pods not ready after {timeout:.0f} s: {sorted(waiting)}")
            time.sleep(0.1)
    except BaseException:
        for pod in started.values():
            pod.kill()
        raise
    return started


def pod_ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/ready", timeout=1) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


@contextlib.asynccontextmanager
async def running_gateway(wait_for: int | None = None, **settings) -> AsyncIterator[tuple[str, Gateway]]:
    """The gateway in-process with ``GatewayConfig(**settings)``; yields (base URL, Gateway)
    once ``wait_for`` endpoints (default: all configured) are routable."""
    config = GatewayConfig(**{"scrape_interval": 0.05, **settings})
    app = build_app(config)
    server = TestServer(app, host="127.0.0.1", port=0)
    await server.start_server()
    gateway = app[GATEWAY]
    try:
        deadline = time.monotonic() + 10
        wanted = len(config.endpoints) if wait_for is None else wait_for
        while len(gateway.endpoints.routable_endpoints()) < wanted:
            assert time.monotonic() < deadline, "configured endpoints did not become routable"
            await asyncio.sleep(0.02)
        yield str(server.make_url("")).rstrip("/"), gateway
    finally:
        await server.close()


async def raw_post(url: str, headers: bytes, body: bytes = b"") -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection that has sent POST /v1/chat/completions to the gateway at ``url`` with
    ``headers`` (CRLF-ended lines) and ``body`` as they are."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + headers + b"\r\n" + body)
    await writer.drain()
    return reader, writer


async def metrics(session: aiohttp.ClientSession, url: str) -> dict[tuple[str, tuple], float]:
    """``/metrics`` of ``url`` as {(sample name, sorted label items): value}."""
    async with session.get(url + "/metrics") as response:
        text = await response.text()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def total(samples: dict, name: str, **labels: str) -> float:
    """Sum of ``name``'s samples whose labels include ``labels``."""
    return sum(v for (n, items), v in samples.items()
               if n == name and all(dict(items).get(k) == val for k, val in labels.items()))


def chat(content: str = "hello", max_tokens: int = 8, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, **extra}


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@contextlib.asynccontextmanager
async def fake_pod(host: str, v1: Handler, ready: Handler | None = None) -> AsyncIterator[str]:
    """An in-process 'pod' on ``host`` (a loopback address) for what a real one will not do on
    cue: ``v1`` answers every ``/v1/...`` request, ``ready`` its ``/ready`` (default: 200), and
    its ``/metrics`` is idle throughout. Yields its URL."""
    async def metrics_page(request: web.Request) -> web.Response:
        return web.Response(text="slipstream:num_requests_waiting 0\nslipstream:num_requests_running 0\n"
                                 "slipstream:kv_cache_usage_perc 0\n")

    async def always_ready(request: web.Request) -> web.Response:
        return web.json_response({})

    app = web.Application()
    app.router.add_get("/metrics", metrics_page)
    app.router.add_get("/ready", ready or always_ready)
    app.router.add_route("*", "/v1/{tail:.*}", v1)
    server = TestServer(app, host=host, port=0)
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


async def leave_stream(session: aiohttp.ClientSession, url: str, events: int, headers: dict,
                       before_leaving: Callable[[], object] = lambda: None) -> object:
    """Stream a 400-token chat completion through ``url`` and leave after ``events`` data events;
    returns what ``before_leaving()`` (called while the stream is still open) returned."""
    body = chat(max_tokens=400, ignore_eos=True, stream=True)
    async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as response:
        seen = 0
        async for line in response.content:
            seen += line.startswith(b"data: ")
            if seen == events:
                return before_leaving()
    raise AssertionError(f"the stream ended after {seen} of {events} events")


async def until_none_in_flight(gateway: Gateway) -> None:
    """Wait (up to 5 s) until the gateway has seen every client go."""
    for _ in range(100):
        if not gateway.queue.in_flight_by_tenant():
            return
        await asyncio.sleep(0.05)
