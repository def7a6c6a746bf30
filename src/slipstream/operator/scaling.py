"""Where the autoscaler (issue 6) writes its decisions.

While ``spec.autoscaling.enabled`` is true the reconcile loop never sets the Deployment's
replicas (it only pulls them into [minReplicas, maxReplicas] after a spec change); the
autoscaler's tick calls :func:`apply_scale` with the count its policy chose and the metrics it
saw. ``scale_status`` and ``status_write_due`` are the pure parts (the status patch, and
whether it is worth a write now), for tests without a cluster.

Status writes are etcd writes and a watch event to every watcher, so an idle service must not
cost one per tick: what users and the reconcile loop act on (desiredReplicas, lastScaleTime,
scalingHistory, scrapeFailures, the ScalingActive condition's status and reason) is written at
once; the metrics and the condition's message at most every :data:`TELEMETRY_SECONDS`; the
policy's memory (``status.autoscaler``, read only after an operator restart) at most every
:data:`MEMORY_SECONDS`.
"""
from __future__ import annotations

import datetime
from typing import Any, Callable, Mapping

from slipstream.operator import status as st
from slipstream.operator.events import post_event
from slipstream.operator.group_resources import workload_resource
from slipstream.operator.kube import INFERENCESERVICES, Kube
from slipstream.operator.reconcile import update_status
from slipstream.operator.spec import SpecError, parse_spec

TELEMETRY_SECONDS = 10.0
MEMORY_SECONDS = 30.0
# Written as soon as they change.
IMMEDIATE_FIELDS = ("desiredReplicas", "lastScaleTime", "scalingHistory", "scrapeFailures")
TELEMETRY_FIELDS = ("queueDepth", "kvCacheUtilization", "kvCachePercent", "objectiveAttainment",
                    "lastDecision")
MEMORY_FIELDS = ("autoscaler",)


def status_write_due(live: Mapping[str, Any], new: Mapping[str, Any],
                     since_last_write: float | None, *,
                     telemetry_seconds: float = TELEMETRY_SECONDS,
                     memory_seconds: float = MEMORY_SECONDS) -> bool:
    """Whether the autoscaler's status fields ``new`` are worth writing over ``live`` (the
    status as it is) now. ``since_last_write``: seconds since this process last wrote them
    (None: not yet, so any difference is written)."""
    changed = {key for key, value in new.items() if live.get(key) != value}
    if not changed:
        return False
    if changed & set(IMMEDIATE_FIELDS):
        return True
    before = st.find_condition(live.get("conditions"), st.SCALING_ACTIVE) or {}
    after = st.find_condition(new.get("conditions"), st.SCALING_ACTIVE) or {}
    if (before.get("status"), before.get("reason")) != (after.get("status"), after.get("reason")):
        return True
    if since_last_write is None:
        return True
    if (changed & set(TELEMETRY_FIELDS) or before.get("message") != after.get("message")) \
            and since_last_write >= telemetry_seconds:
        return True
    return bool(changed & set(MEMORY_FIELDS)) and since_last_write >= memory_seconds


def scale_status(status: Mapping[str, Any], *, replicas: int, scaled: bool,
                 queue_depth: float | None, kv_cache_utilization: float | None,
                 active: bool, reason: str, message: str, now: datetime.datetime,
                 extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The status fields after an autoscaler tick.

    replicas: the (clamped) count written to the Deployment. scaled: whether it changed (then
    ``lastScaleTime`` is ``now``). queue_depth: ``num_requests_waiting`` summed over the ready
    pods. kv_cache_utilization: mean ``kv_cache_usage_perc`` (0..1). active/reason/message: the
    ``ScalingActive`` condition (False with a reason when metrics could not be read). extra:
    more status fields the CRD declares (``autoscaler``: the policy's state between ticks,
    ``scalingHistory``), written as given.
    """
    new: dict[str, Any] = {
        "desiredReplicas": replicas,
        "conditions": st.set_condition(status.get("conditions"), st.SCALING_ACTIVE,
                                       "True" if active else "False", reason, message, now),
    }
    if queue_depth is not None:
        new["queueDepth"] = round(float(queue_depth), 3)
    if kv_cache_utilization is not None:
        new["kvCacheUtilization"] = round(float(kv_cache_utilization), 4)
        new["kvCachePercent"] = int(round(100 * float(kv_cache_utilization)))
    if scaled:
        new["lastScaleTime"] = st.timestamp(now)
    new.update(extra or {})
    return new


async def apply_scale(kube: Kube, namespace: str, name: str, *, replicas: int,
                      queue_depth: float | None = None,
                      kv_cache_utilization: float | None = None, active: bool = True,
                      reason: str = "MetricsAvailable", message: str = "",
                      extra_status: Mapping[str, Any] | None = None,
                      now: datetime.datetime | None = None, hold: bool = False,
                      write_due: Callable[[Mapping[str, Any], Mapping[str, Any]], bool]
                      | None = None) -> int | None:
    """Set InferenceService ``namespace/name``'s Deployment (or LeaderWorkerSet: groups) to ``replicas`` (clamped to
    [minReplicas, maxReplicas]) and record the tick in its status (see :func:`scale_status`
    for the arguments); a Normal ``Scaled`` Event (``message`` says why) when the count changes.
    hold: leave the Deployment's replicas alone (another scaler writes them); the status still
    says what the autoscaler would set. write_due(live status, new fields): whether to write
    the status now (default: whenever a field differs; the autoscaler passes its throttle).

    Returns the Deployment's count afterwards, or None when there is nothing to scale: the
    object or its Deployment is gone, it is being deleted, its spec is invalid, or autoscaling
    is off. Raises kube.ApiError (409 when the Deployment moved under us, or the status kept
    moving for three reads: retry on the next tick).
    """
    now = now or datetime.datetime.now(datetime.timezone.utc)
    body = await kube.get(INFERENCESERVICES, namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return None
    try:
        spec = parse_spec(body.get("spec"), name=name)
    except SpecError:
        return None
    scaling = spec.autoscaling
    if not scaling.enabled:
        return None
    workload, _ = workload_resource(spec)  # a LeaderWorkerSet's replicas are groups
    deployment = await kube.get(workload, namespace, name)
    if deployment is None:
        return None
    target = scaling.clamp(int(replicas))
    current = deployment.get("spec", {}).get("replicas", 1)
    scaled = target != current and not hold
    if scaled:
        await kube.merge_patch(workload, namespace, name, {
            "metadata": {"resourceVersion": deployment["metadata"]["resourceVersion"]},
            "spec": {"replicas": target}})
        await post_event(kube, body, "Normal", "Scaled",
                         f"replicas {current} → {target}" + (f": {message}" if message else ""))

    def compute(b: Mapping[str, Any]) -> dict[str, Any]:
        return scale_status(b.get("status") or {}, replicas=target, scaled=scaled,
                            queue_depth=queue_depth, kv_cache_utilization=kv_cache_utilization,
                            active=active, reason=reason, message=message, now=now,
                            extra=extra_status)

    if write_due is None or write_due(body.get("status") or {}, compute(body)):
        await update_status(kube, body, compute)
    return target if scaled else current
