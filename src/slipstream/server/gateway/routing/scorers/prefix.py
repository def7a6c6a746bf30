"""Approximate prefix-cache awareness: the fraction of the prompt's full blocks this router sent
to each endpoint before (its own :class:`~..index.PrefixTable`), so requests that share a prefix
go where it is probably cached."""
from __future__ import annotations

from typing import Sequence

from ..index import PrefixIndex, PrefixTable
from ..plugins import BaseScorer, Choice, CycleState, EndpointLoad, RouteRequest


def prefix_scores(index: PrefixIndex, request: RouteRequest, endpoints: Sequence[EndpointLoad],
                  state: CycleState) -> list[float]:
    """Matched leading blocks / the prompt's full blocks, per endpoint (0 for a prompt without
    blocks), divided by 1 + the endpoint's waiting requests. Leaves the matches in
    ``state.matched_blocks``.

    Why the division: a cache hit saves the prefix's prefill, but a request queued behind others
    waits for their whole decode first, which soon costs more than recomputing the prefix on a
    pod with a free seat. Undivided, a hot prefix (one system prompt for every request) stays on
    one pod however long its queue grows; divided, once its pod has a queue the load terms win,
    a second pod gets the prefix too, and from then on the two share it."""
    blocks = len(request.block_hashes)
    if not blocks:
        return [0.0] * len(endpoints)
    state.matched_blocks = matches = index.match(request.block_hashes)
    return [matches.get(e.name, 0) / blocks / (1.0 + max(0.0, e.waiting)) for e in endpoints]


def prefix_reason(endpoint: str, state: CycleState) -> str | None:
    return "prefix-hit" if state.matched_blocks.get(endpoint, 0) else None


class PrefixScorer(BaseScorer):
    """capacity: block hashes the table keeps (LRU). Raises ValueError below 1."""

    name = "prefix"
    reads_prompt_blocks = True

    def __init__(self, capacity: int = 200_000):
        self.table = PrefixTable(capacity)

    def score(self, request: RouteRequest, endpoints: Sequence[EndpointLoad], state: CycleState) -> list[float]:
        return prefix_scores(self.table, request, endpoints, state)

    def reason(self, endpoint: str, state: CycleState) -> str | None:
        return prefix_reason(endpoint, state)

    def record(self, request: RouteRequest, choice: Choice) -> None:
        if request.block_hashes:
            self.table.record(request.block_hashes, choice.endpoint)

    def forget(self, endpoint: str) -> None:
        self.table.forget(endpoint)
