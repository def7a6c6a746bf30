"""The gateway's wait queue: requests that no endpoint can take yet (the lossless cold path:
scale from zero, a rollout, every pod at its limit).

A request takes a slot with :meth:`WaitQueue.acquire`: at once when the routing policy picks an
endpoint, else it waits in a bounded FIFO queue until an endpoint appears or a slot frees, up to
its deadline. The queue hears of freed capacity from the :class:`~.endpoints.EndpointSet`
(a slot released, a fresh scrape, a scraper tick) and hands slots out in arrival order.
"""
from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Collection, Sequence

from .endpoints import EndpointSet
from .routing import Choice, EndpointLoad

Pick = Callable[[Sequence[EndpointLoad]], "Choice | None"]


class QueueFull(Exception):
    """The gateway's queue holds ``max_queue`` requests already (answer 429)."""


class DeadlineExceeded(Exception):
    """A request waited its whole ``queue_timeout`` for an endpoint (answer 503)."""


@dataclass(slots=True)
class _Waiter:
    pick: Pick
    exclude: Collection[str]
    future: asyncio.Future = field(repr=False)


class WaitQueue:
    """Requests waiting for a slot on one of ``endpoints``; at most ``max_queue`` (default the
    endpoints' ``config.max_queue``)."""

    def __init__(self, endpoints: EndpointSet, max_queue: int | None = None):
        self.endpoints = endpoints
        self.max_queue = endpoints.config.max_queue if max_queue is None else max_queue
        self._waiters: deque[_Waiter] = deque()
        endpoints.add_capacity_listener(self.dispatch)

    @property
    def waiting(self) -> int:
        """Requests waiting in the gateway for an endpoint."""
        return len(self._waiters)

    def _try(self, pick: Pick, exclude: Collection[str]) -> Choice | None:
        loads = self.endpoints.loads()
        if exclude:  # excluded ones only when no other is routable (one pod that came back)
            loads = [e for e in loads if e.name not in exclude] or loads
        choice = pick(loads)
        if choice is not None:
            self.endpoints.take(choice.endpoint)
        return choice

    async def acquire(self, pick: Pick, deadline: float, exclude: Collection[str] = ()) -> Choice:
        """A slot on the endpoint ``pick`` chooses among the routable ones not in ``exclude``
        (those only when no other is routable: an endpoint that failed is unready until its
        /ready answers again, and then it may be the only one left).

        Waits (FIFO behind earlier waiters) while ``pick`` returns None, until ``deadline`` (on
        the endpoints' clock). Raises QueueFull when ``max_queue`` requests wait already and
        DeadlineExceeded past the deadline. The caller must :meth:`EndpointSet.release` the
        choice's endpoint.
        """
        if not self._waiters:
            choice = self._try(pick, exclude)
            if choice is not None:
                return choice
        if len(self._waiters) >= self.max_queue:
            raise QueueFull
        waiter = _Waiter(pick, frozenset(exclude), asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        try:
            done, _ = await asyncio.wait({waiter.future}, timeout=max(0.0, deadline - self.endpoints.clock()))
        except BaseException:  # cancelled: the client went away while waiting
            self._abandon(waiter)
            raise
        if not done:
            self._abandon(waiter)
            raise DeadlineExceeded
        return waiter.future.result()

    def _abandon(self, waiter: _Waiter) -> None:
        if waiter.future.done() and not waiter.future.cancelled():
            self.endpoints.release(waiter.future.result().endpoint)  # handed a slot just as it gave up
            return
        waiter.future.cancel()
        try:
            self._waiters.remove(waiter)
        except ValueError:
            pass

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
