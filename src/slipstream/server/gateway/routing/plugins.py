"""The routing plugin protocols, in the shape of llm-d's endpoint picker: a request passes the
profile's :class:`Filter` s, each :class:`Scorer` scores every endpoint left in [0, 1], and the
:class:`Picker` chooses one from the weighted sums. Plus the values they pass around: what the
router reads of a request (:class:`RouteRequest`) and of an endpoint (:class:`EndpointLoad`),
one pick's scratch space (:class:`CycleState`) and the decision (:class:`Choice`).

All pure: no I/O, no clock. A plugin that keeps state between requests (the prefix table, the
session map) also implements :class:`Learner`, so the router tells it where a request went and
which endpoint went away.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence, runtime_checkable


@dataclass(frozen=True, slots=True)
class EndpointLoad:
    """One endpoint as the router sees it: the pod's last scrape plus what only the gateway knows.

    This is the router's view, not the scraped sample
    (:class:`slipstream.api_types.load.PodLoad`): ``in_flight`` is the gateway's own count,
    fresher than any scrape, and ``capacity`` comes from the gateway's settings; the simulator
    builds it from a virtual replica without any scrape.

    name: the endpoint's identity (a URL or ``ip:port``), stable while it lives.
    waiting / running: requests queued and in the running batch, as last scraped
        (``slipstream:num_requests_waiting`` / ``_running``).
    kv_cache_usage: fraction of KV blocks in use, 0..1, as last scraped.
    in_flight: requests this router has sent there and not seen finish.
    capacity: the most requests in flight there before it counts as full (the pod's
        ``max_num_seqs`` plus queue headroom, at most ``accepts``); None for no limit.
    accepts: the most requests the pod itself takes before it answers 429 (``max_num_seqs``
        plus its ``--max-waiting``); None when unknown.
    """

    name: str
    waiting: float = 0.0
    running: float = 0.0
    kv_cache_usage: float = 0.0
    in_flight: int = 0
    capacity: int | None = None
    accepts: int | None = None

    @property
    def load(self) -> float:
        """Requests the endpoint holds: the scrape's count, or this router's own when higher
        (requests sent since the last scrape)."""
        return max(self.waiting + self.running, float(self.in_flight))

    @property
    def full(self) -> bool:
        return self.capacity is not None and self.in_flight >= self.capacity


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What routing reads of a request.

    block_hashes: chained hashes of the prompt's full blocks (:func:`prompt_block_hashes`);
        empty when the prompt was not tokenized (the prefix scores are then 0 everywhere).
    session: a session key (a header, ``user`` or ``prompt_cache_key``), or None.
    """

    block_hashes: tuple[bytes, ...] = ()
    session: str | None = None


@dataclass(frozen=True, slots=True)
class Choice:
    """The router's decision.

    endpoint: the chosen endpoint's name. reason: why, for metrics and logs (``round-robin``,
    ``least-loaded``, ``prefix-hit``, ``affinity``, ``load``, or a scorer's own). matched_blocks:
    leading prompt blocks the index says the endpoint holds. score: the winning weighted sum (0
    for the pickers that do not score).
    """

    endpoint: str
    reason: str
    matched_blocks: int = 0
    score: float = 0.0


@dataclass(slots=True)
class CycleState:
    """One pick's scratch space, shared by the profile's plugins (llm-d's CycleState).

    matched_blocks: endpoint name → leading prompt blocks it holds, set by a prefix scorer.
    notes: anything else a plugin wants a later one (or its own ``reason``) to see.
    """

    matched_blocks: dict[str, int] = field(default_factory=dict)
    notes: dict[str, Any] = field(default_factory=dict)


class Filter(Protocol):
    """Drops endpoints that must not take the request."""

    name: str

    def filter(self, request: RouteRequest, endpoints: Sequence[EndpointLoad],
               state: CycleState) -> list[EndpointLoad]:
        """The endpoints that may take ``request``, in the order given."""
        ...


class Scorer(Protocol):
    """Scores endpoints for a request by one signal.

    name: the scorer's registry name. The router multiplies its scores by the weight its
    registration names (:class:`~.registry.ScorerEntry`). reads_prompt_blocks / reads_kv_events:
    True when it needs the request's block hashes / the pods' KV events, so the gateway tokenizes
    prompts and subscribes to events only when a profile's scorer uses them.
    """

    name: str
    reads_prompt_blocks: bool
    reads_kv_events: bool

    def score(self, request: RouteRequest, endpoints: Sequence[EndpointLoad], state: CycleState) -> list[float]:
        """One score per endpoint, in [0, 1] (higher is better), in the order given; never
        called with no endpoint."""
        ...

    def reason(self, endpoint: str, state: CycleState) -> str | None:
        """Why the chosen ``endpoint`` won, when this scorer's signal explains it; else None."""
        ...


class Picker(Protocol):
    """Chooses one endpoint from the filtered ones and their weighted scores."""

    name: str

    def pick(self, endpoints: Sequence[EndpointLoad], scores: Sequence[float]) -> tuple[EndpointLoad, str | None]:
        """The chosen endpoint and, for pickers that decide by something other than the scores,
        the reason (``round-robin``, ``least-loaded``); None lets the scorers explain it.
        ``endpoints`` is never empty and sorted by name; ``scores`` aligns with it (all 0 when
        the profile has no scorer)."""
        ...


@runtime_checkable
class Learner(Protocol):
    """A plugin with state between requests."""

    def record(self, request: RouteRequest, choice: Choice) -> None:
        """``request`` went to ``choice.endpoint`` (the send succeeded)."""
        ...

    def forget(self, endpoint: str) -> None:
        """``endpoint`` went away: drop what is known of it."""
        ...


class BaseScorer:
    """Defaults for a :class:`Scorer`: reads neither prompt blocks nor KV events and explains
    nothing. Subclasses set ``name`` and write :meth:`score`."""

    name = ""
    reads_prompt_blocks = False
    reads_kv_events = False

    def score(self, request: RouteRequest, endpoints: Sequence[EndpointLoad], state: CycleState) -> list[float]:
        raise NotImplementedError(f"{type(self).__name__} must define score()")

    def reason(self, endpoint: str, state: CycleState) -> str | None:
        return None
