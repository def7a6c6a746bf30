"""A short queue: 1 for the least loaded endpoint, less the more requests one holds beyond it."""
from __future__ import annotations

from typing import Sequence

from ..plugins import BaseScorer, CycleState, EndpointLoad, RouteRequest

# Requests of load difference that cost the whole queue weight: below it the score shrinks in
# proportion, so one request more does not outweigh a cached prompt.
DEFAULT_QUEUE_SCALE = 8.0


class QueueScorer(BaseScorer):
    """(most load − this load) / max(most − least, ``scale``), load being
    :attr:`EndpointLoad.load` (requests). Raises ValueError for a scale ≤ 0."""

    name = "queue"

    def __init__(self, scale: float = DEFAULT_QUEUE_SCALE):
        if not scale > 0:
            raise ValueError(f"routing queue_scale must be > 0 requests, got {scale}")
        self.scale = scale

    def score(self, request: RouteRequest, endpoints: Sequence[EndpointLoad], state: CycleState) -> list[float]:
        loads = [e.load for e in endpoints]
        low, high = min(loads), max(loads)
        spread = max(high - low, self.scale)
        return [(high - load) / spread for load in loads]
