"""Helpers of the gateway tests: real ``slipstream serve --model sim:tiny`` pods on 127.0.0.x
(started once per session and in parallel by conftest.py's ``pods``), the gateway in-process on
an aiohttp test server, and reading /metrics.

One sim:tiny step takes ~13 ms at ``time_scale=1``, so a 200-token answer takes ~3 s.
"""
from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator

import aiohttp
from aiohttp.test_utils import TestServer
from prometheus_client.parser import text_string_to_metric_families

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
