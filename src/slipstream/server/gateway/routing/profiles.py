"""Profiles: what each ``--routing`` policy runs — its filters, its scorers (each weighted by
the weight its registration names) and its picker, by registry name."""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping


@dataclass(frozen=True, slots=True)
class Profile:
    """name: the policy it serves. filters / scorers / picker: names in :mod:`.registry`;
    scorers in the order their weighted scores are summed and asked for a reason."""

    name: str
    filters: tuple[str, ...] = ("not-full",)
    scorers: tuple[str, ...] = ()
    picker: str = "max-score"


_SCORED = ("queue", "kv_cache", "affinity")

PROFILES: Mapping[str, Profile] = MappingProxyType({
    "round-robin": Profile("round-robin", picker="round-robin"),
    "least-loaded": Profile("least-loaded", picker="least-loaded"),
    "prefix": Profile("prefix", scorers=("prefix", *_SCORED)),
    "kv-events": Profile("kv-events", scorers=("kv_events", *_SCORED)),
})
