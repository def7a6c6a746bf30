"""The endpoints behind the gateway, their load, and the requests in flight on each.

:class:`EndpointSet` is the one place that knows which pods exist (:meth:`EndpointSet.set_endpoints`,
fed by ``--endpoint`` flags or an EndpointSlice watcher), which of them may take requests (``/ready``
answered 200 and nothing said otherwise since, a good ``/metrics`` scrape within ``load_timeout``), and how
many requests the gateway has in flight on each (:meth:`EndpointSet.take` / :meth:`EndpointSet.release`).
Requests that no endpoint can take yet wait in :class:`~.wait_queue.WaitQueue`, which hears from
here whenever capacity may have freed.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Collection, Iterable

from slipstream.api_types.load import PodLoad

from .config import GatewayConfig, normalize_url
from .routing import EndpointLoad

log = logging.getLogger("slipstream.gateway")

DEFAULT_BLOCK_SIZE = 16


@dataclass(slots=True)
class Endpoint:
    """One pod as the gateway sees it. Times are seconds on the set's clock."""

    name: str
    in_flight: int = 0
    waiting: float = 0.0
    running: float = 0.0
    kv_cache_usage: float = 0.0
    block_size: int = DEFAULT_BLOCK_SIZE
    max_num_seqs: int | None = None
    max_waiting: int | None = None  # the pod's --max-waiting (it answers 429 past max_num_seqs + this)
    last_scrape: float | None = None  # the last good scrape; None: never answered
    # /ready answered 200, and no connection failed or 503 came back since (a loading or
    # draining pod still answers /metrics, so a fresh scrape alone does not make it ready)
    ready: bool = False


class EndpointSet:
    """Endpoints by name (the base URL), their load and in-flight counts.

    Listeners (:meth:`add_listener`) hear of each endpoint added or removed; the KV-event
    subscriber follows the added ones and the router forgets the removed ones. Capacity
    listeners (:meth:`add_capacity_listener`) hear whenever an endpoint may take more than before:
    a slot freed, a fresh scrape, a scraper tick.
    """

    def __init__(self, config: GatewayConfig, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.clock = clock
        self._endpoints: dict[str, Endpoint] = {}
        self._retired: dict[str, Endpoint] = {}  # removed with requests still in flight
        self._listeners: list[tuple[Callable[[str], None] | None, ...]] = []
        self._capacity_listeners: list[Callable[[], None]] = []

    # ---- membership -------------------------------------------------------------------------

    def add_listener(self, on_added: Callable[[str], None] | None = None,
                     on_removed: Callable[[str], None] | None = None,
                     on_routable: Callable[[str], None] | None = None) -> None:
        """Call ``on_added(name)`` / ``on_removed(name)`` on each change from now on, and
        ``on_routable(name)`` each time an endpoint becomes routable (ready and scraped)."""
        self._listeners.append((on_added, on_removed, on_routable))

    def add_capacity_listener(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` whenever an endpoint may take a request it could not before."""
        self._capacity_listeners.append(callback)

    def capacity_changed(self) -> None:
        """Tell the capacity listeners (also each scraper tick: endpoints go stale, come back)."""
        for callback in self._capacity_listeners:
            callback()

    def set_endpoints(self, urls: Iterable[str]) -> tuple[list[str], list[str]]:
        """Make the set exactly ``urls`` (base URLs; normalized to names). The single entry point
        for membership. Returns (added, removed) names. Requests in flight on a removed endpoint
        finish there; it gets no new ones."""
        wanted = list(dict.fromkeys(normalize_url(u) for u in urls))
        added = [n for n in wanted if n not in self._endpoints]
        removed = [n for n in self._endpoints if n not in wanted]
        for name in removed:
            endpoint = self._endpoints.pop(name)
            if endpoint.in_flight > 0:
                self._retired[name] = endpoint
            self._notify(1, name)
        for name in added:
            self._endpoints[name] = self._retired.pop(name, None) or Endpoint(name)
            self._notify(0, name)
        if added or removed:
            log.info("endpoints: %d (added %s, removed %s)", len(self._endpoints), added or "none",
                     removed or "none")
        return added, removed

    def _notify(self, which: int, name: str) -> None:
        for pair in self._listeners:
            callback = pair[which]
            if callback is None:
                continue
            try:
                callback(name)
            except Exception:  # one broken listener must not stop membership changes
                log.exception("endpoint listener failed for %s", name)

    def names(self) -> list[str]:
        return list(self._endpoints)

    def get(self, name: str) -> Endpoint | None:
        return self._endpoints.get(name) or self._retired.get(name)

    def __len__(self) -> int:
        return len(self._endpoints)

    # ---- load -------------------------------------------------------------------------------

    def routable(self, endpoint: Endpoint, now: float | None = None) -> bool:
        """May take new requests: ready, and answered a scrape within ``load_timeout``."""
        now = self.clock() if now is None else now
        return (endpoint.ready and endpoint.last_scrape is not None
                and now - endpoint.last_scrape <= self.config.load_timeout)

    def routable_endpoints(self) -> list[Endpoint]:
        now = self.clock()
        return [e for e in self._endpoints.values() if self.routable(e, now)]

    def loads(self, exclude: Collection[str] = ()) -> list[EndpointLoad]:
        """The routable endpoints as the router sees them (``exclude``: names left out)."""
        return [_load(e, self.config.capacity(e.max_num_seqs)) for e in self.routable_endpoints()
                if e.name not in exclude]

    def observe(self, name: str, sample: PodLoad, ready: bool = False) -> None:
        """A good scrape of ``name``: fresh load; ``ready``: its /ready answered 200 just now."""
        endpoint = self._endpoints.get(name)
        if endpoint is None:
            return
        endpoint.waiting, endpoint.running = sample.num_requests_waiting, sample.num_requests_running
        endpoint.kv_cache_usage = sample.kv_cache_usage_perc
        if sample.block_size is not None:
            endpoint.block_size = sample.block_size
        if sample.max_num_seqs is not None:
            endpoint.max_num_seqs = sample.max_num_seqs
        if sample.max_waiting is not None:
            endpoint.max_waiting = sample.max_waiting
        was = self.routable(endpoint)
        endpoint.last_scrape = self.clock()
        endpoint.ready = endpoint.ready or ready
        if not was and self.routable(endpoint):
            log.info("endpoint %s is routable", name)
            self._notify(2, name)
        self.capacity_changed()

    def mark_unready(self, name: str, why: str) -> None:
        """A connection to ``name`` failed or it answered 503 (loading, draining): no new
        requests until its /ready answers 200 again."""
        endpoint = self._endpoints.get(name)
        if endpoint is not None and endpoint.ready:
            endpoint.ready = False
            log.warning("endpoint %s is not ready (%s)", name, why)

    # ---- slots ------------------------------------------------------------------------------

    def take(self, name: str) -> None:
        """A request was sent to ``name``: one more in flight there. Raises KeyError for an
        endpoint not in the set."""
        self._endpoints[name].in_flight += 1

    def release(self, name: str) -> None:
        """A request on ``name`` finished: free its slot and tell the capacity listeners."""
        endpoint = self.get(name)
        if endpoint is not None and endpoint.in_flight > 0:
            endpoint.in_flight -= 1
            if endpoint.in_flight == 0 and self._retired.get(name) is endpoint:
                del self._retired[name]
        self.capacity_changed()


def _load(endpoint: Endpoint, capacity: int | None) -> EndpointLoad:
    """``endpoint`` as the router sees it; its ``capacity`` (the gateway's limit) at most what the
    pod itself accepts."""
    accepts = None
    if endpoint.max_num_seqs is not None and endpoint.max_waiting is not None:
        accepts = endpoint.max_num_seqs + endpoint.max_waiting
        capacity = accepts if capacity is None else min(capacity, accepts)
    return EndpointLoad(endpoint.name, endpoint.waiting, endpoint.running, endpoint.kv_cache_usage,
                        endpoint.in_flight, capacity, accepts)
