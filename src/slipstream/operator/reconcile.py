"""One idempotent, level-based reconcile of an InferenceService.

``reconcile`` reads the InferenceService fresh, renders its children (pure), creates what is
missing, puts back what drifted, removes the gateway when routing is turned off, and writes the
status fields it owns. Every trigger calls it —
create, update, resume, a periodic resync, any change to a child — so missing an event costs
nothing but latency. Errors: a spec that cannot be served gets ``Ready=False`` and a Warning
Event and is not retried (the user must edit it); an API answer worth retrying (409, 429, 5xx)
becomes ``kopf.TemporaryError`` (kopf retries with backoff); any other API refusal becomes
``Ready=False, reason=ApplyFailed`` and ``kopf.PermanentError``.
"""
from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import kopf

from slipstream.operator import status as st
from slipstream.operator.drift import foreign_owner, plan_deployment, plan_gateway_deployment, \
    plan_service
from slipstream.operator.events import post_event
from slipstream.operator.gateway_resources import gateway_name, gateway_selector, \
    render_gateway, render_pods_service
from slipstream.operator.group_resources import render_workload, workload_resource
from slipstream.operator.kube import DEPLOYMENTS, DISRUPTION_BUDGETS, INFERENCESERVICES, \
    LEADER_WORKER_SETS, PODS, ROLE_BINDINGS, ROLES, SERVICE_ACCOUNTS, SERVICES, ApiError, Kube, \
    Resource
from slipstream.operator.resources import gateway_selector_labels, pod_selector, \
    render_disruption_budget, render_service, selector_labels, service_url
from slipstream.operator.model_spec import model_location, needs_mount_probe, resolve_oci_mount
from slipstream.operator.spec import InferenceServiceSpec, SpecError, parse_spec

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one reconcile did: ``ready`` (the Ready condition's status), ``actions`` (one line
    per child created or updated), ``error`` (the reason of a failed status, or None)."""

    ready: str
    actions: tuple[str, ...] = ()
    error: str | None = None


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def retry_delay(retry: int) -> float:
    """Seconds before retry number ``retry`` (0, 1, 2 …): 1, 2, 4 … capped at 60."""
    return float(min(60, 2 ** retry))


async def write_status(kube: Kube, body: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    """Merge-patch the fields of ``new`` that differ from ``body.status``, guarded by
    ``body``'s resourceVersion (409 if the object moved since it was read). True if written."""
    patch = st.changed_fields(body.get("status"), new)
    if not patch:
        return False
    meta = body["metadata"]
    await kube.merge_patch(INFERENCESERVICES, meta["namespace"], meta["name"],
                           {"metadata": {"resourceVersion": meta["resourceVersion"]},
                            "status": patch}, subresource="status")
    return True


async def update_status(kube: Kube, body: Mapping[str, Any],
                        compute: Callable[[Mapping[str, Any]], Mapping[str, Any]],
                        attempts: int = 3) -> Mapping[str, Any]:
    """Write ``compute(body)`` as the status; on a 409 (another writer, e.g. the autoscaler,
    got there first) read the object again and recompute, while its generation is the same.
    Returns the body the status was computed from. Raises ApiError when attempts run out, the
    spec changed meanwhile (409: the next reconcile handles it), or the object is gone (404)."""
    for attempt in range(attempts):
        try:
            await write_status(kube, body, compute(body))
            return body
        except ApiError as exc:
            if exc.status != 409 or attempt == attempts - 1:
                raise
        meta = body["metadata"]
        fresh = await kube.get(INFERENCESERVICES, meta["namespace"], meta["name"])
        if fresh is None:
            raise ApiError(404, "NotFound", f"{meta['name']} was deleted")
        if fresh["metadata"].get("generation") != meta.get("generation"):
            raise ApiError(409, "Conflict", f"{meta['name']}'s spec changed meanwhile")
        body = fresh
    raise AssertionError("unreachable")


async def _fail(kube: Kube, body: Mapping[str, Any], reason: str, message: str) -> Outcome:
    previous = st.find_condition((body.get("status") or {}).get("conditions"), st.READY)
    await update_status(kube, body, lambda b: st.failed_status(b, reason, message, _now()))
    if not previous or (previous.get("reason"), previous.get("message")) != (reason, message):
        await post_event(kube, body, "Warning", reason, message)  # once per failure, not per resync
    return Outcome(ready="False", error=reason)


def _raise_for(exc: ApiError, what: str, retry: int) -> None:
    if exc.retryable:
        raise kopf.TemporaryError(f"{what}: {exc}", delay=retry_delay(retry)) from exc


async def _apply(kube: Kube, resource: Resource, body: Mapping[str, Any],
                 desired: dict[str, Any], plan: Any, *, always: bool = True,
                 ) -> tuple[dict[str, Any], str | None]:
    """Create ``desired`` if missing, or PUT what ``plan(desired, live)`` returns.
    ``always``: the child exists from the first reconcile on (a missing one was deleted).
    Returns the live child and a line saying what was done (None: nothing)."""
    meta = desired["metadata"]
    kind = desired["kind"]
    live = await kube.get(resource, meta["namespace"], meta["name"])
    if live is None:
        created = await kube.create(resource, desired)
        # A budget comes and goes with the replica range, the gateway with routing; the others
        # exist from the first pass.
        was = " (it had been deleted)" if always and (body.get("status") or {}).get(
            "observedGeneration") else ""
        return created, f"created {kind} {meta['name']}{was}"
    if live["metadata"].get("deletionTimestamp"):
        raise ApiError(409, "Terminating", f"{kind} {meta['name']} is being deleted; "
                                           f"it is recreated once gone")
    why_not = foreign_owner(live, body["metadata"].get("uid"), body["metadata"]["name"])
    if why_not:
        raise SpecError("ChildConflict", f"{kind} {meta['name']} already exists and {why_not}; "
                                         f"delete it or rename the InferenceService")
    new, why = plan(desired, live)
    if new is None:
        return live, None
    return await kube.replace(resource, new), f"updated {kind} {meta['name']}: {why}"


async def _model_pods(kube: Kube, namespace: str, name: str,
                      deployment: Mapping[str, Any] | None, unreported: bool) -> list[dict[str, Any]]:
    """The service's pods when fewer are ready than wanted (to say why) or ``unreported`` (the
    status has no download report for the current model yet), else []."""
    if deployment is None:
        return []
    want = deployment.get("spec", {}).get("replicas", 1)
    if (deployment.get("status", {}).get("readyReplicas") or 0) >= want and not unreported:
        return []
    wanted = selector_labels(name)
    return [p for p in await kube.list(PODS, namespace, pod_selector(name))
            if wanted.items() <= ((p.get("metadata") or {}).get("labels") or {}).items()]


async def _remove(kube: Kube, resource: Resource, body: Mapping[str, Any], name: str,
                  kind: str, why: str) -> str | None:
    """Delete the service's child ``kind name`` if it exists and is its own. Returns a line
    saying so (with ``why``), or None."""
    meta = body["metadata"]
    live = await kube.get(resource, meta["namespace"], name)
    if live is None or foreign_owner(live, meta.get("uid"), meta["name"]):
        return None
    if not await kube.delete(resource, meta["namespace"], name):
        return None
    return f"deleted {kind} {name}: {why}"


async def _remove_budget(kube: Kube, body: Mapping[str, Any]) -> str | None:
    """Delete the service's PodDisruptionBudget if it has one of its own (it runs at most one
    pod now). Returns a line saying so, or None."""
    return await _remove(kube, DISRUPTION_BUDGETS, body, body["metadata"]["name"],
                         "PodDisruptionBudget", "the service runs at most one pod")


async def _remove_gateway(kube: Kube, body: Mapping[str, Any]) -> list[str]:
    """Delete the gateway's Deployment, RoleBinding, Role and ServiceAccount (routing is off).
    Returns a line per object deleted."""
    name, why = gateway_name(body["metadata"]["name"]), "spec.routing.enabled is false"
    lines = [await _remove(kube, DEPLOYMENTS, body, name, "Deployment", why),
             await _remove(kube, ROLE_BINDINGS, body, name, "RoleBinding", why),
             await _remove(kube, ROLES, body, name, "Role", why),
             await _remove(kube, SERVICE_ACCOUNTS, body, name, "ServiceAccount", why)]
    return [line for line in lines if line]


async def _gateway_pods(kube: Kube, namespace: str, name: str,
                        gateway: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """The gateway's pods when none is ready (to say why), else []."""
    if gateway is None or (gateway.get("status", {}).get("readyReplicas") or 0) >= 1:
        return []
    wanted = gateway_selector_labels(name)
    return [p for p in await kube.list(PODS, namespace, gateway_selector(name))
            if wanted.items() <= ((p.get("metadata") or {}).get("labels") or {}).items()]


async def _apply_gateway(kube: Kube, body: Mapping[str, Any], gateway: list[dict[str, Any]],
                         ) -> tuple[dict[str, Any] | None, list[str]]:
    """Apply the gateway's objects (render_gateway's order: the account, its Role and binding,
    then the Deployment), or remove them when ``gateway`` is [] (routing off). Returns the live
    gateway Deployment (None when routing is off) and a line per change."""
    if not gateway:
        return None, await _remove_gateway(kube, body)
    account, role, binding, deployment = gateway
    actions = [(await _apply(kube, SERVICE_ACCOUNTS, body, account, plan_service,
                             always=False))[1],
               (await _apply(kube, ROLES, body, role, plan_service, always=False))[1],
               (await _apply(kube, ROLE_BINDINGS, body, binding, plan_service,
                             always=False))[1]]
    live, action = await _apply(kube, DEPLOYMENTS, body, deployment, plan_gateway_deployment,
                                always=False)
    return live, [a for a in actions + [action] if a]


async def _apply_workload(kube: Kube, body: Mapping[str, Any], spec: InferenceServiceSpec,
                          workload: dict[str, Any], hold: bool,
                          ) -> tuple[dict[str, Any], list[str | None]]:
    """Apply the model pods' Deployment or LeaderWorkerSet (:func:`workload_resource`), then
    delete the other kind of the same name if the service had it (``spec.parallelism.pipeline``
    crossed 1; the new one first, so the old serves until then). ``hold``: see
    :func:`plan_deployment`. Returns the live workload and a line per change. Raises SpecError
    (LeaderWorkerSetMissing) when the cluster does not serve LeaderWorkerSets."""
    resource, kind = workload_resource(spec)
    try:
        live, action = await _apply(kube, resource, body, workload,
                                    lambda d, live: plan_deployment(d, live, spec, hold_replicas=hold))
    except ApiError as exc:
        if exc.status == 404 and resource == LEADER_WORKER_SETS:
            raise SpecError("LeaderWorkerSetMissing", (
                f"spec.parallelism.pipeline is {spec.pipeline_parallel_size}, so each replica is a "
                f"LeaderWorkerSet group, but this cluster does not serve leaderworkersets."
                f"{LEADER_WORKER_SETS.group}/{LEADER_WORKER_SETS.version}: install the "
                f"LeaderWorkerSet controller (kubernetes-sigs/lws), or set pipeline to 1")) from exc
        raise
    other, other_kind = (DEPLOYMENTS, "Deployment") if resource == LEADER_WORKER_SETS else \
        (LEADER_WORKER_SETS, "LeaderWorkerSet")
    removed = await _remove(kube, other, body, body["metadata"]["name"], other_kind,
                            f"spec.parallelism.pipeline is {spec.pipeline_parallel_size}, so the "
                            f"pods run as a {kind}")
    return live, [action, removed]


async def reconcile(kube: Kube, namespace: str, name: str, *, retry: int = 0,
                    cluster_domain: str = "cluster.local") -> Outcome | None:
    """Bring InferenceService ``namespace/name``'s Deployment (or LeaderWorkerSet), Services, gateway and status in
    line with its spec. Returns None when the object is gone or being deleted.

    Raises kopf.TemporaryError (retry after ``retry_delay(retry)`` s) or kopf.PermanentError
    as described in the module docstring.
    """
    try:
        body = await kube.get(INFERENCESERVICES, namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return None
        try:
            spec = parse_spec(body.get("spec"), name=name)
            version = await kube.server_version()
            image_volumes = await kube.image_volumes_admitted(namespace) if needs_mount_probe(spec.model) else None
            deployment = render_workload(
                body, spec.model_copy(update={"model": resolve_oci_mount(spec.model, version, image_volumes)}), version)
            service = render_service(body, spec)
            pods_service = render_pods_service(body, spec)
            budget = render_disruption_budget(body, spec)
            gateway = render_gateway(body, spec)
            kopf.adopt([deployment, service, pods_service] + ([budget] if budget else [])
                       + gateway, owner=body)
            scaling = st.find_condition((body.get("status") or {}).get("conditions"),
                                        st.SCALING_ACTIVE) or {}
            hold = scaling.get("reason") == st.FOREIGN_SCALER  # the autoscaler stood back
            live_dep, dep_action = await _apply_workload(kube, body, spec, deployment, hold)
            # always=False: services made by an older operator get it on the first reconcile.
            _, pods_action = await _apply(kube, SERVICES, body, pods_service, plan_service,
                                          always=False)
            if budget is not None:
                _, pdb_action = await _apply(kube, DISRUPTION_BUDGETS, body, budget,
                                             plan_service, always=False)
            else:
                pdb_action = await _remove_budget(kube, body)
            live_gateway, gateway_actions = await _apply_gateway(kube, body, gateway)
            # Last: with routing on, the Service moves to the gateway once that exists.
            _, svc_action = await _apply(kube, SERVICES, body, service, plan_service)
        except SpecError as exc:
            return await _fail(kube, body, exc.reason, exc.message)

        actions = tuple(a for a in (*dep_action, pods_action, pdb_action, *gateway_actions,
                                    svc_action) if a)
        for action in actions:
            await post_event(kube, body, "Normal", action.split()[0].capitalize(),
                             action[0].upper() + action[1:])
        before = st.find_condition((body.get("status") or {}).get("conditions"), st.READY)
        url = service_url(name, namespace, cluster_domain)
        location = model_location(spec.model)
        unreported = location.downloaded and (
            (body.get("status") or {}).get("model") or {}).get("uri") != location.uri
        pods = await _model_pods(kube, namespace, name, live_dep, unreported)
        gateway_pods = await _gateway_pods(kube, namespace, name, live_gateway)
        await update_status(kube, body, lambda b: st.compute_status(
            b, spec, live_dep, now=_now(), url=url, pods=pods, gateway=live_gateway,
            gateway_pods=gateway_pods))
        ready, _, message = st.service_ready(spec, live_dep, pods, live_gateway, gateway_pods,
                                             _now())
        if before and before.get("status") != ready:
            await post_event(kube, body, "Normal" if ready == "True" else "Warning",
                             "Ready" if ready == "True" else "NotReady", message)
        return Outcome(ready=ready, actions=actions)
    except ApiError as exc:
        _raise_for(exc, f"reconciling {namespace}/{name}", retry)
        try:
            body = await kube.get(INFERENCESERVICES, namespace, name)
            if body is not None:
                await _fail(kube, body, "ApplyFailed", f"the API server refused a change: {exc}")
        except ApiError as again:
            _raise_for(again, f"reporting on {namespace}/{name}", retry)
        raise kopf.PermanentError(f"reconciling {namespace}/{name}: {exc}") from exc
