"""Pure status computation: conditions in the Kubernetes style and the replica counts.

A condition is ``{type, status: "True"|"False"|"Unknown", reason, message, lastTransitionTime}``
(as in metav1.Condition); ``lastTransitionTime`` changes only when ``status`` does.
Types: ``Ready`` (some pod serves and, while routing is enabled, some gateway pod routes),
``Progressing`` (a rollout is under way), ``ScalingActive`` (the autoscaler has metrics and acts;
written by the autoscaler), ``GatewayReady`` (some gateway pod is ready).
"""
from __future__ import annotations

import datetime
import json
from typing import Any, Mapping

from slipstream.operator.model_spec import model_location
from slipstream.api_types.parallelism import LWS_KIND
from slipstream.operator.resources import DOWNLOAD_CONTAINER, serving_pod_selector
from slipstream.operator.spec import InferenceServiceSpec

READY, PROGRESSING, SCALING_ACTIVE = "Ready", "Progressing", "ScalingActive"
GATEWAY_READY = "GatewayReady"
# ScalingActive's reason while an HPA or ScaledObject scales the workload (foreign.py).
FOREIGN_SCALER = "ForeignScaler"
# The Warning Event's reason when another field manager set the replicas by hand (foreign.py).
REPLICAS_OVERRIDDEN = "ReplicasOverridden"
CONDITION_ORDER = (READY, PROGRESSING, SCALING_ACTIVE, GATEWAY_READY)
# Status fields the reconcile loop owns; the autoscaler owns queueDepth, kvCacheUtilization,
# kvCachePercent, lastScaleTime, and shares desiredReplicas and the ScalingActive condition.
OWNED_FIELDS = ("conditions", "replicas", "readyReplicas", "desiredReplicas", "url",
                "gateway", "model", "observedGeneration", "selector")


def timestamp(now: datetime.datetime) -> str:
    """RFC 3339 in UTC with a ``Z``, seconds precision (metav1.Time)."""
    return now.astimezone(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def find_condition(conditions: list[Mapping[str, Any]] | None, type_: str,
                   ) -> Mapping[str, Any] | None:
    """The condition of ``type_`` in ``conditions``, or None."""
    return next((c for c in conditions or () if c.get("type") == type_), None)


def set_condition(conditions: list[Mapping[str, Any]] | None, type_: str, status: str,
                  reason: str, message: str, now: datetime.datetime) -> list[dict[str, Any]]:
    """A new condition list with ``type_`` set; the others are kept, ordered by type.

    ``lastTransitionTime`` is ``now`` when the status differs from the previous one of that
    type (or there was none), else the previous time.
    """
    previous = find_condition(conditions, type_)
    since = previous.get("lastTransitionTime") if previous and previous.get(
        "status") == status else None
    condition = {"type": type_, "status": status, "reason": reason, "message": message,
                 "lastTransitionTime": since or timestamp(now)}
    rest = [dict(c) for c in conditions or () if c.get("type") != type_]
    merged = rest + [condition]
    order = {t: i for i, t in enumerate(CONDITION_ORDER)}
    return sorted(merged, key=lambda c: order.get(c["type"], len(order)))


IMAGE_PULL_REASONS = {"ErrImagePull", "ImagePullBackOff", "InvalidImageName",
                      "ErrImageNeverPull"}
# Waiting reasons of a container that is on its way, not stuck.
STARTING_REASONS = {"ContainerCreating", "PodInitializing"}


def download_report(message: str | None) -> dict[str, Any] | None:
    """The JSON object ``slipstream download`` wrote as its termination message, or None when
    ``message`` is not one (e.g. the log tail the kubelet falls back to)."""
    try:
        report = json.loads(message or "")
    except ValueError:
        return None
    return report if isinstance(report, dict) else None


def _download_failure(name: str, cs: Mapping[str, Any]) -> str | None:
    """What the download step of pod ``name`` last failed with (its termination message, which
    names the model and the status code), or None if it did not fail."""
    state = cs.get("state") or {}
    terminated = state.get("terminated") or (cs.get("lastState") or {}).get("terminated") or {}
    if not terminated or terminated.get("exitCode") == 0:
        return None
    report = download_report(terminated.get("message")) or {}
    error = report.get("error") or (terminated.get("message") or "").strip().splitlines()[-1:] or [
        f"exit {terminated.get('exitCode')}"]
    text = error if isinstance(error, str) else error[0]
    retry = " (the kubelet retries with a growing back-off)" if (state.get("waiting") or {}).get(
        "reason") == "CrashLoopBackOff" else ""
    return f"pod {name}: the model download failed: {text}{retry}"


def downloading(pods: list[Mapping[str, Any]], now: datetime.datetime | None = None) -> str | None:
    """A line naming a pod whose download step is running (and for how long), or None."""
    for pod in pods:
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        if meta.get("deletionTimestamp"):
            continue
        for cs in status.get("initContainerStatuses") or []:
            running = (cs.get("state") or {}).get("running")
            if cs.get("name") == DOWNLOAD_CONTAINER and running is not None:
                since = running.get("startedAt")
                took = ""
                if since and now is not None:
                    started = datetime.datetime.strptime(since, "%Y-%m-%dT%H:%M:%SZ").replace(
                        tzinfo=datetime.timezone.utc)
                    took = f" for {max(0, int((now - started).total_seconds()))} s"
                return f"pod {meta.get('name', '?')} is downloading the model{took}"
    return None


def model_report(spec: InferenceServiceSpec, pods: list[Mapping[str, Any]],
                 previous: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """``status.model`` for hf:// and s3:// models: ``{uri, revision, bytes, downloadSeconds}``
    from the newest pod whose download step finished for the current uri (``previous`` when no
    pod says, so long as it is for this uri); None (no such field) for other sources."""
    location = model_location(spec.model)
    if not location.downloaded:
        return None
    best, best_at = None, ""
    for pod in pods:
        for cs in (pod.get("status") or {}).get("initContainerStatuses") or []:
            terminated = (cs.get("state") or {}).get("terminated") or {}
            report = download_report(terminated.get("message"))
            if cs.get("name") != DOWNLOAD_CONTAINER or terminated.get("exitCode") != 0 or not report \
                    or report.get("model") != location.uri:
                continue
            at = terminated.get("finishedAt") or ""
            if best is None or at > best_at:
                best, best_at = report, at
    if best is None:
        return dict(previous) if previous and previous.get("uri") == location.uri else None
    return {"uri": location.uri, "revision": best.get("revision"), "bytes": best.get("bytes"),
            "downloadSeconds": best.get("seconds")}


def pod_problem(pods: list[Mapping[str, Any]]) -> tuple[str, str] | None:
    """(reason, message) of the worst thing keeping model pods from running, in the words of
    the kubelet or the scheduler, or None: ``DownloadFailed`` (the init container could not
    fetch the model: its message names the model and the status code), ``ImagePullFailed``
    (ErrImagePull, ImagePullBackOff …), ``CrashLoopBackOff`` (the server keeps exiting; its last exit), ``ContainerFailed``
    (another waiting reason, e.g. CreateContainerConfigError), ``PodsPending`` (unschedulable:
    e.g. ``0/1 nodes are available: 1 Insufficient nvidia.com/gpu``). Terminating pods are
    left out."""
    found: dict[str, str] = {}
    for pod in pods:
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        if meta.get("deletionTimestamp"):
            continue
        name = meta.get("name", "?")
        for cs in status.get("initContainerStatuses") or []:
            failure = _download_failure(name, cs) if cs.get("name") == DOWNLOAD_CONTAINER else None
            if failure:
                found.setdefault("DownloadFailed", failure)
        for cs in (status.get("initContainerStatuses") or []) + (
                status.get("containerStatuses") or []):
            if cs.get("name") == DOWNLOAD_CONTAINER and "DownloadFailed" in found:
                continue
            waiting = (cs.get("state") or {}).get("waiting") or {}
            why = waiting.get("reason")
            if not why or why in STARTING_REASONS:
                continue
            text = f"pod {name}: {why}: {waiting.get('message') or 'no message'}"
            if why in IMAGE_PULL_REASONS:
                found.setdefault("ImagePullFailed", text)
            elif why == "CrashLoopBackOff":
                last = (cs.get("lastState") or {}).get("terminated") or {}
                exit_text = f"; last exit {last.get('exitCode')} ({last.get('reason')})" \
                    if last else ""
                found.setdefault("CrashLoopBackOff",
                                 f"pod {name}: container {cs.get('name')} keeps exiting"
                                 f"{exit_text}; kubectl logs {name} --previous says why")
            else:
                found.setdefault("ContainerFailed", text)
        for cond in status.get("conditions") or ():
            if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
                found.setdefault("PodsPending", f"pod {name} cannot be scheduled: "
                                                f"{cond.get('message') or cond.get('reason')}")
    for reason in ("DownloadFailed", "ImagePullFailed", "CrashLoopBackOff", "ContainerFailed",
                   "PodsPending"):
        if reason in found:
            return reason, found[reason]
    return None


def ready_condition(deployment: Mapping[str, Any] | None,
                    pods: list[Mapping[str, Any]] | None = None,
                    now: datetime.datetime | None = None) -> tuple[str, str, str]:
    """(status, reason, message) of ``Ready`` from the Deployment or LeaderWorkerSet (None: not
    there yet; an LWS counts groups, ready when all its pods are) and,
    when some pods are not ready, what :func:`pod_problem` finds in ``pods`` (or, with none
    ready, ``Downloading`` while a pod's download step runs)."""
    if deployment is None:
        return "False", "DeploymentMissing", "the Deployment does not exist yet"
    want = deployment.get("spec", {}).get("replicas", 1)
    ready = deployment.get("status", {}).get("readyReplicas") or 0
    if want == 0 and ready == 0:
        return "False", "ScaledToZero", f"the {deployment.get('kind') or 'Deployment'} has 0 replicas"
    problem = pod_problem(pods or [])
    if ready >= 1:
        return "True", "ReplicasReady", f"{ready}/{want} replicas ready" + (
            f"; {problem[1]}" if problem else "")
    if problem:
        return "False", problem[0], f"0/{want} replicas ready; {problem[1]}"
    fetching = downloading(pods or [], now)
    if fetching:
        return "False", "Downloading", f"0/{want} replicas ready; {fetching}"
    return ("False", "NoReplicasReady",
            f"0/{want} replicas ready; a pod turns ready once its model is loaded and warmed")


def gateway_condition(spec: InferenceServiceSpec, gateway: Mapping[str, Any] | None,
                      pods: list[Mapping[str, Any]] | None = None) -> tuple[str, str, str]:
    """(status, reason, message) of ``GatewayReady`` from the gateway Deployment (None: not
    there yet) and, when none of its pods is ready, what :func:`pod_problem` finds in ``pods``
    (the gateway's pods)."""
    if not spec.routing.enabled:
        return ("False", "RoutingDisabled",
                "spec.routing.enabled is false: the Service selects the model pods")
    if gateway is None:
        return "False", "GatewayMissing", "the gateway Deployment does not exist yet"
    want = gateway.get("spec", {}).get("replicas", 1)
    ready = gateway.get("status", {}).get("readyReplicas") or 0
    if ready >= 1:
        return "True", "GatewayReplicasReady", f"{ready}/{want} gateway replicas ready"
    problem = pod_problem(pods or [])
    if problem:
        return "False", f"Gateway{problem[0]}", f"0/{want} gateway replicas ready; {problem[1]}"
    return "False", "NoGatewayReplicasReady", f"0/{want} gateway replicas ready"


def service_ready(spec: InferenceServiceSpec, deployment: Mapping[str, Any] | None,
                  pods: list[Mapping[str, Any]] | None = None,
                  gateway: Mapping[str, Any] | None = None,
                  gateway_pods: list[Mapping[str, Any]] | None = None,
                  now: datetime.datetime | None = None) -> tuple[str, str, str]:
    """(status, reason, message) of ``Ready``: :func:`ready_condition` of the model pods and,
    while routing is enabled, the gateway ready too (requests reach the pods through it). Scaled
    to zero by an autoscaler that may (``minReplicas: 0``), the service is Ready when its gateway
    is: the gateway holds a request and its waiting count starts a pod."""
    model = ready_condition(deployment, pods, now)
    if model[1] == "ScaledToZero" and spec.routing.enabled and spec.autoscaling.enabled \
            and spec.autoscaling.min_replicas == 0:
        status, reason, message = gateway_condition(spec, gateway, gateway_pods)
        if status != "True":
            return "False", reason, f"{model[2]} and {message}"
        return "True", "ScaledToZero", f"{model[2]}; {message}: a request starts one"
    if not spec.routing.enabled or model[0] != "True":
        return model
    status, reason, message = gateway_condition(spec, gateway, gateway_pods)
    if status != "True":
        return "False", reason, f"{model[2]}, but {message}"
    return model[0], model[1], f"{model[2]}; {message}"


def progressing_condition(deployment: Mapping[str, Any] | None) -> tuple[str, str, str]:
    """(status, reason, message) of ``Progressing``: True while the Deployment (or
    LeaderWorkerSet) rolls out. An LWS reports no available count: its ready groups stand in."""
    if deployment is None:
        return "True", "Creating", "creating the Deployment"
    spec, status = deployment.get("spec", {}), deployment.get("status", {})
    for cond in status.get("conditions") or ():
        if cond.get("type") == "Progressing" and cond.get("reason") == "ProgressDeadlineExceeded":
            return "False", "ProgressDeadlineExceeded", cond.get("message", "rollout stalled")
    want = spec.get("replicas", 1)
    updated = status.get("updatedReplicas") or 0
    available = status.get("readyReplicas" if deployment.get("kind") == LWS_KIND
                           else "availableReplicas") or 0
    total = status.get("replicas") or 0
    observed = status.get("observedGeneration") or 0
    generation = deployment.get("metadata", {}).get("generation") or 0
    if observed < generation or updated < want or total > updated or available < updated:
        return ("True", "RollingOut",
                f"{updated}/{want} pods run the current spec, {available} available")
    return "False", "RolloutComplete", f"all {want} replicas run the current spec"


def scaling_condition(spec: InferenceServiceSpec, conditions: list[Mapping[str, Any]] | None,
                      ) -> tuple[str, str, str]:
    """(status, reason, message) of ``ScalingActive``; keeps the autoscaler's own verdict."""
    if not spec.autoscaling.enabled:
        return ("False", "AutoscalingDisabled",
                "replicas follow spec.replicas (kubectl scale changes it)")
    previous = find_condition(conditions, SCALING_ACTIVE)
    if previous and previous.get("reason") != "AutoscalingDisabled":
        return previous["status"], previous["reason"], previous.get("message", "")
    return "Unknown", "AwaitingMetrics", "the autoscaler has not read the pods' metrics yet"


def desired_replicas(spec: InferenceServiceSpec, status: Mapping[str, Any],
                     deployment: Mapping[str, Any] | None) -> int:
    """How many replicas the service should have now: ``spec.replicas`` without autoscaling;
    with it, the autoscaler's last answer (else the Deployment's count), within min/max."""
    scaling = spec.autoscaling
    if not scaling.enabled:
        return spec.replicas
    current = status.get("desiredReplicas")
    if current is None and deployment is not None:
        current = deployment.get("spec", {}).get("replicas")
    if current is None:
        current = scaling.min_replicas
    return scaling.clamp(current)


def compute_status(body: Mapping[str, Any], spec: InferenceServiceSpec,
                   deployment: Mapping[str, Any] | None, *, url: str,
                   now: datetime.datetime, pods: list[Mapping[str, Any]] | None = None,
                   gateway: Mapping[str, Any] | None = None,
                   gateway_pods: list[Mapping[str, Any]] | None = None,
                   ) -> dict[str, Any]:
    """The status fields the reconcile loop owns (:data:`OWNED_FIELDS`) for a valid spec;
    ``pods``: the service's pods, read when some are not ready (for the Ready condition);
    ``gateway``: the live gateway Deployment (None: none yet, or routing disabled);
    ``gateway_pods``: its pods, read when none is ready."""
    status = body.get("status") or {}
    conditions = status.get("conditions")
    for type_, (st, reason, message) in (
            (READY, service_ready(spec, deployment, pods, gateway, gateway_pods, now)),
            (PROGRESSING, progressing_condition(deployment)),
            (SCALING_ACTIVE, scaling_condition(spec, conditions)),
            (GATEWAY_READY, gateway_condition(spec, gateway, gateway_pods))):
        conditions = set_condition(conditions, type_, st, reason, message, now)
    dep_status = (deployment or {}).get("status", {})
    gw_status = (gateway or {}).get("status", {})
    meta = body.get("metadata", {})
    return {
        "conditions": conditions,
        "replicas": dep_status.get("replicas") or 0,
        "readyReplicas": dep_status.get("readyReplicas") or 0,
        "desiredReplicas": desired_replicas(spec, status, deployment),
        "url": url,
        # The Service NAME is the gateway's while routing is enabled; None removes the field.
        "gateway": {"url": url, "replicas": gw_status.get("replicas") or 0,
                    "readyReplicas": gw_status.get("readyReplicas") or 0}
        if spec.routing.enabled else None,
        "model": model_report(spec, pods or [], status.get("model")),
        "observedGeneration": meta.get("generation"),
        # The pods that serve (with pipeline > 1 the groups' leaders: one per replica).
        "selector": serving_pod_selector(meta["name"], spec),
    }


def failed_status(body: Mapping[str, Any], reason: str, message: str,
                  now: datetime.datetime) -> dict[str, Any]:
    """Status for a spec the operator cannot serve (or the API refused): Ready and Progressing
    False with ``reason``; replica counts and url are left as they were."""
    status = body.get("status") or {}
    conditions = set_condition(status.get("conditions"), READY, "False", reason, message, now)
    conditions = set_condition(conditions, PROGRESSING, "False", reason, message, now)
    return {"conditions": conditions,
            "observedGeneration": body.get("metadata", {}).get("generation")}


def changed_fields(current: Mapping[str, Any] | None, new: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of ``new`` that differ from ``current`` (a merge patch of the status)."""
    current = current or {}
    return {k: v for k, v in new.items() if current.get(k) != v}
