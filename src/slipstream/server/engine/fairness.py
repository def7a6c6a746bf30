"""Which waiting request the scheduler admits next and which running one it preempts first:
``fcfs``, ``priority`` and ``fair`` (:data:`~slipstream.api_types.tenancy.SCHEDULING_POLICIES`).

``fair`` is the Virtual Token Counter (VTC; Sheng et al., "Fairness in Serving Large Language
Models", OSDI '24, Algorithm 2): each tenant has a counter of the service it got, charged per
token served (prompt tokens ×1, output tokens ×2 by default) and divided by its weight; the next
request admitted is one of the backlogged tenant with the smallest counter, and a tenant that
becomes backlogged again has its counter lifted to the smallest of the backlogged ones, so idle
time earns no credit. This bounds the gap in service between two backlogged tenants. Within a
tenant, requests run by ``priority`` (lower sooner, vLLM's convention) then arrival, and among
the first few of equal priority one whose prompt prefix is already cached goes first, keeping
prefix-cache locality as DLPM does (Cao et al., arXiv 2501.14312). With one tenant and equal
priorities it admits in arrival order, exactly as ``fcfs``.

Preemption takes the last request of :meth:`WaitingQueue.protect_order`'s order: ``fcfs`` the
newest, ``priority`` the lowest priority, ``fair`` the most-served tenant's newest. Under ``fair``
a tenant that waits while another holds every seat also gets one at the next step
(:meth:`WaitingQueue.seat_victim`: the other's newest request is preempted and recomputed later,
mostly from the prefix cache), so a flood cannot make a light tenant wait for a whole request
to finish.

Pure policy: no blocks, no clocks; a request's prompt is charged when it is admitted, and the
scheduler calls :meth:`WaitingQueue.charge` after each step for the output tokens. The counters
themselves (:class:`~slipstream.server.virtual_token_counter.TokenCounters`) are shared with the
gateway's flow control, which orders its own waiting requests by the same rule.
"""
from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

from slipstream.api_types.tenancy import (DEFAULT_SCHEDULING_POLICY, OUTPUT_TOKEN_WEIGHT, PROMPT_TOKEN_WEIGHT,
                                          SCHEDULING_POLICIES)

from ..virtual_token_counter import TokenCounters

if TYPE_CHECKING:
    from .request import Request

# How many of a tenant's first waiting requests of equal priority are looked at for a cached prefix.
PREFIX_LOOKAHEAD = 8


class WaitingQueue:
    """The waiting requests of one scheduler, in the order of ``policy``.

    Args:
        policy: ``"fcfs"``, ``"priority"`` or ``"fair"``.
        tenant_weights: tenant → weight (> 0) for ``fair``; a tenant not named weighs 1.
        prompt_token_weight, output_token_weight: VTC's charge per prompt and per output token.
        cached_blocks: request → how many of its prompt's blocks the prefix cache holds now
            (``fair`` prefers such a request within a tenant); None: no preference.

    Raises:
        ValueError: an unknown policy or a weight ≤ 0.
    """

    def __init__(self, policy: str = DEFAULT_SCHEDULING_POLICY, tenant_weights: Mapping[str, float] | None = None,
                 prompt_token_weight: float = PROMPT_TOKEN_WEIGHT, output_token_weight: float = OUTPUT_TOKEN_WEIGHT,
                 cached_blocks: Callable[[Request], int] | None = None):
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {policy!r}")
        self.policy = policy
        self.service = TokenCounters(tenant_weights, prompt_token_weight, output_token_weight,
                                     active=lambda: self._active)
        self.counters = self.service.counters  # tenant → weighted tokens served (fair)
        self.cached_blocks = cached_blocks
        self._active: dict[str, int] = {}  # tenant → its requests waiting or running
        self._heaps: dict[str, list[tuple]] = {}  # tenant (fcfs, priority: one heap, key "") → entries
        self._seq = itertools.count()
        self._front = itertools.count(-1, -1)  # preempted requests go back ahead of every arrival
        self._len = 0

    # --- the queue --------------------------------------------------------------------------
    def add(self, req: Request, front: bool = False, returning: bool = False) -> None:
        """Queue ``req``; ``front``: ahead of the ones that arrived after it (a preempted request, a
        forked choice); ``returning``: a preempted request, already counted. A new request of a
        tenant with nothing waiting or running lifts its counter (VTC)."""
        if not returning:
            self._lift(req.tenant)
            self._active[req.tenant] = self._active.get(req.tenant, 0) + 1
        seq = next(self._front) if front else next(self._seq)
        heapq.heappush(self._heaps.setdefault(self._queue_of(req), []), (self._rank(req), seq, req))
        self._len += 1

    def remove(self, req: Request) -> None:
        """Take a waiting request out (admitted, finished or aborted while it waited, or held back
        for a step), uncharged."""
        key = self._queue_of(req)
        heap = self._heaps[key]
        if heap[0][2] is req:  # the head, as most often: no rebuild
            heapq.heappop(heap)
        else:
            heap[:] = [e for e in heap if e[2] is not req]
            heapq.heapify(heap)
        self._len -= 1
        self._drop_if_empty(key)

    def _drop_if_empty(self, key: str) -> None:
        # One heap per tenant waiting now, not per tenant ever seen (ids come from a header).
        if not self._heaps[key]:
            del self._heaps[key]

    def head(self) -> Request | None:
        """The request to admit next (not removed: :meth:`pop` it once admitted); None when empty."""
        heap = self._next_heap()
        return None if heap is None else self._first(heap)

    def pop(self, req: Request) -> None:
        """Take ``req`` (the :meth:`head` just admitted) out of the queue. On its first admission
        its tenant is charged for the prompt tokens it will compute (those not already cached),
        as VTC charges input at dispatch: the next admission of the same step sees it."""
        if req.num_preemptions == 0:
            self.charge(req, max(0, req.num_prompt_tokens - req.num_computed_tokens), 0)
        self.remove(req)

    def finished(self, req: Request) -> None:
        """``req`` left the engine (finished or aborted, from waiting or running)."""
        left = self._active.get(req.tenant, 0) - 1
        if left > 0:
            self._active[req.tenant] = left
        else:
            self._active.pop(req.tenant, None)

    def requests_by_tenant(self) -> dict[str, int]:
        """Requests in the engine (waiting or running) per tenant; a copy."""
        return dict(self._active)

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[Request]:
        for heap in self._heaps.values():
            for entry in heap:
                yield entry[2]

    # --- service and preemption ---------------------------------------------------------------
    def charge(self, req: Request, prompt_tokens: int, output_tokens: int) -> None:
        """Count service to ``req``'s tenant: prompt tokens (charged at admission by :meth:`pop`)
        and output tokens (by the scheduler after each step): VTC's counter update, divided by
        the tenant's weight."""
        if self.policy == "fair":
            self.service.charge(req.tenant, prompt_tokens, output_tokens)

    def seat_victim(self, running: list[Request], max_num_seqs: int) -> tuple[Request, Request] | None:
        """``fair`` with every seat taken: ``(victim, newcomer)``, the running request to preempt
        and the waiting one that takes its seat now, or None.

        Each tenant running or waiting has a target of ``max_num_seqs × its weight ÷ their
        weights' sum`` seats. A seat moves from the tenant furthest above its target (the giver)
        to the waiting tenant furthest below its own (the newcomer) that the giver has been
        served at least as much as (VTC's order: a tenant behind on tokens keeps the seats that
        let it catch up, so weights hold in tokens, not only in seats). Seats so move toward the
        split by weight a step at a time and never back and forth, and a tenant arriving beside a
        flood (lifted to the flood's count) is seated at the next step. The victim is the
        giver's request with the fewest computed tokens (the least to recompute; the newest among
        equals); the newcomer, its tenant's next request."""
        if self.policy != "fair" or len(running) < max_num_seqs or not self._len:
            return None
        seats = dict.fromkeys(self._heaps, 0)
        for r in running:
            seats[r.tenant] = seats.get(r.tenant, 0) + 1
        target = self.service.shares(max_num_seqs, seats)
        served = self.service.served
        giver = max(seats, key=lambda t: (seats[t] - target[t], served(t)))
        if seats[giver] <= target[giver]:
            return None
        takers = [t for t in self._heaps if t != giver and seats[t] < target[t] and served(giver) >= served(t)]
        if not takers:
            return None
        newcomer = min(takers, key=lambda t: (seats[t] - target[t], served(t)))
        victim = min(reversed(running), key=lambda r: (r.tenant != giver, r.num_computed_tokens))
        return victim, self._first(self._heaps[newcomer])

    def protect_order(self, running: list[Request]) -> list[Request]:
        """``running`` reordered (stably) so that the request to preempt first is last."""
        if self.policy == "priority":
            return sorted(running, key=lambda r: r.priority)
        if self.policy == "fair" and len({r.tenant for r in running}) > 1:
            return sorted(running, key=lambda r: self.counters.get(r.tenant, 0.0))
        return running

    # --- inside ---------------------------------------------------------------------------------
    def _queue_of(self, req: Request) -> str:
        return req.tenant if self.policy == "fair" else ""

    def _rank(self, req: Request) -> int:
        return req.priority if self.policy in ("priority", "fair") else 0

    def _next_heap(self) -> list[tuple] | None:
        queued = [(t, h) for t, h in self._heaps.items() if h]
        if not queued:
            return None
        if self.policy != "fair" or len(queued) == 1:
            return queued[0][1]
        # The least-served backlogged tenant; ties (a tenant just lifted to another's count) to the
        # one with fewer requests in the engine, then to the earlier head.
        return min(queued, key=lambda th: (self.counters.get(th[0], 0.0), self._active.get(th[0], 0),
                                           th[1][0][1]))[1]

    def _lift(self, tenant: str) -> None:
        if self.policy == "fair" and not self._active.get(tenant):
            self.service.lift(tenant, self._active)

    def _first(self, heap: list[tuple]) -> Request:
        """The request of ``heap`` to admit next: its top, or under ``fair`` the most cached of
        the first few of equal rank."""
        if self.policy != "fair" or self.cached_blocks is None or len(heap) == 1:
            return heap[0][2]
        return self._prefer_cached(heap)

    def _prefer_cached(self, heap: list[tuple]) -> Request:
        candidates = [e for e in heapq.nsmallest(PREFIX_LOOKAHEAD, heap) if e[0] == heap[0][0]]
        # The most cached blocks; among equals the earliest (max keeps the first of a tie).
        return max(candidates, key=lambda e: self.cached_blocks(e[2]))[2]
