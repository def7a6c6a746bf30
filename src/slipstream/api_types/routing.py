"""The routing contract: the gateway's policies and its scorers' weights, as the CLI
(``slipstream gateway --routing``, ``--weight-*``), the CRD (``spec.routing``) and
``slipstream simulate`` name them.

A scorer's name is snake_case (``kv_cache``); the CRD spells it camelCase (``kvCache``,
:func:`crd_key`) and the CLI as a flag (``--weight-kv-cache``, :func:`cli_flag`).
"""
from __future__ import annotations

import math
from types import MappingProxyType
from typing import Mapping

POLICIES: tuple[str, ...] = ("round-robin", "least-loaded", "prefix", "kv-events")
DEFAULT_POLICY = "kv-events"

# Score weights by scorer name (llm-d's scorer weights play the same role): prompt blocks an
# endpoint already holds, a short queue, free KV cache, the endpoint a session used before.
DEFAULT_WEIGHTS: Mapping[str, float] = MappingProxyType(
    {"prefix": 3.0, "queue": 1.0, "kv_cache": 0.5, "affinity": 0.5})


def crd_key(scorer: str) -> str:
    """The CRD's camelCase key of a scorer name: ``kv_cache`` → ``kvCache``."""
    head, *rest = scorer.split("_")
    return head + "".join(word.title() for word in rest)


def cli_flag(scorer: str) -> str:
    """The gateway's flag of a scorer's weight: ``kv_cache`` → ``--weight-kv-cache``."""
    return "--weight-" + scorer.replace("_", "-")


def check_weights(weights: Mapping[str, float], where: str = "routing weights",
                  defaults: Mapping[str, float] = DEFAULT_WEIGHTS) -> dict[str, float]:
    """``weights`` over ``defaults`` (:data:`DEFAULT_WEIGHTS`, or those plus the weights of
    scorers a gateway registers), checked: known scorer names, numbers ≥ 0, at least one > 0.
    Returns every scorer's weight. Raises ValueError naming ``where`` and the key."""
    unknown = sorted(set(weights) - set(defaults))
    if unknown:
        raise ValueError(f"{where} has unknown scorer(s) {', '.join(unknown)}; known: {', '.join(defaults)}")
    merged = {**defaults, **weights}
    for name, value in merged.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not 0 <= value < math.inf:
            raise ValueError(f"{where}.{crd_key(name)} must be a finite number ≥ 0, got {value!r}")
    if not any(value > 0 for value in merged.values()):
        raise ValueError(f"{where}: at least one weight must be > 0, or every endpoint scores the same")
    return merged
