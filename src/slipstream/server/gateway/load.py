"""Each endpoint's load, read from its ``/metrics`` a few times a second (with the contract's
reader, :func:`slipstream.api_types.metrics.read_pod_load`).

Every endpoint is scraped on its own task, so a slow or silent one never delays the others; a
scrape that takes longer than ``scrape_timeout`` is dropped, and an endpoint without a good
scrape for ``load_timeout`` stops getting requests (:meth:`EndpointSet.routable`) until one
answers again. An endpoint not known to be ready (new, or it failed a connection or answered
503) is asked ``/ready`` first: a loading or draining pod answers ``/metrics`` too.
"""
from __future__ import annotations

import asyncio
import logging

import aiohttp

from slipstream.api_types.metrics import read_pod_load

from .endpoints import EndpointSet

log = logging.getLogger("slipstream.gateway")

# A pod's exposition is tens of KiB; anything far larger is not one.
MAX_BYTES = 4 << 20


class LoadScraper:
    """Scrapes every endpoint of ``endpoints`` each ``scrape_interval`` seconds, concurrently."""

    def __init__(self, endpoints: EndpointSet, session: aiohttp.ClientSession):
        self.endpoints = endpoints
        self.session = session
        self.config = endpoints.config
        self._scrapes: dict[str, asyncio.Task] = {}
        self._loop_task: asyncio.Task | None = None
        self._wake = asyncio.Event()
        endpoints.add_listener(lambda name: self._wake.set(), self._cancel)

    def start(self) -> None:
        self._loop_task = asyncio.create_task(self._run(), name="gateway-scraper")

    async def close(self) -> None:
        tasks = [t for t in (self._loop_task, *self._scrapes.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._scrapes.clear()

    def _cancel(self, name: str) -> None:
        task = self._scrapes.pop(name, None)
        if task is not None:
            task.cancel()

    async def _run(self) -> None:
        while True:
            self._wake.clear()
            for name in self.endpoints.names():
                if name not in self._scrapes:
                    self._scrapes[name] = asyncio.create_task(self._scrape(name), name=f"scrape {name}")
            # a dispatch each tick: waiters see endpoints go stale and others come back
            self.endpoints.capacity_changed()
            try:
                await asyncio.wait_for(self._wake.wait(), self.config.scrape_interval)
            except asyncio.TimeoutError:
                pass

    async def _scrape(self, name: str) -> None:
        endpoint = self.endpoints.get(name)
        check_ready = endpoint is not None and not endpoint.ready
        try:
            async with asyncio.timeout(self.config.scrape_timeout):
                if check_ready:
                    async with self.session.get(name + "/ready") as response:
                        await response.read()
                        if response.status != 200:
                            return
                async with self.session.get(name + "/metrics") as response:
                    if response.status != 200:
                        raise ValueError(f"HTTP {response.status}")
                    body = await response.content.read(MAX_BYTES + 1)
            if len(body) > MAX_BYTES:
                raise ValueError(f"/metrics larger than {MAX_BYTES} bytes")
            sample = read_pod_load(body.decode("utf-8", errors="replace"), pod=name,
                                   time=self.endpoints.clock())
        except asyncio.CancelledError:
            raise
        except aiohttp.ClientConnectorError as exc:  # refused, unreachable: it is not there now
            log.debug("scrape %s: %s", name, exc)
            self.endpoints.mark_unready(name, "connection failed")
        except Exception as exc:  # timeout, bad answer: stale after load_timeout
            log.debug("scrape %s failed: %r", name, exc)
        else:
            self.endpoints.observe(name, sample, ready=check_ready)
        finally:
            if self._scrapes.get(name) is asyncio.current_task():
                del self._scrapes[name]
