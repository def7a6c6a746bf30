"""The router: one ``--routing`` policy's plugins, built once, and the state they keep."""
from __future__ import annotations

from typing import Mapping, Sequence

from slipstream.api_types.routing import DEFAULT_POLICY, POLICIES

from . import registry
from .index import BlockIndex
from .plugins import Choice, CycleState, EndpointLoad, Learner, RouteRequest
from .profiles import PROFILES, Profile
from .weights import Weights


class Router:
    """Picks an endpoint per request with a profile's filters, scorers and picker.

    policy: one of :data:`~slipstream.api_types.routing.POLICIES` (its profile in
        :data:`~.profiles.PROFILES`), or a :class:`~.profiles.Profile` of one's own.
    weights: score weights by key (:class:`~.weights.Weights` or a mapping it accepts).
    block_index: the KV-event index (the caller feeds it; a new one by default).
    prefix_capacity / sessions: bounds of the prefix table and the session map.
    Raises ValueError for an unknown policy, plugin name or weight.
    """

    def __init__(self, policy: str | Profile = DEFAULT_POLICY, *, weights: Mapping[str, float] | None = None,
                 block_index: BlockIndex | None = None, prefix_capacity: int = 200_000,
                 sessions: int = 100_000):
        if isinstance(policy, Profile):
            profile = policy
        elif policy in PROFILES:
            profile = PROFILES[policy]
        else:
            raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.profile = profile
        self.policy = profile.name
        self.weights = weights if isinstance(weights, Weights) else Weights(weights)
        self.block_index = block_index if block_index is not None else BlockIndex()
        context = registry.BuildContext(self.block_index, prefix_capacity, sessions)
        self.filters = [_lookup(registry.FILTERS, "filter", name)() for name in profile.filters]
        entries = [_lookup(registry.SCORERS, "scorer", name) for name in profile.scorers]
        self.scorers = [(entry.build(context), self.weights[entry.weight]) for entry in entries]
        self.picker = _lookup(registry.PICKERS, "picker", profile.picker)()
        self._learners = [p for p in (*self.filters, *(s for s, _ in self.scorers), self.picker)
                          if isinstance(p, Learner)]

    @property
    def reads_prompt_blocks(self) -> bool:
        """A scorer reads the prompt's block hashes (the gateway tokenizes prompts)."""
        return any(s.reads_prompt_blocks for s, _ in self.scorers)

    @property
    def reads_kv_events(self) -> bool:
        """A scorer reads the pods' KV events (the gateway subscribes to them)."""
        return any(s.reads_kv_events for s, _ in self.scorers)

    def score(self, request: RouteRequest, endpoints: Sequence[EndpointLoad],
              state: CycleState | None = None) -> list[float]:
        """Each endpoint's weighted score (the sum over the profile's scorers of weight × score,
        in profile order), aligned with ``endpoints``; all 0 without scorers or endpoints."""
        totals = [0.0] * len(endpoints)
        if not endpoints:
            return totals
        state = state if state is not None else CycleState()
        for scorer, weight in self.scorers:
            for i, value in enumerate(scorer.score(request, endpoints, state)):
                totals[i] += weight * value
        return totals

    def pick(self, request: RouteRequest, endpoints: Sequence[EndpointLoad]) -> Choice | None:
        """The endpoint for ``request`` among ``endpoints`` (ready ones only), or None when
        none is ready or the filters drop every one (the caller holds the request and asks again)."""
        state = CycleState()
        open_ = sorted(endpoints, key=lambda e: e.name)
        for f in self.filters:
            open_ = f.filter(request, open_, state)
        if not open_:
            return None
        picked = self.picker.pick(open_, self.score(request, open_, state))
        name = picked.endpoint.name
        reason = picked.reason
        for scorer, _ in self.scorers:
            if reason is not None:
                break
            reason = scorer.reason(name, state)
        return Choice(name, reason or "load", state.matched_blocks.get(name, 0), picked.score)

    def record(self, request: RouteRequest, choice: Choice) -> None:
        """Note that ``request`` went to ``choice.endpoint`` (after the send succeeded)."""
        for learner in self._learners:
            learner.record(request, choice)

    def forget(self, endpoint: str) -> None:
        """An endpoint went away: drop what the router knew of it."""
        for learner in self._learners:
            learner.forget(endpoint)
        self.block_index.forget(endpoint)


def _lookup(table: Mapping, kind: str, name: str):
    try:
        return table[name]
    except KeyError:
        raise ValueError(f"routing {kind} {name!r} is not registered; known: {', '.join(table)}") from None
