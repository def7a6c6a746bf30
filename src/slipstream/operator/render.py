"""Every object an InferenceService owns, rendered together: what ``slipstream operator render``
prints (the reconcile loop applies the same renderers one by one, in its own order)."""
from __future__ import annotations

from typing import Any, Mapping

import kopf

from slipstream.operator.gateway_resources import render_gateway, render_pods_service
from slipstream.operator.group_resources import render_workload
from slipstream.operator.resources import render_disruption_budget, render_service
from slipstream.operator.spec import parse_spec


def render_children(body: Mapping[str, Any],
                    kube_version: tuple[int, int] | None = None) -> list[dict[str, Any]]:
    """[Deployment (a LeaderWorkerSet with ``spec.parallelism.pipeline`` > 1), Service, headless
    Service ``NAME-pods``], the PodDisruptionBudget when the
    service can run more than one pod, and while routing is enabled the gateway's
    ServiceAccount, Role, RoleBinding and Deployment. When ``body`` has a uid (it came from a
    cluster), all carry its owner reference and labels (``kopf.adopt``), so deleting it deletes
    them. ``kube_version``: see :func:`~.resources.render_deployment`. Raises SpecError when the spec
    cannot be served."""
    name = body.get("metadata", {}).get("name")
    spec = parse_spec(body.get("spec"), name=name)
    budget = render_disruption_budget(body, spec)
    children = [render_workload(body, spec, kube_version), render_service(body, spec),
                render_pods_service(body, spec)] + ([budget] if budget else [])
    children += render_gateway(body, spec)
    if body.get("metadata", {}).get("uid"):
        kopf.adopt(children, owner=dict(body))
    return children
