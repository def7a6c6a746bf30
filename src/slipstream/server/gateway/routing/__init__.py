"""Routing policy: which endpoint serves a request. Pure (no I/O); the gateway and
``slipstream simulate`` both import it.

Policies (``--routing``):

- ``round-robin``: endpoints in turn, blind to load (what a ClusterIP Service does).
- ``least-loaded``: the fewest requests queued and running.
- ``prefix``: approximate prefix-cache awareness. The router remembers which endpoint it sent
  each prompt block to (a bounded LRU :class:`PrefixTable`) and scores endpoints by how many of
  the prompt's leading blocks it sent there, combined with load. The table is this router's own
  view: another gateway replica has another.
- ``kv-events``: precise prefix-cache awareness. The same scoring over a :class:`BlockIndex`
  that the pods' own KV-cache events keep (blocks stored and evicted, by the engine's chained
  block hash from :mod:`slipstream.server.kv_hash`), so every gateway replica sees what the pods
  hold (llm-d's precise prefix-cache scorer does the same with vLLM's KV events).

Scores combine weighted terms in [0, 1] as llm-d's scorers do: the fraction of the prompt's full
blocks cached on the endpoint, a queue term (1 for the least loaded endpoint, less the more
requests it holds beyond it),
free KV cache, and session affinity (the endpoint that served the same session before). An
endpoint whose in-flight count has reached its capacity is skipped; when every endpoint is
skipped or none exists, :meth:`Router.pick` returns None and the caller holds the request.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Mapping, Protocol, Sequence

from slipstream.api_types.routing import DEFAULT_POLICY, DEFAULT_WEIGHTS, POLICIES  # noqa: F401 (re-exported)

TIE = 1e-9  # scores this close are equal (sums of float terms)


@dataclass(frozen=True, slots=True)
class EndpointLoad:
    """One endpoint as the router sees it.

    name: the endpoint's identity (a URL or ``ip:port``), stable while it lives.
    waiting / running: requests queued and in the running batch, as last scraped
        (``slipstream:num_requests_waiting`` / ``_running``).
    kv_cache_usage: fraction of KV blocks in use, 0..1, as last scraped.
    in_flight: requests this router has sent there and not seen finish (fresher than a scrape).
    capacity: the most requests in flight there before it counts as full (the pod's
        ``max_num_seqs`` plus queue headroom); None for no limit.
    """

    name: str
    waiting: float = 0.0
    running: float = 0.0
    kv_cache_usage: float = 0.0
    in_flight: int = 0
    capacity: int | None = None

    @property
    def load(self) -> float:
        """Requests the endpoint holds: the scrape's count, or this router's own when higher
        (requests sent since the last scrape)."""
        return max(self.waiting + self.running, float(self.in_flight))

    @property
    def full(self) -> bool:
        return self.capacity is not None and self.in_flight >= self.capacity


@dataclass(frozen=True, slots=True)
class Weights:
    """Weights of the score's terms (llm-d's scorer weights play the same role)."""

    prefix: float = DEFAULT_WEIGHTS["prefix"]
    queue: float = DEFAULT_WEIGHTS["queue"]
    kv_cache: float = DEFAULT_WEIGHTS["kv_cache"]
    affinity: float = DEFAULT_WEIGHTS["affinity"]
    # Requests of load difference that cost the whole queue weight: below it the queue term
    # shrinks in proportion, so one request more does not outweigh a cached prompt.
    queue_scale: float = 8.0

    def __post_init__(self) -> None:
        for name in DEFAULT_WEIGHTS:
            if getattr(self, name) < 0:
                raise ValueError(f"routing weight {name} must be >= 0, got {getattr(self, name)}")
        if self.queue_scale <= 0:
            raise ValueError(f"routing queue_scale must be > 0, got {self.queue_scale}")


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What routing reads of a request.

    block_hashes: chained hashes of the prompt's full blocks (:func:`prompt_block_hashes`);
        empty when the prompt was not tokenized (the prefix term is then 0 everywhere).
    session: a session key (a header, ``user`` or ``prompt_cache_key``), or None.
    """

    block_hashes: tuple[bytes, ...] = ()
    session: str | None = None


@dataclass(frozen=True, slots=True)
class Choice:
    """The router's decision.

    endpoint: the chosen endpoint's name. reason: why, for metrics and logs (``round-robin``,
    ``least-loaded``, ``prefix-hit``, ``affinity``, ``load``). matched_blocks: leading prompt
    blocks the index says the endpoint holds. score: the winning score (0 for the blind policies).
    """

    endpoint: str
    reason: str
    matched_blocks: int = 0
    score: float = 0.0


class PrefixIndex(Protocol):
    def match(self, block_hashes: Sequence[bytes]) -> dict[str, int]:
        """Endpoint name → how many leading blocks of ``block_hashes`` it holds (only > 0)."""
        ...


def _leading_matches(block_hashes: Sequence[bytes], holders) -> dict[str, int]:
    """Walk the chain from the first block; an endpoint's count stops at its first missing block
    (a chained hash names the whole prefix, so a later hit after a miss cannot be used)."""
    matched: dict[str, int] = {}
    alive: set[str] | None = None
    for i, h in enumerate(block_hashes):
        have = holders(h)
        if not have:
            break
        alive = set(have) if alive is None else alive & set(have)
        if not alive:
            break
        for endpoint in alive:
            matched[endpoint] = i + 1
    return matched


class PrefixTable:
    """Approximate index: block hash → the endpoints this router sent it to, LRU-bounded.

    capacity: most block hashes remembered (each costs ~200 bytes); the least recently routed
    go first. Raises ValueError for a capacity below 1.
    """

    def __init__(self, capacity: int = 200_000):
        if capacity < 1:
            raise ValueError(f"prefix table capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._blocks: OrderedDict[bytes, set[str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, block_hashes: Sequence[bytes]) -> dict[str, int]:
        return _leading_matches(block_hashes, lambda h: self._blocks.get(h))

    def record(self, block_hashes: Iterable[bytes], endpoint: str) -> None:
        """Remember that ``endpoint`` got (and will cache) these blocks."""
        for h in block_hashes:
            holders = self._blocks.get(h)
            if holders is None:
                self._blocks[h] = {endpoint}
            else:
                holders.add(endpoint)
                self._blocks.move_to_end(h)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)

    def forget(self, endpoint: str) -> None:
        """Drop an endpoint that went away (its cache went with it)."""
        for h in [h for h, holders in self._blocks.items() if endpoint in holders]:
            holders = self._blocks[h]
            holders.discard(endpoint)
            if not holders:
                del self._blocks[h]


class BlockIndex:
    """Precise index: block hash → endpoints whose KV cache holds it, kept by their KV events.

    capacity: most (block, endpoint) entries kept; past it an endpoint's oldest entries go
    (a pod's cache is bounded, so this only guards against a runaway stream).
    """

    def __init__(self, capacity: int = 2_000_000):
        if capacity < 1:
            raise ValueError(f"block index capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._holders: dict[bytes, set[str]] = {}
        self._blocks: dict[str, OrderedDict[bytes, None]] = {}
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def endpoints(self) -> list[str]:
        return list(self._blocks)

    def blocks_of(self, endpoint: str) -> int:
        return len(self._blocks.get(endpoint, ()))

    def match(self, block_hashes: Sequence[bytes]) -> dict[str, int]:
        return _leading_matches(block_hashes, lambda h: self._holders.get(h))

    def stored(self, endpoint: str, block_hashes: Iterable[bytes]) -> None:
        """``endpoint`` cached these blocks."""
        mine = self._blocks.setdefault(endpoint, OrderedDict())
        for h in block_hashes:
            if h in mine:
                mine.move_to_end(h)
                continue
            mine[h] = None
            self._holders.setdefault(h, set()).add(endpoint)
            self._size += 1
        while self._size > self.capacity and mine:
            self._drop(endpoint, next(iter(mine)))

    def removed(self, endpoint: str, block_hashes: Iterable[bytes]) -> None:
        """``endpoint`` evicted these blocks."""
        for h in block_hashes:
            self._drop(endpoint, h)

    def replace(self, endpoint: str, block_hashes: Iterable[bytes]) -> None:
        """``endpoint`` holds exactly these blocks (a snapshot, e.g. after a reconnect)."""
        self.forget(endpoint)
        self.stored(endpoint, block_hashes)

    def forget(self, endpoint: str) -> None:
        """``endpoint`` is gone or its cache was cleared."""
        for h in list(self._blocks.get(endpoint, ())):
            self._drop(endpoint, h)
        self._blocks.pop(endpoint, None)

    def _drop(self, endpoint: str, h: bytes) -> None:
        mine = self._blocks.get(endpoint)
        if mine is None or h not in mine:
            return
        del mine[h]
        self._size -= 1
        holders = self._holders.get(h)
        if holders is not None:
            holders.discard(endpoint)
            if not holders:
                del self._holders[h]


def score_endpoints(endpoints: Sequence[EndpointLoad], request: RouteRequest, matches: Mapping[str, int],
                    affine: str | None, weights: Weights) -> list[tuple[float, EndpointLoad]]:
    """Each endpoint's score (higher is better), in the order given.

    matches: endpoint → leading blocks of the request it holds. affine: the endpoint that served
    the request's session before, or None. Terms, each in [0, 1]: prefix = matched / the
    prompt's full blocks; queue = (most load - this load) / max(most - least,
    ``weights.queue_scale``), so 1 for the least loaded; kv_cache = 1 - usage; affinity = 1 on
    the affine endpoint.
    """
    blocks = len(request.block_hashes)
    loads = [e.load for e in endpoints]
    low, high = (min(loads), max(loads)) if loads else (0.0, 0.0)
    scored = []
    for e in endpoints:
        prefix = matches.get(e.name, 0) / blocks if blocks else 0.0
        queue = (high - e.load) / max(high - low, weights.queue_scale)
        kv = 1.0 - min(1.0, max(0.0, e.kv_cache_usage))
        affinity = 1.0 if affine is not None and e.name == affine else 0.0
        scored.append((weights.prefix * prefix + weights.queue * queue + weights.kv_cache * kv
                       + weights.affinity * affinity, e))
    return scored


class Router:
    """One routing policy with the state it needs between requests.

    policy: one of :data:`POLICIES`. weights: the score's weights (prefix and kv-events).
    block_index: the KV-event index (kv-events; the caller feeds it). prefix_capacity: block
    hashes the ``prefix`` policy's table keeps. sessions: session keys remembered for affinity.
    Raises ValueError for an unknown policy.
    """

    def __init__(self, policy: str = DEFAULT_POLICY, *, weights: Weights | None = None,
                 block_index: BlockIndex | None = None, prefix_capacity: int = 200_000,
                 sessions: int = 100_000):
        if policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.policy = policy
        self.weights = weights or Weights()
        self.prefix_table = PrefixTable(prefix_capacity)
        self.block_index = block_index if block_index is not None else BlockIndex()
        self._sessions: OrderedDict[str, str] = OrderedDict()
        self._session_capacity = sessions
        self._turn = itertools.count()

    @property
    def index(self) -> PrefixIndex | None:
        return {"prefix": self.prefix_table, "kv-events": self.block_index}.get(self.policy)

    def pick(self, request: RouteRequest, endpoints: Sequence[EndpointLoad]) -> Choice | None:
        """The endpoint for ``request`` among ``endpoints`` (ready ones only), or None when
        none is ready or every one is full (the caller holds the request and asks again)."""
        open_ = sorted((e for e in endpoints if not e.full), key=lambda e: e.name)
        if not open_:
            return None
        if self.policy == "round-robin":
            return Choice(open_[next(self._turn) % len(open_)].name, "round-robin")
        if self.policy == "least-loaded":
            best = min(open_, key=lambda e: (e.load, e.kv_cache_usage, e.name))
            return Choice(best.name, "least-loaded")
        index = self.index
        matches = index.match(request.block_hashes) if index is not None and request.block_hashes else {}
        affine = self._sessions.get(request.session) if request.session is not None else None
        scored = score_endpoints(open_, request, matches, affine, self.weights)
        top = max(score for score, _ in scored)
        tied = [e for score, e in scored if score >= top - TIE]
        least = min(e.load for e in tied)
        tied = [e for e in tied if e.load == least]
        # Equal scores take turns: always the same one would pile new prefixes onto one idle pod.
        best, score = tied[next(self._turn) % len(tied)], top
        matched = matches.get(best.name, 0)
        reason = "prefix-hit" if matched else "affinity" if best.name == affine else "load"
        return Choice(best.name, reason, matched, score)

    def record(self, request: RouteRequest, choice: Choice) -> None:
        """Note that ``request`` went to ``choice.endpoint`` (after the send succeeded)."""
        if self.policy == "prefix" and request.block_hashes:
            self.prefix_table.record(request.block_hashes, choice.endpoint)
        if request.session is not None:
            self._sessions[request.session] = choice.endpoint
            self._sessions.move_to_end(request.session)
            while len(self._sessions) > self._session_capacity:
                self._sessions.popitem(last=False)

    def forget(self, endpoint: str) -> None:
        """An endpoint went away: drop what the router knew of it."""
        self.prefix_table.forget(endpoint)
        self.block_index.forget(endpoint)
        for session in [s for s, e in self._sessions.items() if e == endpoint]:
            del self._sessions[session]
