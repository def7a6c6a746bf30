"""Where the autoscaler (issue 6) writes its decisions.

While ``spec.autoscaling.enabled`` is true the reconcile loop never sets the Deployment's
replicas (it only pulls them into [minReplicas, maxReplicas] after a spec change); the
autoscaler's tick calls :func:`apply_scale` with the count its policy chose and the metrics it
saw. ``scale_status`` is the pure part (the status patch), for tests without a cluster.
"""
from __future__ import annotations

import datetime
from typing import Any, Mapping

from slipstream.operator import status as st
from slipstream.operator.kube import DEPLOYMENTS, INFERENCESERVICES, Kube
from slipstream.operator.reconcile import post_event, update_status
from slipstream.operator.spec import SpecError, parse_spec


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
                      now: datetime.datetime | None = None) -> int | None:
    """Set InferenceService ``namespace/name``'s Deployment to ``replicas`` (clamped to
    [minReplicas, maxReplicas]) and record the tick in its status (see :func:`scale_status`
    for the arguments); a Normal ``Scaled`` Event (``message`` says why) when the count changes.

    Returns the count written, or None when there is nothing to scale: the object or its
    Deployment is gone, it is being deleted, its spec is invalid, or autoscaling is off.
    Raises kube.ApiError (409 when the Deployment moved under us, or the status kept moving
    for three reads: retry on the next tick).
    """
    now = now or datetime.datetime.now(datetime.timezone.utc)
    body = await kube.get(INFERENCESERVICES, namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return None
    try:
        scaling = parse_spec(body.get("spec"), name=name).autoscaling
    except SpecError:
        return None
    if not scaling.enabled:
        return None
    deployment = await kube.get(DEPLOYMENTS, namespace, name)
    if deployment is None:
        return None
    target = st.clamp(int(replicas), scaling.min_replicas, scaling.max_replicas)
    current = deployment.get("spec", {}).get("replicas", 1)
    if target != current:
        await kube.merge_patch(DEPLOYMENTS, namespace, name, {
            "metadata": {"resourceVersion": deployment["metadata"]["resourceVersion"]},
            "spec": {"replicas": target}})
        post_event(body, "Normal", "Scaled",
                   f"replicas {current} → {target}" + (f": {message}" if message else ""))
    await update_status(kube, body, lambda b: scale_status(
        b.get("status") or {}, replicas=target, scaled=target != current,
        queue_depth=queue_depth, kv_cache_utilization=kv_cache_utilization, active=active,
        reason=reason, message=message, now=now, extra=extra_status))
    return target
