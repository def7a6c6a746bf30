"""Pickers: the one endpoint a request goes to, from the filtered endpoints (sorted by name) and
their weighted scores."""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

from .plugins import EndpointLoad

TIE = 1e-9  # scores this close are equal (sums of float terms)


@dataclass(frozen=True, slots=True)
class Picked:
    """A picker's answer: the endpoint, its score, and the reason when the picker itself decided
    (None: the profile's scorers explain it)."""

    endpoint: EndpointLoad
    score: float = 0.0
    reason: str | None = None


class RoundRobin:
    """Endpoints in turn, blind to scores and load (what a ClusterIP Service does)."""

    name = "round-robin"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def pick(self, endpoints: Sequence[EndpointLoad], scores: Sequence[float]) -> Picked:
        return Picked(endpoints[next(self._turn) % len(endpoints)], reason="round-robin")


class LeastLoaded:
    """The fewest requests queued and running (:attr:`EndpointLoad.load`), then the least KV use,
    then the name."""

    name = "least-loaded"

    def pick(self, endpoints: Sequence[EndpointLoad], scores: Sequence[float]) -> Picked:
        return Picked(min(endpoints, key=lambda e: (e.load, e.kv_cache_usage, e.name)), reason="least-loaded")


class MaxScore:
    """The best weighted sum. Scores within :data:`TIE` of the best tie; among those the least
    loaded, and equal ones take turns (always the same one would pile new prefixes onto one idle
    pod). The score reported is the best."""

    name = "max-score"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def pick(self, endpoints: Sequence[EndpointLoad], scores: Sequence[float]) -> Picked:
        top = max(scores)
        tied = [e for score, e in zip(scores, endpoints) if score >= top - TIE]
        least = min(e.load for e in tied)
        tied = [e for e in tied if e.load == least]
        return Picked(tied[next(self._turn) % len(tied)], top)
