"""The autoscaling policies by name (``spec.autoscaling.policy``), one entry point for the
operator's tick and for ``slipstream simulate`` (pure).

``capacity`` (default): :mod:`slipstream.operator.capacity_policy`. ``queue``:
:mod:`slipstream.operator.autoscaler` (queue depth and KV use per ready pod, Knative-style
windows). Both take the same :class:`Tick` and return an ``autoscaler.Decision``; each keeps
its own state, which :func:`load_state` restores from ``status.autoscaler``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from slipstream.api_types.autoscaling import AutoscalingSpec
from slipstream.api_types.load import GatewayLoad, PodLoad

from . import autoscaler, capacity_policy
from .autoscaler import AutoscalerState, Decision
from .capacity_policy import CapacityPrior, CapacityState
from .fleet import Fleet

State = AutoscalerState | CapacityState


@dataclass(frozen=True, slots=True)
class Tick:
    """One tick's inputs: ``now`` (seconds, any monotonic clock the same for every call), the
    workload's ``spec.replicas``, the fleet, the ready pods' samples that answered, and the
    gateway's reading (None: none)."""

    now: float
    current_replicas: int
    fleet: Fleet
    samples: Sequence[PodLoad] = ()
    gateway: GatewayLoad | None = None


def load_state(spec: AutoscalingSpec, data: Mapping[str, Any] | None) -> State:
    """The state ``spec.autoscaling.policy`` keeps, from its ``to_dict`` (None or another
    policy's: a fresh one)."""
    if spec.policy == "queue":
        return AutoscalerState.from_dict(None if isinstance(data, Mapping) and data.get("policy") == "capacity"
                                         else data)
    return CapacityState.from_dict(data)


def decide(spec: AutoscalingSpec, state: State | None, tick: Tick,
           prior: CapacityPrior = CapacityPrior()) -> Decision:
    """One tick of the policy ``spec.policy`` names. A state of the other policy (the spec's
    policy changed) is replaced by a fresh one. prior: the capacity policy's prior."""
    if spec.policy == "queue":
        state = state if isinstance(state, AutoscalerState) else AutoscalerState()
        return autoscaler.decide(spec, state, tick.samples, tick.now, tick.current_replicas,
                                 tick.fleet.ready, tick.fleet.starting, tick.gateway)
    state = state if isinstance(state, CapacityState) else CapacityState()
    return capacity_policy.decide(spec, state, tick.samples, tick.now, tick.current_replicas,
                                  tick.fleet, tick.gateway, prior)


def prior_from_state(state: State | None, prior: CapacityPrior = CapacityPrior()) -> CapacityPrior:
    """``prior`` with the capacity and start time last learned in ``state`` (the operator's
    prior after a restart: the last learned value)."""
    if not isinstance(state, CapacityState):
        return prior
    return CapacityPrior(state.capacity or prior.tokens_per_second, prior.generation_weight,
                         state.start_seconds or prior.start_seconds, prior.request_tokens,
                         prior.drain_tokens_per_second)
