"""The ``queue`` autoscaling policy: desired replicas from the pods' queue depth and KV-cache use and the
gateway's waiting requests, down to zero and back (pure).

The operator calls :func:`decide` once per tick with the samples the scraper read, the clock and
the replica counts; it returns a :class:`Decision` carrying the new :class:`AutoscalerState`.
Nothing here reads a clock or talks to the network, so a simulation drives it in a loop with a
synthetic clock and the tests replay sample sequences.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

# The spec's fields, defaults and ranges are the contract's; the policy is here.
from slipstream.api_types.autoscaling import STABLE_WINDOW_SECONDS, AutoscalingSpec
from slipstream.api_types.load import GatewayLoad, PodLoad

HISTORY_LIMIT = 10
# The windows while spec.autoscaling leaves them unset: Knative KPA's panic window (10% of its
# 60 s stable one) and threshold (200%), Kubernetes HPA's 5-minute scale-down stabilization.
PANIC_WINDOW_SECONDS = 6
PANIC_THRESHOLD = 2.0
SCALE_DOWN_DELAY_SECONDS = 300
TOLERANCE = 0.1  # Kubernetes HPA's
# ceil(4.000000001) must stay 4: sums of float samples carry rounding error.
_EPS = 1e-9


def stored_number(value: Any, positive: bool = False) -> float | None:
    """A number read back from ``status.autoscaler`` (None stays None). Raises ValueError for
    anything but a finite number (> 0 with ``positive``): the state's reader starts afresh."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or (positive and value <= 0):
        raise ValueError(f"status.autoscaler: expected a finite number, got {value!r}")
    return value


def stored_row(values: Any, size: int) -> tuple[float, ...]:
    """A list of ``size`` numbers read back from ``status.autoscaler``; ValueError otherwise."""
    if not isinstance(values, (list, tuple)) or len(values) != size or None in values:
        raise ValueError(f"status.autoscaler: expected {size} numbers, got {values!r}")
    return tuple(stored_number(v) for v in values)


@dataclass(frozen=True, slots=True)
class Observation:
    """Load seen at one tick, summed over the ready pods: waiting requests and KV-cache use
    (in pods' worth: 2 pods at 0.9 are 1.8)."""

    time: float
    queue_depth: float
    kv_cache_usage: float


@dataclass(frozen=True, slots=True)
class Recommendation:
    time: float
    replicas: int


@dataclass(frozen=True, slots=True)
class AutoscalerState:
    """What the policy remembers between ticks; plain data (:meth:`to_dict` is JSON-ready).

    observations: load per tick within the stable window.
    recommendations: per-tick recommendations within the scale-down delay.
    tracking_since: start of the unbroken run of recommendations; before it the policy assumes
        the replica count it found, so a fresh operator waits the full delay before scaling down.
    panic_time: last time the panic condition held; None when not panicking.
    last_scale_time: last time the desired replica count changed.
    last_active: last time a request was seen running or waiting (in a pod or the gateway), or
        when tracking began; scale to zero waits ``scaleToZeroAfterSeconds`` after it. None
        (a fresh state, or one persisted before scale to zero existed): tracking begins now.
    """

    observations: tuple[Observation, ...] = ()
    recommendations: tuple[Recommendation, ...] = ()
    tracking_since: float | None = None
    panic_time: float | None = None
    last_scale_time: float | None = None
    last_active: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "observations": [[o.time, o.queue_depth, o.kv_cache_usage] for o in self.observations],
            "recommendations": [[r.time, r.replicas] for r in self.recommendations],
            "trackingSince": self.tracking_since,
            "panicTime": self.panic_time,
            "lastScaleTime": self.last_scale_time,
            "lastActive": self.last_active,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> AutoscalerState:
        """The state :meth:`to_dict` wrote; None, or one that does not read (another
        operator version's, or edited), is a fresh state."""
        if not data or not isinstance(data, Mapping):
            return cls()
        try:
            return cls(
                observations=tuple(Observation(*stored_row(o, 3)) for o in data.get("observations") or ()),
                recommendations=tuple(Recommendation(t, int(r)) for t, r in
                                      (stored_row(r, 2) for r in data.get("recommendations") or ())),
                tracking_since=stored_number(data.get("trackingSince")),
                panic_time=stored_number(data.get("panicTime")),
                last_scale_time=stored_number(data.get("lastScaleTime")),
                last_active=stored_number(data.get("lastActive")),
            )
        except (TypeError, ValueError):
            return cls()


@dataclass(frozen=True, slots=True)
class Decision:
    """Result of one tick.

    desired_replicas: what to write to the Deployment's ``spec.replicas``.
    current_replicas: the count :func:`decide` was given.
    reason: one line for an Event and the scaling history.
    state: the state to pass to the next :func:`decide`.
    queue_depth: waiting requests summed over the pods that reported this tick, plus those the
        gateway holds; None if neither the pods nor the gateway reported.
    kv_cache_utilization: mean KV-cache utilization (0..1) of those pods; None if none did.
    recommendation: the count the load asks for, before the scale-down delay and rate limits
        (0 when scaling to or holding at zero).
    panicking: whether the panic window is driving the decision.
    attainment: share of the window's requests whose TTFT met the objective (0..1), None when
        the policy did not measure it (the queue policy) or no request finished.
    details: the tick's numbers for ``status.lastDecision`` (camelCase keys), None when the
        policy gives none.
    """

    desired_replicas: int
    current_replicas: int
    reason: str
    state: AutoscalerState = field(repr=False)
    queue_depth: float | None = None
    kv_cache_utilization: float | None = None
    recommendation: int | None = None
    panicking: bool = False
    attainment: float | None = None
    details: Mapping[str, Any] | None = None

    @property
    def scaled(self) -> bool:
        return self.desired_replicas != self.current_replicas


def _pods_needed(total: float, target: float) -> int:
    return max(0, math.ceil(total / target - _EPS))


def _recommend(total: float, target: float, capacity: int, tolerance: float, current: int) -> int:
    """ceil(total / target) pods, or ``current`` while total is within tolerance of capacity × target."""
    if capacity > 0 and abs(total / (target * capacity) - 1) <= tolerance:
        return current
    return _pods_needed(total, target)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def _need(spec: AutoscalingSpec, window: Sequence[Observation], capacity: int, current: int,
          tolerance: float | None) -> int:
    """Pods the mean load of ``window`` asks for: the larger of the two signals' counts.

    tolerance None: the raw count (for the panic test); else in-band signals keep ``current``.
    """
    queue = _mean([o.queue_depth for o in window])
    kv = _mean([o.kv_cache_usage for o in window])
    if tolerance is None:
        return max(_pods_needed(queue, spec.target_queue_depth),
                   _pods_needed(kv, spec.target_kv_cache_utilization))
    return max(_recommend(queue, spec.target_queue_depth, capacity, tolerance, current),
               _recommend(kv, spec.target_kv_cache_utilization, capacity, tolerance, current))


def _describe(spec: AutoscalingSpec, window: Sequence[Observation], ready: int) -> str:
    queue = _mean([o.queue_depth for o in window]) / max(ready, 1)
    kv = _mean([o.kv_cache_usage for o in window]) / max(ready, 1)
    return (f"queue depth {queue:.2f}/pod (target {spec.target_queue_depth:g}), "
            f"KV cache {kv:.2f}/pod (target {spec.target_kv_cache_utilization:g})")


def with_windows(spec: AutoscalingSpec) -> AutoscalingSpec:
    """``spec`` with the windows, delay and tolerance it leaves unset set to this policy's
    (:data:`STABLE_WINDOW_SECONDS`, :data:`PANIC_WINDOW_SECONDS`, :data:`PANIC_THRESHOLD`,
    :data:`SCALE_DOWN_DELAY_SECONDS`, :data:`TOLERANCE`), the panic window cut to the stable one."""
    stable = spec.stable_window_seconds or STABLE_WINDOW_SECONDS
    return spec.model_copy(update={
        "stable_window_seconds": stable,
        "panic_window_seconds": min(spec.panic_window_seconds or PANIC_WINDOW_SECONDS, stable),
        "panic_threshold": spec.panic_threshold or PANIC_THRESHOLD,
        "scale_down_delay_seconds": (SCALE_DOWN_DELAY_SECONDS if spec.scale_down_delay_seconds is None
                                     else spec.scale_down_delay_seconds),
        "tolerance": TOLERANCE if spec.tolerance is None else spec.tolerance})


def decide(
    spec: AutoscalingSpec,
    state: AutoscalerState,
    samples: Sequence[PodLoad],
    now: float,
    current_replicas: int,
    ready_replicas: int,
    starting_replicas: int = 0,
    gateway: GatewayLoad | None = None,
) -> Decision:
    """One autoscaling tick; pure: ``state`` is not changed, the new one is ``Decision.state``.

    samples: this tick's :class:`PodLoad` of the ready pods that answered (missing pods are
        simply absent). now: seconds on any monotonic clock, the same for every call.
    current_replicas: the Deployment's ``spec.replicas``. ready_replicas: pods Ready.
    starting_replicas: pods that exist but are not Ready yet (pending or loading the model).
    gateway: this tick's :class:`GatewayLoad` (None: no gateway, or none of its pods answered).

    Algorithm (Knative KPA's stable/panic windows and scale to zero, AIBrix APA's per-metric
    targets, Kubernetes HPA's tolerance and scale-down stabilization):

    1. Load at this tick: the per-pod mean of the reporting pods times the ready count, for
       waiting requests and for KV-cache utilization (KPA's averaging: a ready pod that missed
       this scrape is assumed to carry the average, so one lost scrape moves nothing), plus the
       requests waiting in the gateway (the demand no pod sees yet; at zero replicas the only
       one). A tick with no reports adds nothing; with no load seen in the stable window the
       count holds.
    2. Averages over the stable window (``stableWindowSeconds``, KPA default 60 s) and the panic
       window (``panicWindowSeconds``, KPA default 6 s); unset fields as :func:`with_windows`.
    3. Per signal, ``ceil(total / target)`` = ``ceil(ready × observed / target)`` pods (KPA, APA),
       except that within ±``tolerance`` of the target on the capacity ``ready + starting`` the
       count does not change (HPA tolerance 0.1). Pods still starting count as capacity in
       flight, and because the load is divided by the per-pod target rather than multiplied
       by the current count, pods that have not taken load yet do not inflate it. The larger
       signal wins; the load never asks for fewer than one pod (zero comes from step 7 only).
    4. Panic (KPA): when the panic-window need reaches ``panicThreshold`` × capacity, panic mode
       starts (or is extended); the count follows the panic window at once and never drops.
       Panic ends a stable window after the condition last held.
    5. Scale-down stabilization (HPA ``stabilizationWindowSeconds``, here
       ``scaleDownDelaySeconds``): scale up at once; scale down only to the highest
       recommendation of the delay window, i.e. after the delay of lower recommendations.
    6. Rate limits per tick (HPA's default policies): up to max(2 × current, current + 4), down
       to no less than half; then clamp to [minReplicas, maxReplicas].
    7. Zero (``minReplicas`` 0; KPA's scale to zero, its activator's role played by the
       gateway): at 0 replicas the count rises at the first tick the gateway holds a request,
       to at least 1 and as steps 1-6 size it (no window to wait for: the request is waiting);
       it holds 0 otherwise. Above 0 it drops straight to 0 once no request has run or waited
       (pods' running + waiting, the gateway's waiting and in flight) for
       ``scaleToZeroAfterSeconds``, and only on a tick where every ready pod and the gateway
       answered and all were idle: never while a request is in flight, and never without a
       gateway to hold the next request and report it.

    References: Knative Serving autoscaling docs, "KPA: stable and panic windows" and "scale to
    zero"; AIBrix "APA" autoscaler (vLLM metrics, per-metric targets and fluctuation
    tolerance); Kubernetes HPA "algorithm details" and "stabilization window".
    """
    if not spec.enabled:
        return Decision(current_replicas, current_replicas, "autoscaling disabled", state)
    spec = with_windows(spec)

    capacity = ready_replicas + starting_replicas
    observations = [o for o in state.observations if o.time > now - spec.stable_window_seconds]
    queue_depth = kv_utilization = None
    held = gateway.waiting if gateway is not None else 0.0
    busy = held + (gateway.in_flight or 0.0) if gateway is not None else 0.0
    if samples or gateway is not None:
        pods_queue = pods_kv = 0.0
        queue_depth = held
        if samples:
            reporting = len(samples)
            waiting = sum(s.num_requests_waiting for s in samples)
            kv_utilization = _mean([s.kv_cache_usage_perc for s in samples])
            pods = max(ready_replicas, reporting)
            pods_queue, pods_kv = waiting / reporting * pods, kv_utilization * pods
            queue_depth += waiting
            busy += waiting + sum(s.num_requests_running for s in samples)
        observations.append(Observation(now, pods_queue + held, pods_kv))
    # Activity resets the idle clock; a fresh state starts it now (an operator that restarts
    # waits the full delay again). Idle needs every ready pod and the gateway to have said so.
    last_active = now if state.last_active is None or busy > 0 else state.last_active
    idle = (gateway is not None and gateway.complete and len(samples) >= ready_replicas
            and busy == 0)

    previous = [r for r in state.recommendations if r.time > now - spec.scale_down_delay_seconds]
    tracking_since = state.tracking_since if previous and state.tracking_since is not None else now

    panic_time = state.panic_time
    if not observations:
        recommendation = spec.clamp(current_replicas)
        why = f"no metrics from any ready pod in the last {spec.stable_window_seconds:g}s"
    else:
        stable_need = _need(spec, observations, capacity, current_replicas, spec.tolerance)
        stable_text = _describe(spec, observations, ready_replicas)
        recent = [o for o in observations if o.time > now - spec.panic_window_seconds]
        panic_need = _need(spec, recent, capacity, current_replicas, None) if recent else 0
        if panic_need >= spec.panic_threshold * max(capacity, 1):
            panic_time = now
        elif panic_time is not None and now - panic_time >= spec.stable_window_seconds:
            panic_time = None
        if panic_time is not None and recent:
            in_band_need = _need(spec, recent, capacity, current_replicas, spec.tolerance)
            recommendation = spec.clamp(max(in_band_need, stable_need, current_replicas, 1))
            if panic_time == now:
                trigger = f"{panic_need} pods needed >= {spec.panic_threshold:g}x capacity {capacity}"
            else:
                # A duration, not the clock's reading: epoch seconds mean nothing in a message.
                trigger = (f"held for a stable window after the last trigger "
                           f"{now - panic_time:.0f}s ago")
            why = (f"panic ({trigger}): {_describe(spec, recent, ready_replicas)} "
                   f"over {spec.panic_window_seconds:g}s")
        elif panic_time is not None:
            recommendation = spec.clamp(max(stable_need, current_replicas, 1))
            why = f"panic mode, no scale-down: {stable_text} over {spec.stable_window_seconds:g}s"
        else:
            recommendation = spec.clamp(max(stable_need, 1))
            why = f"{stable_text} over {spec.stable_window_seconds:g}s"

    delay_window = [r.replicas for r in previous] + [recommendation]
    if now - tracking_since < spec.scale_down_delay_seconds:
        delay_window.append(current_replicas)  # before tracking began: assume the count found
    if recommendation >= current_replicas:
        desired = recommendation
    else:
        desired = min(current_replicas, max(delay_window))
        if desired == current_replicas:
            why += (f"; scale-down to {recommendation} waits for "
                    f"{spec.scale_down_delay_seconds:g}s of lower recommendations")

    limited = min(desired, max(2 * current_replicas, current_replicas + 4))
    limited = max(limited, current_replicas - current_replicas // 2)
    if limited != desired:
        why += f"; rate-limited from {desired}"
    desired = spec.clamp(limited)

    if desired != current_replicas:
        reason = f"scaling {current_replicas} -> {desired}: {why}"
    else:
        reason = f"holding {desired}: {why}"
    if spec.min_replicas == 0 and current_replicas == 0:
        if queue_depth:
            desired = spec.clamp(max(desired, 1))
            reason = (f"scaling from zero: {queue_depth:g} request{'s' * (queue_depth != 1)} "
                      f"waiting in the gateway; 0 -> {desired}")
        else:
            desired = recommendation = 0
            reason = (f"holding 0: scaled to zero after {spec.scale_to_zero_after_seconds}s idle; "
                      + ("no request waiting in the gateway" if gateway is not None
                         else "no gateway answered, so no request can be seen waiting"))
    elif spec.min_replicas == 0 and idle and now - last_active >= spec.scale_to_zero_after_seconds:
        desired = recommendation = 0
        reason = (f"scaled to zero after {spec.scale_to_zero_after_seconds}s idle (no request ran "
                  f"or waited in the pods or the gateway); {current_replicas} -> 0")
    new_state = AutoscalerState(
        observations=tuple(observations),
        recommendations=tuple(previous) + (Recommendation(now, recommendation),),
        tracking_since=tracking_since,
        panic_time=panic_time,
        last_scale_time=now if desired != current_replicas else state.last_scale_time,
        last_active=last_active,
    )
    return Decision(desired, current_replicas, reason, new_state, queue_depth, kv_utilization,
                    recommendation, panic_time is not None)


def append_scaling_history(
    history: Sequence[Mapping[str, Any]] | None, decision: Decision, time: str, limit: int = HISTORY_LIMIT,
) -> list[dict[str, Any]]:
    """A new list: ``history`` plus one entry for ``decision``, keeping the newest ``limit``.

    time: the entry's timestamp as the status shows it (RFC 3339, e.g. "2026-01-01T00:00:00Z").
    Entry keys: time, fromReplicas, toReplicas, reason. Call it when ``decision.scaled``.
    """
    if limit < 1:
        raise ValueError(f"history limit must be >= 1, got {limit}")
    entry = {
        "time": time,
        "fromReplicas": decision.current_replicas,
        "toReplicas": decision.desired_replicas,
        "reason": decision.reason,
    }
    return ([dict(e) for e in history or ()] + [entry])[-limit:]
