"""The gateway's wait queue: requests that no endpoint can take yet (the lossless cold path:
scale from zero, a rollout, every pod at its limit), with flow control between tenants.

A request takes a slot with :meth:`WaitQueue.acquire`: at once when nobody waits and the routing
policy picks an endpoint, else it waits, bounded, until an endpoint appears or a slot frees, up
to its deadline. The queue hears of freed capacity from the :class:`~.endpoints.EndpointSet`
(a slot released, a fresh scrape, a scraper tick) and hands slots out in this order:

1. criticality band (``x-slipstream-criticality``): critical, then standard; a sheddable request
   never waits, it is refused (429) as soon as no endpoint can take it;
2. between tenants (``x-gateway-inference-fairness-id``), the one served least so far by the
   Virtual Token Counter the engine uses (:class:`~slipstream.server.virtual_token_counter.TokenCounters`:
   a request's estimated prompt tokens are charged when it gets its slot, its output tokens when
   its response ends; a tenant that starts waiting again is lifted to the least-served waiting
   tenant's count);
3. arrival, within a tenant.

When the queue is full a critical request takes the place of the newest standard one (which is
refused, 429), so a critical request is never refused while a standard one waits.

Shares of the in-flight limit (``fair``): while every endpoint is at its limit, a tenant holding
fewer requests in flight on an endpoint than its share of that endpoint's slots (``slots × its
weight ÷ the weights' sum`` of the tenants in flight or waiting) is not held here: its request goes
to such a pod past that pod's limit (to at most ``BORROW`` times it, and never past what the pod
itself queues: ``max_num_seqs + --max-waiting``), where the engine's fair policy seats it at the
next step. So a tenant sending a few requests beside a flood waits for no flood request to
finish; and as each engine splits its own seats by weight among the tenants it holds, every
tenant keeps its share on every pod (a tenant absent from a pod would leave that pod's seats to
the others: with weights 3:1 that served 3.6–4.2:1). With one tenant, or every tenant at its
share everywhere, nothing changes. Sheddable requests never borrow.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Callable, Collection, Sequence

from slipstream.api_types.tenancy import CRITICALITIES, DEFAULT_CRITICALITY, DEFAULT_TENANT
from slipstream.server.virtual_token_counter import TokenCounters, count_for_tenant

from .endpoints import EndpointSet
from .routing import Choice, EndpointLoad

Pick = Callable[[Sequence[EndpointLoad]], "Choice | None"]
CRITICAL, STANDARD, SHEDDABLE = CRITICALITIES
# A pod takes at most this many times its in-flight limit when tenants below their share borrow:
# the extra requests wait in its engine (its own --max-waiting still applies).
BORROW = 2


class QueueFull(Exception):
    """The gateway's queue holds ``max_queue`` requests already, or a critical request took this
    one's place (answer 429)."""


class Shed(QueueFull):
    """A sheddable request that no endpoint could take at once (answer 429)."""


class DeadlineExceeded(Exception):
    """A request waited its whole ``queue_timeout`` for an endpoint (answer 503)."""


@dataclass(slots=True, eq=False)
class _Waiter:
    pick: Pick
    exclude: Collection[str]
    future: asyncio.Future = field(repr=False)
    tenant: str
    band: int  # index in CRITICALITIES
    prompt_tokens: int
    seq: int


class WaitQueue:
    """Requests waiting for a slot on one of ``endpoints``; at most ``max_queue`` (default the
    endpoints' ``config.max_queue``); ``tenant_weights``: tenant → share (default 1 each);
    ``fair`` False: first-come between tenants (criticality bands still apply)."""

    def __init__(self, endpoints: EndpointSet, max_queue: int | None = None,
                 tenant_weights: Mapping[str, float] | None = None, fair: bool = True):
        self.endpoints = endpoints
        self.fair = fair
        self.max_queue = endpoints.config.max_queue if max_queue is None else max_queue
        self.service = TokenCounters(tenant_weights, active=self.waiting_by_tenant)
        self._queues: dict[tuple[int, str], deque[_Waiter]] = {}  # (band, tenant) → arrival order
        self._in_flight: dict[str, int] = {}  # tenant → slots granted and not released
        self._on_endpoint: dict[tuple[str, str], int] = {}  # (endpoint, tenant) → the same, per endpoint
        self._rejected: dict[str, int] = {}  # tenant → requests refused (429; bounded: count_for_tenant)
        self._count = 0
        self._seq = itertools.count()
        endpoints.add_capacity_listener(self.dispatch)

    @property
    def waiting(self) -> int:
        """Requests waiting in the gateway for an endpoint."""
        return self._count

    def waiting_by_tenant(self) -> dict[str, int]:
        """Requests waiting per tenant."""
        counts: dict[str, int] = {}
        for (_, tenant), queue in self._queues.items():
            counts[tenant] = counts.get(tenant, 0) + len(queue)
        return {t: n for t, n in counts.items() if n}

    def in_flight_by_tenant(self) -> dict[str, int]:
        """Requests in flight (granted a slot, not yet released) per tenant."""
        return dict(self._in_flight)

    def rejected_by_tenant(self) -> dict[str, int]:
        """Requests refused (shed, queue full, over a token limit) per tenant; bounded, the oldest
        tenants forgotten."""
        return dict(self._rejected)

    def count_refusal(self, tenant: str) -> None:
        """Count a request of ``tenant`` refused with 429 (here, or by the gateway's token limits)."""
        count_for_tenant(self._rejected, tenant)

    def _refuse(self, tenant: str, error: QueueFull) -> QueueFull:
        self.count_refusal(tenant)
        return error

    def release(self, endpoint: str, tenant: str) -> None:
        """Give back the slot on ``endpoint`` that :meth:`acquire` granted to ``tenant``."""
        _count(self._in_flight, tenant, -1)
        _count(self._on_endpoint, (endpoint, tenant), -1)
        self.endpoints.release(endpoint)  # tells the queue (dispatch) of the freed slot

    def charge_output(self, tenant: str, output_tokens: int) -> None:
        """Count the output tokens a finished response of ``tenant`` carried."""
        self.service.charge(tenant, 0, output_tokens)

    def _try(self, pick: Pick, exclude: Collection[str], tenant: str, *, free: bool = True,
             borrow: bool = True) -> Choice | None:
        """A slot for ``tenant`` now, taken: a free one (``free``), else, while every endpoint is
        at its limit, a borrowed one on an endpoint where the tenant is below its share
        (``borrow``; module docstring); or None."""
        loads = self.endpoints.loads()
        if exclude:  # excluded ones only when no other is routable (one pod that came back)
            loads = [e for e in loads if e.name not in exclude] or loads
        choice = pick(loads) if free else None
        if choice is None and borrow and self.fair and loads and all(e.full for e in loads):
            tenants = {tenant, *self._in_flight, *(t for _, t in self._queues)}
            room = [dataclasses.replace(e, capacity=_borrowed(e)) for e in loads
                    if self._below_share(tenant, e, tenants)]
            choice = pick(room) if room else None
        if choice is not None:
            self.endpoints.take(choice.endpoint)
            _count(self._in_flight, tenant, 1)
            _count(self._on_endpoint, (choice.endpoint, tenant), 1)
        return choice

    def _below_share(self, tenant: str, endpoint: EndpointLoad, tenants: set[str]) -> bool:
        """One more request of ``tenant`` in flight on ``endpoint`` (full, so limited) stays within
        its share of that endpoint's slots, split among ``tenants``."""
        share = self.service.shares(endpoint.capacity, tenants)[tenant]
        return self._on_endpoint.get((endpoint.name, tenant), 0) + 1 <= share

    async def acquire(self, pick: Pick, deadline: float, exclude: Collection[str] = (), *,
                      tenant: str = DEFAULT_TENANT, criticality: str = DEFAULT_CRITICALITY,
                      prompt_tokens: int = 0) -> Choice:
        """A slot on the endpoint ``pick`` chooses among the routable ones not in ``exclude``
        (those only when no other is routable: an endpoint that failed is unready until its
        /ready answers again, and then it may be the only one left).

        Waits (in the module's order) while ``pick`` returns None, until ``deadline`` (on the
        endpoints' clock). ``prompt_tokens`` (an estimate) is charged to ``tenant`` when the slot
        is granted. Raises :class:`Shed` for a sheddable request that gets no slot at once,
        :class:`QueueFull` when ``max_queue`` requests wait already (or a critical request took
        this one's place) and :class:`DeadlineExceeded` past the deadline. The caller must
        :meth:`EndpointSet.release` the choice's endpoint.

        Raises:
            ValueError: an unknown ``criticality``.
        """
        if criticality not in CRITICALITIES:
            raise ValueError(f"criticality must be one of {', '.join(CRITICALITIES)}, got {criticality!r}")
        # With others waiting a free slot is theirs: only a borrowed one may be taken at once.
        choice = self._try(pick, exclude, tenant, free=not self._count, borrow=criticality != SHEDDABLE)
        if choice is not None:
            self.service.charge(tenant, prompt_tokens, 0)
            return choice
        if criticality == SHEDDABLE:
            raise self._refuse(tenant, Shed())
        if self._count >= self.max_queue and not (criticality == CRITICAL and self._evict_standard()):
            raise self._refuse(tenant, QueueFull())
        if not any(t == tenant for _, t in self._queues):
            self.service.lift(tenant, self.waiting_by_tenant())
        waiter = _Waiter(pick, frozenset(exclude), asyncio.get_running_loop().create_future(), tenant,
                         CRITICALITIES.index(criticality), prompt_tokens, next(self._seq))
        self._queues.setdefault((waiter.band, tenant), deque()).append(waiter)
        self._count += 1
        try:
            done, _ = await asyncio.wait({waiter.future}, timeout=max(0.0, deadline - self.endpoints.clock()))
        except BaseException:  # cancelled: the client went away while waiting
            self._abandon(waiter)
            raise
        if not done:
            self._abandon(waiter)
            raise DeadlineExceeded
        return waiter.future.result()

    def _remove(self, waiter: _Waiter) -> None:
        key = (waiter.band, waiter.tenant)
        queue = self._queues.get(key)
        if queue is None or waiter not in queue:
            return
        queue.remove(waiter)
        self._count -= 1
        if not queue:  # one entry per tenant that waits now, not per tenant ever seen
            del self._queues[key]

    def _abandon(self, waiter: _Waiter) -> None:
        if waiter.future.done() and not waiter.future.cancelled() and waiter.future.exception() is None:
            self.release(waiter.future.result().endpoint, waiter.tenant)  # handed a slot just as it gave up
            return
        waiter.future.cancel()
        self._remove(waiter)

    def _evict_standard(self) -> bool:
        """Refuse the newest waiting standard request to make room; False when none waits."""
        newest = max((q[-1] for (band, _), q in self._queues.items() if q and band == CRITICALITIES.index(STANDARD)),
                     key=lambda w: w.seq, default=None)
        if newest is None:
            return False
        self._remove(newest)
        if not newest.future.done():
            newest.future.set_exception(self._refuse(newest.tenant, QueueFull()))
        return True

    def _next(self, skipped: set[int], passed: set[str]) -> _Waiter | None:
        """The waiter to serve next (module docstring), passing over the waiters in ``skipped``
        and the tenants in ``passed``."""
        best, best_key = None, None
        for (band, tenant), queue in self._queues.items():
            if tenant in passed:
                continue
            head = next((w for w in queue if w.seq not in skipped), None)
            if head is None:
                continue
            # Ties (a tenant just lifted to another's count): the one with fewer waiting first.
            key = (band, self.service.served(tenant), len(queue), head.seq) if self.fair else (band, head.seq)
            if best_key is None or key < best_key:
                best, best_key = head, key
        return best

    def dispatch(self) -> None:
        """Hand slots to waiters in the module's order. A waiter without exclusions that gets none
        finds every endpoint full or unroutable: first-come stops there; ``fair`` goes on with the
        other tenants, one of which may be below its share and borrow."""
        skipped: set[int] = set()
        passed: set[str] = set()
        while (waiter := self._next(skipped, passed)) is not None:
            if waiter.future.done():
                self._remove(waiter)
                continue
            choice = self._try(waiter.pick, waiter.exclude, waiter.tenant)
            if choice is not None:
                self._remove(waiter)
                self.service.charge(waiter.tenant, waiter.prompt_tokens, 0)
                waiter.future.set_result(choice)
                continue
            if waiter.exclude:
                skipped.add(waiter.seq)
            elif not self.fair:
                return
            else:
                passed.add(waiter.tenant)


def _borrowed(endpoint: EndpointLoad) -> int:
    """``endpoint``'s limit while tenants below their share borrow: ``BORROW`` times its own, at
    most what the pod itself accepts."""
    limit = BORROW * endpoint.capacity
    return limit if endpoint.accepts is None else min(limit, endpoint.accepts)


def _count(counts: dict, key, delta: int) -> None:
    """Add ``delta`` to ``counts[key]``, dropping the key at 0 (one entry per holder now)."""
    held = counts.get(key, 0) + delta
    if held > 0:
        counts[key] = held
    else:
        counts.pop(key, None)
