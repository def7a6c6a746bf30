"""Session affinity: 1 on the endpoint that served the request's session last, 0 elsewhere.
Sessions are remembered in a bounded LRU and forgotten with their endpoint."""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from ..plugins import BaseScorer, Choice, CycleState, EndpointLoad, RouteRequest

_AFFINE = "affinity.endpoint"  # CycleState.notes key: this request's remembered endpoint


class AffinityScorer(BaseScorer):
    """capacity: session keys remembered (the least recently used go first)."""

    name = "affinity"

    def __init__(self, capacity: int = 100_000):
        self.capacity = capacity
        self._sessions: OrderedDict[str, str] = OrderedDict()

    def score(self, request: RouteRequest, endpoints: Sequence[EndpointLoad], state: CycleState) -> list[float]:
        affine = self._sessions.get(request.session) if request.session is not None else None
        state.notes[_AFFINE] = affine
        return [1.0 if affine is not None and e.name == affine else 0.0 for e in endpoints]

    def reason(self, endpoint: str, state: CycleState) -> str | None:
        return "affinity" if endpoint == state.notes.get(_AFFINE) else None

    def record(self, request: RouteRequest, choice: Choice) -> None:
        if request.session is None:
            return
        self._sessions[request.session] = choice.endpoint
        self._sessions.move_to_end(request.session)
        while len(self._sessions) > self.capacity:
            self._sessions.popitem(last=False)

    def forget(self, endpoint: str) -> None:
        for session in [s for s, e in self._sessions.items() if e == endpoint]:
            del self._sessions[session]
