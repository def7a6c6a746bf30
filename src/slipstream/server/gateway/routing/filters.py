"""Filters: endpoints a request must not go to, whatever their scores."""
from __future__ import annotations

from typing import Sequence

from .plugins import CycleState, EndpointLoad, RouteRequest


class NotFull:
    """Drops endpoints whose in-flight count has reached their capacity (:attr:`EndpointLoad.full`):
    when every one is dropped the router returns None and the caller holds the request."""

    name = "not-full"

    def filter(self, request: RouteRequest, endpoints: Sequence[EndpointLoad],
               state: CycleState) -> list[EndpointLoad]:
        return [e for e in endpoints if not e.full]
