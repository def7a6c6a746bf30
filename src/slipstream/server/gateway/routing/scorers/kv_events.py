"""Precise prefix-cache awareness: the fraction of the prompt's full blocks each pod's KV cache
holds, by the :class:`~..index.BlockIndex` the pods' KV-cache events keep (llm-d's precise
prefix-cache scorer does the same with vLLM's events). The index is the router's (the event
subscriber feeds it); this scorer only reads it."""
from __future__ import annotations

from typing import Sequence

from ..index import BlockIndex
from ..plugins import BaseScorer, CycleState, EndpointLoad, RouteRequest
from .prefix import prefix_reason, prefix_scores


class KVEventsScorer(BaseScorer):
    name = "kv_events"
    reads_prompt_blocks = True
    reads_kv_events = True

    def __init__(self, index: BlockIndex):
        self.index = index

    def score(self, request: RouteRequest, endpoints: Sequence[EndpointLoad], state: CycleState) -> list[float]:
        return prefix_scores(self.index, request, endpoints, state)

    def reason(self, endpoint: str, state: CycleState) -> str | None:
        return prefix_reason(endpoint, state)
