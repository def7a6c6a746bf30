"""What decides the replica count in a simulation: the operator's policy, and the baselines
``slipstream simulate --compare`` runs beside it (each a :class:`Scaler`).

- :class:`PolicyScaler`: the operator's own policy (``spec.autoscaling.policy``), through
  :func:`slipstream.operator.policy.decide`, with the capacity prior of the profile
  (:func:`profile_prior`).
- :class:`HPAScaler`: the Kubernetes HorizontalPodAutoscaler's algorithm on queue length.
- :class:`ScheduleScaler`: a count per minute known in advance (the clairvoyant bound of
  :mod:`.clairvoyant`), each started one start time ahead.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol, Sequence

from slipstream.api_types.autoscaling import AutoscalingSpec
from slipstream.operator.autoscaler import Decision
from slipstream.operator.capacity_policy import CapacityPrior
from slipstream.operator.policy import State, Tick, decide

from .cost_model import Profile, batch_shape, step_time

# The prior's share of a pod's raw prefill throughput that still meets a TTFT objective: an
# assumption the policy corrects online (capacity_policy.learn_capacity).
PRIOR_UTILIZATION = 0.7


class Scaler(Protocol):
    """Decides one tick; keeps its own memory between calls."""

    def decide(self, tick: Tick) -> Decision: ...


def profile_prior(profile: Profile, max_num_seqs: int, max_num_batched_tokens: int,
                  start_seconds: float = 60.0) -> CapacityPrior:
    """The capacity policy's prior for a pod of ``profile`` (pure; from the cost model).

    Prompt capacity: one full prefill chunk (``max_num_batched_tokens`` new tokens, nothing
    cached) per step, × :data:`PRIOR_UTILIZATION`. Generation weight κ: the time of a decode
    token with every seat taken (``max_num_seqs`` requests of 1,024-token context, as a pod at
    its capacity runs) over that of a prompt token. Request size until one finishes: 1,000 tokens. Backlog drain: the raw
    prefill throughput.
    """
    chunk = max_num_batched_tokens
    prefill_per_token = step_time(profile, batch_shape([(0, chunk)])) / chunk
    seats = max(1, max_num_seqs)
    decode_per_token = step_time(profile, batch_shape([(1024, 1)] * seats)) / seats
    return CapacityPrior(tokens_per_second=PRIOR_UTILIZATION / prefill_per_token,
                         generation_weight=decode_per_token / prefill_per_token,
                         start_seconds=start_seconds, drain_tokens_per_second=1 / prefill_per_token)


@dataclass
class PolicyScaler:
    """The operator's policy as the operator runs it: ``spec.policy`` with its state kept here."""

    spec: AutoscalingSpec
    prior: CapacityPrior = field(default_factory=CapacityPrior)
    state: State | None = None

    def decide(self, tick: Tick) -> Decision:
        decision = decide(self.spec, self.state, tick, self.prior)
        self.state = decision.state
        return decision


@dataclass
class HPAScaler:
    """The Kubernetes HPA algorithm on queue length (autoscaling/v2 defaults).

    Every ``sync_seconds`` (the controller's ``--horizontal-pod-autoscaler-sync-period``, 15 s):
    ratio = mean waiting requests per pod / target; pods not yet ready count as 0 when the
    ratio asks for more (the HPA's conservative treatment of unready pods); within
    ``tolerance`` (0.1) of 1 nothing changes; else desired = ceil(current × ratio). Scale-up
    is at most max(2 × current, current + 4) per period; scale-down takes the highest
    recommendation of the last ``down_stabilization_seconds`` (300). Clamped to [min, max].
    At 0 replicas (``minReplicas: 0``, HPA's ``HPAScaleToZero`` gate) ceil(current × ratio) is 0
    whatever waits, so there the queue is read as an external metric with an ``AverageValue``
    target, as an HPA that scales from zero must: desired = ceil(waiting / target).

    Source: Kubernetes documentation, "Horizontal Pod Autoscaling", sections "Algorithm
    details", "Stabilization window" and "Default Behavior".
    """

    spec: AutoscalingSpec
    sync_seconds: float = 15.0
    tolerance: float = 0.1
    down_stabilization_seconds: float = 300.0
    last_sync: float | None = None
    recommendations: list[tuple[float, int]] = field(default_factory=list)

    def decide(self, tick: Tick) -> Decision:
        current = tick.current_replicas
        if self.last_sync is not None and tick.now - self.last_sync < self.sync_seconds - 1e-9:
            return Decision(current, current, "between syncs", None)
        self.last_sync = tick.now
        waiting = sum(s.num_requests_waiting for s in tick.samples) + (tick.gateway.waiting if tick.gateway else 0)
        pods = max(1, tick.fleet.ready + tick.fleet.starting)  # unready pods as 0 load
        ratio = waiting / pods / self.spec.target_queue_depth
        if current == 0:
            wanted = math.ceil(waiting / self.spec.target_queue_depth - 1e-9)
        else:
            wanted = current if abs(ratio - 1) <= self.tolerance else math.ceil(current * ratio - 1e-9)
        wanted = self.spec.clamp(wanted)
        self.recommendations = [(t, n) for t, n in self.recommendations
                                if t > tick.now - self.down_stabilization_seconds] + [(tick.now, wanted)]
        if wanted < current:
            wanted = min(current, max(n for _, n in self.recommendations))
        wanted = min(wanted, max(2 * current, current + 4))
        desired = self.spec.clamp(wanted)
        return Decision(desired, current, f"HPA: {waiting:g} waiting over {pods} pods, ratio {ratio:.2f}", None)


@dataclass
class ScheduleScaler:
    """``counts[m]`` replicas in minute ``m`` (the last count after the end), each count asked
    for ``lead_seconds`` (one start time) before its minute begins so the pods are ready then;
    a count drops when its minute is over."""

    counts: Sequence[int]
    lead_seconds: float
    minute: float = 60.0

    def wanted(self, now: float) -> int:
        if not self.counts:  # no minute to serve (a run without arrivals)
            return 1
        first = max(0, int(now // self.minute))
        last = max(first, int((now + self.lead_seconds) // self.minute))
        window = [self.counts[min(m, len(self.counts) - 1)] for m in range(first, last + 1)]
        return max(window) if window else 1

    def decide(self, tick: Tick) -> Decision:
        desired = self.wanted(tick.now)
        return Decision(desired, tick.current_replicas, f"schedule: {desired}", None)
