"""The score weights by scorer name, and their ``--weight-*`` flags (one per weight key the
registry knows, named by :func:`~slipstream.api_types.routing.cli_flag`) for ``slipstream
gateway`` and ``slipstream simulate``."""
from __future__ import annotations

import argparse
from typing import Iterator, Mapping

from slipstream.api_types.routing import check_weights, cli_flag

from ...cli_types import finite_non_negative_float

from . import registry


class Weights(Mapping[str, float]):
    """Weight by weight key (``prefix``, ``queue``, ``kv_cache``, ``affinity``, and those of
    registered scorers), every key present: the given ones over the defaults
    (:func:`~.registry.weight_defaults`). Immutable and hashable.

    ``Weights(prefix=2.0)`` or ``Weights({"kv_cache": 0.0})``. Raises ValueError for an unknown
    key, a weight below 0 or not a number, or all weights 0 (every endpoint would score the same).
    """

    __slots__ = ("_by_name",)

    def __init__(self, weights: Mapping[str, float] | None = None, /, **by_name: float):
        self._by_name = check_weights({**(weights or {}), **by_name}, "routing weights",
                                      registry.weight_defaults())

    def __getitem__(self, key: str) -> float:
        return self._by_name[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_name)

    def __len__(self) -> int:
        return len(self._by_name)

    def __hash__(self) -> int:
        return hash(frozenset(self._by_name.items()))

    def __repr__(self) -> str:
        return f"Weights({self._by_name!r})"


def _dest(key: str) -> str:
    return "weight_" + key


def add_weight_flags(group: argparse._ActionsContainer) -> None:
    """A ``--weight-KEY`` option (a number ≥ 0, default the key's) for every weight key."""
    for key, default in registry.weight_defaults().items():
        group.add_argument(cli_flag(key), dest=_dest(key), type=finite_non_negative_float, default=default,
                           help=registry.weight_help(key))


def weights_from_args(args: argparse.Namespace) -> Weights:
    """The :class:`Weights` of options parsed with :func:`add_weight_flags`. Raises ValueError
    (all weights 0)."""
    return Weights({key: getattr(args, _dest(key)) for key in registry.weight_defaults()
                    if hasattr(args, _dest(key))})
