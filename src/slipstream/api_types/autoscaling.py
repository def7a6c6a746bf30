"""``spec.autoscaling``: the fields, defaults and ranges of an InferenceService's autoscaler, for
the operator (its policy: ``slipstream.operator.autoscaler``) and ``slipstream simulate`` alike."""
from __future__ import annotations

from types import MappingProxyType
from typing import Any, Literal, Mapping

from pydantic import model_validator

from .schema import CelRule, SpecModel, spec_field


# The policies ``spec.autoscaling.policy`` names (``slipstream.operator.policy`` runs them).
POLICIES = ("capacity", "queue")
DEFAULT_POLICY = "capacity"
# stableWindowSeconds while unset, in both policies (the other windows' defaults are each policy's).
STABLE_WINDOW_SECONDS = 60


class AutoscalingObjectives(SpecModel):
    """``spec.autoscaling.objectives``: the latency the capacity policy sizes for.

    ttft_p90_seconds: time to first token that 90% of requests should not exceed, seconds
        (like the CRD's other ``*Seconds`` fields; a number here, as 0.5 s is a fair objective).
    """

    cel_rules = (
        CelRule("!has(self.ttftP90Seconds) || self.ttftP90Seconds > 0.0",
                "ttftP90Seconds must be > 0: it is a latency, in seconds"),
    )

    ttft_p90_seconds: float = spec_field(
        2.0, alias="ttftP90Seconds", gt=0, le=3600,
        description="Time to first token (seconds) that 90% of requests should not exceed; the "
                    "capacity policy learns how many tokens/s one pod serves while meeting it.")


class AutoscalingSpec(SpecModel):
    """``spec.autoscaling`` of an InferenceService.

    Targets are per ready pod: waiting requests (``targetQueueDepth``) and KV-cache utilization
    0..1 (``targetKVCacheUtilization``). Windows and the delay are whole seconds, as the CRD
    wants them. ``tolerance`` is a dead band, a fraction in [0, 1) (Kubernetes HPA's; per
    object here, as newer HPA's ``behavior`` and AIBrix's fluctuation tolerance are). Unset
    (None), the windows, the delay and the tolerance take each policy's own value (the
    descriptions name them), and a panic window longer than the stable window is cut to it.

    ``policy``: ``capacity`` (the default; :mod:`slipstream.operator.capacity_policy`) sizes
    the count from demand (requests and tokens per second) over one pod's capacity at
    ``objectives.ttftP90Seconds``, with starting pods counted as capacity on its way and queue
    depth and KV use as guards; ``queue`` (:mod:`slipstream.operator.autoscaler`) sizes it from
    queue depth and KV use per ready pod against the targets, with panic and stable windows.

    ``minReplicas: 0`` allows scale to zero (Knative's ``min-scale: 0``): once no request has
    run or waited in the pods or the gateway for ``scaleToZeroAfterSeconds`` (whole seconds;
    300 by default, as ``scaleDownDelaySeconds``: a cold start costs a model load, so a few idle
    minutes stay warm), the count goes to 0; the gateway holds the next request and the count
    goes back up at once. ``scaleToZeroAfterSeconds`` means nothing while ``minReplicas`` ≥ 1.

    Raises ValueError (:class:`~slipstream.api_types.schema.SpecValueError` from
    :meth:`from_dict`) naming the CRD field when a value is out of range or of the wrong type;
    ``slipstream.operator.spec`` turns that into the InvalidSpec condition.
    """

    # has(): the API server also checks these against the default {} as written.
    cel_rules = (
        CelRule("!has(self.minReplicas) || !has(self.maxReplicas) || self.minReplicas <= self.maxReplicas",
                "minReplicas must be ≤ maxReplicas"),
        CelRule("!has(self.panicWindowSeconds) || self.panicWindowSeconds <= "
                f"(has(self.stableWindowSeconds) ? self.stableWindowSeconds : {STABLE_WINDOW_SECONDS})",
                f"panicWindowSeconds must be ≤ stableWindowSeconds ({STABLE_WINDOW_SECONDS} if unset)"),
    )

    enabled: bool = spec_field(
        False,
        description="The operator sets the workload's replicas from load. While a "
                    "HorizontalPodAutoscaler or KEDA ScaledObject targets the workload it writes "
                    "none (ScalingActive=False ForeignScaler) and takes over when that object is "
                    "deleted. A hand scale of the Deployment (kubectl scale deployment) is not a "
                    "floor: it gets a ReplicasOverridden Warning Event and is set back; set "
                    "minReplicas to raise the floor, or false to scale by hand.")
    policy: Literal[POLICIES] = spec_field(  # type: ignore[valid-type]
        DEFAULT_POLICY,
        description="capacity (default): replicas = demand (requests and tokens per second) over one "
                    "pod's learned capacity at objectives.ttftP90Seconds, plus headroom; starting pods "
                    "count as capacity arriving at their expected ready time; queue depth and KV use "
                    "are guards. queue: replicas from waiting requests and KV use per ready pod against "
                    "targetQueueDepth and targetKVCacheUtilization (stable and panic windows).")
    objectives: AutoscalingObjectives = spec_field(
        default_factory=AutoscalingObjectives,
        description="Latency objectives the capacity policy sizes for.")
    min_replicas: int = spec_field(
        1, ge=0, rule="an integer ≥ 0 (0: scale to zero)",
        description="Fewest pods; 0 allows scale to zero (needs the gateway, spec.routing.enabled).")
    max_replicas: int = spec_field(4, ge=1)
    target_queue_depth: float = spec_field(
        5.0, gt=0, rule="a number > 0 (waiting requests per pod)",
        description="Requests waiting per ready pod: the queue policy sizes the count to it; for "
                    "the capacity policy it is a guard (above it no pod is removed).")
    target_kv_cache_utilization: float = spec_field(
        0.8, alias="targetKVCacheUtilization", gt=0, le=1,
        description="Fraction of KV-cache blocks in use per ready pod, in (0, 1]: the queue policy "
                    "sizes the count to it; the capacity policy asks for ceil(KV use in pods' worth "
                    "/ it) pods when above it, and removes none.")
    # Unset (None), each policy uses its own value; tests/operator/test_capacity_policy.py checks
    # the numbers the descriptions name against the policies' constants.
    stable_window_seconds: int | None = spec_field(
        None, ge=1, crd_default=False,
        description="Whole seconds the load is averaged over. capacity: the arrival rate's window; "
                    "queue: Knative's stable window. Unset: 60.")
    panic_window_seconds: int | None = spec_field(
        None, ge=1, crd_default=False,
        description="Whole seconds of the short window that reads a step up, at most "
                    "stableWindowSeconds. Unset: 8 (capacity) or 6 (queue, Knative's).")
    panic_threshold: float | None = spec_field(
        None, ge=1, crd_default=False,
        description="capacity: the panic window's arrival rate is the demand while it is at least "
                    "this many times the stable window's; queue: panic mode starts when the panic "
                    "window's load asks for at least this many times the current pods. Unset: 2.")
    scale_down_delay_seconds: int | None = spec_field(
        None, ge=0, crd_default=False,
        description="How long a lower count must persist before pods are removed. Unset: five "
                    "measured pod starts (capacity: a pod removed takes a start to come back) or "
                    "300 (queue).")
    scale_to_zero_after_seconds: int = spec_field(
        300, ge=0,
        description="With minReplicas 0, how long no request may run or wait (in the pods or the "
                    "gateway) before the count goes to 0; ignored while minReplicas is at least 1.")
    tolerance: float | None = spec_field(
        None, ge=0, lt=1, crd_default=False,
        description="Dead band, a fraction in [0, 1): while the load is within ±tolerance of what "
                    "the ready and starting pods carry (queue: at the targets; capacity: at the "
                    "learned capacity with its headroom), the count does not change (Kubernetes "
                    "HPA's tolerance, per object as in HPA behavior). Raise it for a noisy load, "
                    "lower it to react to small changes. Unset: 0.1 (queue, HPA's) or 0 (capacity: "
                    "its headroom and scale-down hold do that job).")

    @model_validator(mode="after")
    def _ordered(self) -> AutoscalingSpec:
        # The Python twins of cel_rules, with the values in the message.
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"spec.autoscaling.minReplicas ({self.min_replicas}) must be ≤ maxReplicas "
                             f"({self.max_replicas})")
        stable = self.stable_window_seconds or STABLE_WINDOW_SECONDS
        if self.panic_window_seconds is not None and self.panic_window_seconds > stable:
            raise ValueError(f"spec.autoscaling.panicWindowSeconds ({self.panic_window_seconds}) must be "
                             f"≤ stableWindowSeconds ({stable}"
                             f"{'' if self.stable_window_seconds else ', its default'})")
        return self

    @classmethod
    def from_dict(cls, autoscaling: Mapping[str, Any] | None) -> AutoscalingSpec:
        """Parse the CRD's camelCase ``spec.autoscaling``; None (or a key set to null) means
        the default. Keys: :data:`CRD_KEYS`.

        Raises SpecValueError (a ValueError) naming the key for an unknown key
        (``spec.autoscaling has unknown field(s) …; known: …``), for a value that is not an
        object, and for a value out of range or of the wrong type.
        """
        return cls.parse(autoscaling, "spec.autoscaling")

    def clamp(self, replicas: int) -> int:
        """``replicas`` pulled into [minReplicas, maxReplicas]; the one clamp of replica counts."""
        return min(max(replicas, self.min_replicas), self.max_replicas)


# camelCase key of ``spec.autoscaling`` → AutoscalingSpec attribute (``slipstream simulate``'s flags).
CRD_KEYS: Mapping[str, str] = MappingProxyType(
    {info.alias: name for name, info in AutoscalingSpec.model_fields.items()})
