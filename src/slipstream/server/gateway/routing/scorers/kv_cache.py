"""Free KV cache: 1 − the fraction of KV blocks in use, as last scraped."""
from __future__ import annotations

from typing import Sequence

from ..plugins import BaseScorer, CycleState, EndpointLoad, RouteRequest


class KVCacheScorer(BaseScorer):
    name = "kv_cache"

    def score(self, request: RouteRequest, endpoints: Sequence[EndpointLoad], state: CycleState) -> list[float]:
        return [1.0 - min(1.0, max(0.0, e.kv_cache_usage)) for e in endpoints]
