"""The endpoints behind the gateway, their load, and the slots requests hold on them.

:class:`EndpointSet` is the one place that knows which pods exist (:meth:`EndpointSet.set_endpoints`,
fed by ``--endpoint`` flags or an EndpointSlice watcher), which of them may take requests (``/ready``
answered 200 and nothing said otherwise since, a good ``/metrics`` scrape within ``load_timeout``), and how
many requests the gateway has in flight on each. A request takes a slot with
:meth:`EndpointSet.acquire`: at once when the routing policy picks an endpoint, else it waits in a
bounded FIFO queue until an endpoint appears or a slot frees, up to its deadline (the lossless
cold path: scale from zero, a rollout, every pod at its limit).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Collection, Iterable, Sequence

from .config import GatewayConfig, normalize_url
from .routing import Choice, EndpointLoad

log = logging.getLogger("slipstream.gateway")

DEFAULT_BLOCK_SIZE = 16
Pick = Callable[[Sequence[EndpointLoad]], "Choice | None"]


class QueueFull(Exception):
    """The gateway's queue holds ``max_queue`` requests already (answer 429)."""


class DeadlineExceeded(Exception):
    """A request waited its whole ``queue_timeout`` for an endpoint (answer 503)."""


@dataclass(frozen=True, slots=True)
class LoadSample:
    """One scrape of a pod's /metrics. block_size and max_num_seqs are None when the pod does not
    export ``slipstream:engine_config_info``."""

    waiting: float
    running: float
    kv_cache_usage: float
    block_size: int | None = None
    max_num_seqs: int | None = None


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
    last_scrape: float | None = None  # the last good scrape; None: never answered
    # /ready answered 200, and no connection failed or 503 came back since (a loading or
    # draining pod still answers /metrics, so a fresh scrape alone does not make it ready)
    ready: bool = False


@dataclass(slots=True)
class _Waiter:
    pick: Pick
    exclude: Collection[str]
    future: asyncio.Future = field(repr=False)


class EndpointSet:
    """Endpoints by name (the base URL), their load and in-flight counts, and the wait queue.

    Listeners (:meth:`add_listener`) hear of each endpoint added or removed; the KV-event
    subscriber follows the added ones and the router forgets the removed ones.
    """

    def __init__(self, config: GatewayConfig, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.clock = clock
        self._endpoints: dict[str, Endpoint] = {}
        self._retired: dict[str, Endpoint] = {}  # removed with requests still in flight
        self._waiters: deque[_Waiter] = deque()
        self._listeners: list[tuple[Callable[[str], None] | None, ...]] = []

    # ---- membership -------------------------------------------------------------------------

    def add_listener(self, on_added: Callable[[str], None] | None = None,
                     on_removed: Callable[[str], None] | None = None,
                     on_routable: Callable[[str], None] | None = None) -> None:
        """Call ``on_added(name)`` / ``on_removed(name)`` on each change from now on, and
        ``on_routable(name)`` each time an endpoint becomes routable (ready and scraped)."""
        self._listeners.append((on_added, on_removed, on_routable))

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
        return [EndpointLoad(e.name, e.waiting, e.running, e.kv_cache_usage, e.in_flight,
                             self.config.capacity(e.max_num_seqs))
                for e in self.routable_endpoints() if e.name not in exclude]

    def observe(self, name: str, sample: LoadSample, ready: bool = False) -> None:
        """A good scrape of ``name``: fresh load; ``ready``: its /ready answered 200 just now."""
        endpoint = self._endpoints.get(name)
        if endpoint is None:
            return
        endpoint.waiting, endpoint.running = sample.waiting, sample.running
        endpoint.kv_cache_usage = sample.kv_cache_usage
        if sample.block_size is not None:
            endpoint.block_size = sample.block_size
        if sample.max_num_seqs is not None:
            endpoint.max_num_seqs = sample.max_num_seqs
        was = self.routable(endpoint)
        endpoint.last_scrape = self.clock()
        endpoint.ready = endpoint.ready or ready
        if not was and self.routable(endpoint):
            log.info("endpoint %s is routable", name)
            self._notify(2, name)
        self.dispatch()

    def mark_unready(self, name: str, why: str) -> None:
        """A connection to ``name`` failed or it answered 503 (loading, draining): no new
        requests until its /ready answers 200 again."""
        endpoint = self._endpoints.get(name)
        if endpoint is not None and endpoint.ready:
            endpoint.ready = False
            log.warning("endpoint %s is not ready (%s)", name, why)

    # ---- slots and the wait queue -------------------------------------------------------------

    @property
    def waiting(self) -> int:
        """Requests waiting in the gateway for an endpoint."""
        return len(self._waiters)

    def _try(self, pick: Pick, exclude: Collection[str]) -> Choice | None:
        loads = self.loads()
        if exclude:  # excluded ones only when no other is routable (one pod that came back)
            loads = [e for e in loads if e.name not in exclude] or loads
        choice = pick(loads)
        if choice is not None:
            self._endpoints[choice.endpoint].in_flight += 1
        return choice

    async def acquire(self, pick: Pick, deadline: float, exclude: Collection[str] = ()) -> Choice:
        """A slot on the endpoint ``pick`` chooses among the routable ones not in ``exclude``
        (those only when no other is routable: an endpoint that failed is unready until its
        /ready answers again, and then it may be the only one left).

        Waits (FIFO behind earlier waiters) while ``pick`` returns None, until ``deadline`` (on
        the set's clock). Raises QueueFull when ``max_queue`` requests wait already and
        DeadlineExceeded past the deadline. The caller must :meth:`release` the choice's endpoint.
        """
        if not self._waiters:
            choice = self._try(pick, exclude)
            if choice is not None:
                return choice
        if len(self._waiters) >= self.config.max_queue:
            raise QueueFull
        waiter = _Waiter(pick, frozenset(exclude), asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        try:
            done, _ = await asyncio.wait({waiter.future}, timeout=max(0.0, deadline - self.clock()))
        except BaseException:  # cancelled: the client went away while waiting
            self._abandon(waiter)
            raise
        if not done:
            self._abandon(waiter)
            raise DeadlineExceeded
        return waiter.future.result()

    def _abandon(self, waiter: _Waiter) -> None:
        if waiter.future.done() and not waiter.future.cancelled():
            self.release(waiter.future.result().endpoint)  # handed a slot just as it gave up
            return
        waiter.future.cancel()
        try:
            self._waiters.remove(waiter)
        except ValueError:
            pass

    def release(self, name: str) -> None:
        """A request on ``name`` finished: free its slot and hand slots to waiters."""
        endpoint = self.get(name)
        if endpoint is not None and endpoint.in_flight > 0:
            endpoint.in_flight -= 1
            if endpoint.in_flight == 0 and self._retired.get(name) is endpoint:
                del self._retired[name]
        self.dispatch()

    def dispatch(self) -> None:
        """Hand free slots to waiters in arrival order. Stops at the first waiter without
        exclusions that gets none: every endpoint is full or unroutable, so no later one would."""
        if not self._waiters:
            return
        kept: deque[_Waiter] = deque()
        while self._waiters:
            waiter = self._waiters.popleft()
            if waiter.future.done():
                continue
            choice = self._try(waiter.pick, waiter.exclude)
            if choice is not None:
                waiter.future.set_result(choice)
                continue
            kept.append(waiter)
            if not waiter.exclude:
                break
        kept.extend(self._waiters)
        self._waiters = kept
