"""Pure comparison of a rendered child with the live one, and the object to write back.

The live object carries server defaults (``imagePullPolicy``, ``clusterIP``, probe ``scheme``
…) that the rendered one lacks, so "in sync" means: every field we render is there with an
equal value (quantities, under ``resources`` and an emptyDir's ``sizeLimit``, compared by
value: ``"1000m" == "1"``), and the Deployment's spec-hash annotation equals the rendered one
(that catches a spec change that only removes a field).
An update starts from the live object and replaces what we own, so fields other controllers
keep there (``deployment.kubernetes.io/revision``, ``clusterIP``) survive.
"""
from __future__ import annotations

import copy
from decimal import Decimal
from typing import Any, Mapping

from kubernetes.utils.quantity import parse_quantity

from slipstream.operator.resources import INSTANCE_LABEL, SPEC_HASH_ANNOTATION
from slipstream.operator.spec import InferenceServiceSpec


def _quantity(value: Any) -> Decimal | None:
    try:
        return parse_quantity(value)
    except (ValueError, TypeError, ArithmeticError):
        return None


def contains(live: Any, desired: Any, path: tuple[str, ...] = ()) -> bool:
    """True when ``live`` holds everything ``desired`` says: dicts by their keys (extra live
    keys allowed; an empty desired dict or list may be absent), lists element by element with
    equal lengths, scalars equal, and under a ``resources`` key (or as a ``sizeLimit``)
    quantities equal by value."""
    if isinstance(desired, Mapping):
        if not isinstance(live, Mapping):
            return False
        for key, want in desired.items():
            if key not in live:
                if want in ({}, []):
                    continue
                return False
            if not contains(live[key], want, path + (key,)):
                return False
        return True
    if isinstance(desired, list):
        return (isinstance(live, list) and len(live) == len(desired)
                and all(contains(a, b, path) for a, b in zip(live, desired)))
    if live == desired and type(live) is type(desired):
        return True
    if "resources" in path or path[-1:] == ("sizeLimit",):
        a, b = _quantity(live), _quantity(desired)
        return a is not None and a == b
    return isinstance(live, (int, float)) and isinstance(desired, (int, float)) and \
        not isinstance(live, bool) and not isinstance(desired, bool) and live == desired


def foreign_owner(live: Mapping[str, Any], owner_uid: str | None, name: str) -> str | None:
    """Why ``live`` must not be taken over (another controller owns it, or it is not ours),
    or None when it is ours."""
    meta = live.get("metadata", {})
    for ref in meta.get("ownerReferences") or ():
        if ref.get("controller") and owner_uid and ref.get("uid") != owner_uid:
            return f"it is controlled by {ref.get('kind')} {ref.get('name')}"
    if (meta.get("labels") or {}).get(INSTANCE_LABEL) != name:
        return f"it lacks the label {INSTANCE_LABEL}={name}, so something else made it"
    return None


def _merged(live: Mapping[str, Any], desired: Mapping[str, Any]) -> dict[str, Any]:
    """``live`` with our labels, annotations, owner references, top-level spec keys and the
    other top-level fields we render (a Role's ``rules``, a RoleBinding's ``subjects``)."""
    new = copy.deepcopy(dict(live))
    new.pop("status", None)
    meta, want = new.setdefault("metadata", {}), desired.get("metadata", {})
    meta["labels"] = {**(meta.get("labels") or {}), **want.get("labels", {})}
    annotations = {**(meta.get("annotations") or {}), **want.get("annotations", {})}
    if annotations:
        meta["annotations"] = annotations
    if want.get("ownerReferences"):
        meta["ownerReferences"] = want["ownerReferences"]
    for key, value in desired.items():
        if key == "spec":
            new["spec"] = {**(new.get("spec") or {}), **copy.deepcopy(value)}
        elif key not in ("apiVersion", "kind", "metadata"):
            new[key] = copy.deepcopy(value)
    return new


def plan_deployment(desired: Mapping[str, Any], live: Mapping[str, Any],
                    spec: InferenceServiceSpec, hold_replicas: bool = False,
                    ) -> tuple[dict[str, Any] | None, str]:
    """The Deployment (or LeaderWorkerSet) to PUT (``live``'s resourceVersion kept, so a concurrent change makes it
    409) and why, or (None, "") when ``live`` is in sync.

    With autoscaling on, ``spec.replicas`` stays the live value (the autoscaler's), only pulled
    into [minReplicas, maxReplicas], and not even that with ``hold_replicas`` (another scaler
    writes them: the autoscaler stood back); with it off, it is ``spec.replicas`` of the service.
    """
    want = copy.deepcopy(dict(desired))
    live_replicas = live.get("spec", {}).get("replicas", 1)
    if spec.autoscaling.enabled and hold_replicas:
        want["spec"]["replicas"] = live_replicas
    elif spec.autoscaling.enabled:
        want["spec"]["replicas"] = spec.autoscaling.clamp(live_replicas)
    if contains(live, want):  # the spec-hash annotation included: removals count too
        return None, ""
    live_hash = (live.get("metadata", {}).get("annotations") or {}).get(SPEC_HASH_ANNOTATION)
    if live_hash != want["metadata"]["annotations"][SPEC_HASH_ANNOTATION]:
        why = "the InferenceService's spec changed" + (
            "; rolling the pods" if not contains(_pods_of(live), _pods_of(want)) else "")
    elif live_replicas != want["spec"]["replicas"] and contains(
            {**live, "spec": {**live["spec"], "replicas": want["spec"]["replicas"]}}, want):
        why = f"replicas {live_replicas} → {want['spec']['replicas']}"
    else:
        why = "restored fields that were changed outside the operator"
    return _merged(live, want), why


def _pods_of(workload: Mapping[str, Any]) -> Any:
    """What a workload's pods are made from: a Deployment's ``template``, a LeaderWorkerSet's
    ``leaderWorkerTemplate``."""
    spec = workload.get("spec") or {}
    return spec.get("template", spec.get("leaderWorkerTemplate"))


def plan_service(desired: Mapping[str, Any], live: Mapping[str, Any],
                 ) -> tuple[dict[str, Any] | None, str]:
    """The Service (or PodDisruptionBudget, ServiceAccount, Role, RoleBinding) to PUT and why,
    or (None, "") when ``live`` is in sync."""
    if contains(live, desired):
        return None, ""
    return _merged(live, desired), "restored fields that were changed outside the operator"


def plan_gateway_deployment(desired: Mapping[str, Any], live: Mapping[str, Any],
                            ) -> tuple[dict[str, Any] | None, str]:
    """The gateway Deployment to PUT and why, or (None, "") when ``live`` is in sync. Its
    replicas are ``spec.routing.replicas``: no autoscaler touches them."""
    if contains(live, desired):
        return None, ""
    live_hash = (live.get("metadata", {}).get("annotations") or {}).get(SPEC_HASH_ANNOTATION)
    if live_hash != desired["metadata"]["annotations"][SPEC_HASH_ANNOTATION]:
        why = "the InferenceService's routing spec changed"
    elif live.get("spec", {}).get("replicas") != desired["spec"]["replicas"]:
        why = f"gateway replicas {live.get('spec', {}).get('replicas')} → " \
              f"{desired['spec']['replicas']}"
    else:
        why = "restored fields that were changed outside the operator"
    return _merged(live, desired), why
