"""Each endpoint's load, read from its ``/metrics`` a few times a second.

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
from prometheus_client.parser import text_string_to_metric_families

from .endpoints import EndpointSet, LoadSample

log = logging.getLogger("slipstream.gateway")

WAITING = "slipstream:num_requests_waiting"
RUNNING = "slipstream:num_requests_running"
KV_CACHE = "slipstream:kv_cache_usage_perc"
ENGINE_INFO = "slipstream:engine_config_info"
# A pod's exposition is tens of KiB; anything far larger is not one.
MAX_BYTES = 4 << 20


def parse_load(text: str) -> LoadSample:
    """A :class:`LoadSample` from Prometheus text exposition.

    Request counts are summed over ``model_name`` series and the largest KV usage is taken. The
    info gauge ``slipstream:engine_config_info{block_size, max_num_seqs}`` is optional.
    Raises ValueError when the text does not parse or a load gauge is missing.
    """
    values: dict[str, list[float]] = {WAITING: [], RUNNING: [], KV_CACHE: []}
    block_size = max_num_seqs = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in values:
                values[sample.name].append(float(sample.value))
            elif sample.name == ENGINE_INFO:
                block_size = _positive_int(sample.labels.get("block_size")) or block_size
                max_num_seqs = _positive_int(sample.labels.get("max_num_seqs")) or max_num_seqs
    missing = [name for name, found in values.items() if not found]
    if missing:
        raise ValueError(f"metrics missing: {', '.join(missing)}")
    return LoadSample(sum(values[WAITING]), sum(values[RUNNING]), max(values[KV_CACHE]), block_size, max_num_seqs)


def _positive_int(text: str | None) -> int | None:
    try:
        value = int(text) if text is not None else None
    except ValueError:
        return None
    return value if value is not None and value > 0 else None


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
            sample = parse_load(body.decode("utf-8", errors="replace"))
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
