"""The plugins by name: what a :class:`~.profiles.Profile` names and what the weights are keyed by.

A new scorer is its module under ``scorers/`` plus one :func:`register_scorer` call (here for the
built-in ones; anywhere before the router is built for others); naming it in a profile, or
building a :class:`~.router.Router` with a profile of one's own, routes with it. Its weight key
gets a ``--weight-*`` flag in ``slipstream gateway`` and ``slipstream simulate``
(:func:`~.weights.add_weight_flags`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from slipstream.api_types.routing import DEFAULT_WEIGHTS

from .filters import NotFull
from .index import BlockIndex
from .pickers import LeastLoaded, MaxScore, RoundRobin
from .plugins import Filter, Picker, Scorer
from .scorers.affinity import AffinityScorer
from .scorers.kv_cache import KVCacheScorer
from .scorers.kv_events import KVEventsScorer
from .scorers.prefix import PrefixScorer
from .scorers.queue import QueueScorer


@dataclass(frozen=True, slots=True)
class BuildContext:
    """What a router hands its scorers' factories: the KV-event index it owns and the bounds of
    the state scorers keep (prefix table entries, session keys)."""

    block_index: BlockIndex
    prefix_capacity: int = 200_000
    sessions: int = 100_000


@dataclass(frozen=True, slots=True)
class ScorerEntry:
    """build: makes the scorer for one router. weight: the weight key that scales its scores
    (its own name, or a name it shares with a scorer of the same signal: both prefix scorers are
    ``prefix``). default_weight: that weight's default. help: the weight flag's help."""

    build: Callable[[BuildContext], Scorer]
    weight: str
    default_weight: float
    help: str


SCORERS: dict[str, ScorerEntry] = {}
FILTERS: dict[str, Callable[[], Filter]] = {"not-full": NotFull}
PICKERS: dict[str, Callable[[], Picker]] = {"round-robin": RoundRobin, "least-loaded": LeastLoaded,
                                            "max-score": MaxScore}


def register_scorer(name: str, build: Callable[[BuildContext], Scorer], *, help: str,
                    weight: str | None = None, default_weight: float | None = None) -> None:
    """Make scorer ``name`` known. weight: the weight key (default ``name``); default_weight:
    required for a key the contract (:data:`~slipstream.api_types.routing.DEFAULT_WEIGHTS`) does
    not define. Raises ValueError for a taken name or a default that disagrees with the key's."""
    weight = weight or name
    if name in SCORERS:
        raise ValueError(f"scorer {name!r} is registered already")
    known = weight_defaults()
    if default_weight is None:
        if weight not in known:
            raise ValueError(f"scorer {name!r}: weight {weight!r} has no default; pass default_weight")
        default_weight = known[weight]
    elif weight in known and known[weight] != default_weight:
        raise ValueError(f"scorer {name!r}: weight {weight!r} defaults to {known[weight]} already, "
                         f"not {default_weight}")
    SCORERS[name] = ScorerEntry(build, weight, float(default_weight), help)


def weight_defaults() -> dict[str, float]:
    """Every weight key with its default: the contract's first (in its order), then those only
    registered scorers define."""
    defaults = dict(DEFAULT_WEIGHTS)
    for entry in SCORERS.values():
        defaults.setdefault(entry.weight, entry.default_weight)
    return defaults


def weight_help(key: str) -> str:
    """The help of weight ``key``: its first scorer's. Raises KeyError for an unknown key."""
    return next(entry.help for entry in SCORERS.values() if entry.weight == key)


register_scorer("prefix", lambda ctx: PrefixScorer(ctx.prefix_capacity),
                help="score weight of the fraction of the prompt's blocks an endpoint holds")
register_scorer("kv_events", lambda ctx: KVEventsScorer(ctx.block_index), weight="prefix",
                help="score weight of the fraction of the prompt's blocks an endpoint's KV cache holds")
register_scorer("queue", lambda ctx: QueueScorer(), help="score weight of a short queue")
register_scorer("kv_cache", lambda ctx: KVCacheScorer(), help="score weight of free KV cache")
register_scorer("affinity", lambda ctx: AffinityScorer(ctx.sessions),
                help="score weight of the endpoint that served the same session (X-Session-Id, "
                     "prompt_cache_key or user) before")
