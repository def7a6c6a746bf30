"""Pure renderers of the inference gateway of an InferenceService (dicts in, dicts out).

Per InferenceService ``NAME`` (issue 12, DESIGN.md "Gateway"):

- ``NAME-pods``: a headless Service selecting the model pods, port ``http``. The EndpointSlice
  controller lists its ready pods; the gateway watches those slices.
- ``NAME-gateway``: a Deployment of ``slipstream gateway`` pods (same image as the model pods),
  spread over nodes, with their own labels (so no Service selects the wrong pods), running as the
  ServiceAccount ``NAME-gateway``, which a Role and RoleBinding of the same name let list and
  watch EndpointSlices in the namespace (:data:`GATEWAY_RULES`, exactly the calls of
  server/gateway/endpointslices.py; the operator holds those verbs itself, as Kubernetes' RBAC
  escalation check demands of whoever creates the Role).
- The Service ``NAME`` (resources.render_service) selects the gateway pods while
  ``spec.routing.enabled``, the model pods otherwise.
"""
from __future__ import annotations

import copy
from typing import Any, Mapping

from slipstream.operator.resources import CONTAINER_SECURITY_CONTEXT, GATEWAY_COMPONENT, \
    PORT_NAME, POD_SECURITY_CONTEXT, PROBE_PERIOD_SECONDS, SPEC_HASH_ANNOTATION, \
    gateway_selector_labels, labels, serving_selector_labels, spec_hash
from slipstream.api_types.routing import DEFAULT_WEIGHTS, cli_flag
from slipstream.api_types.tenancy import DEFAULT_SCHEDULING_POLICY
from slipstream.operator.spec import InferenceServiceSpec, parse_spec

CONTAINER_NAME = "gateway"
GATEWAY_PORT = 8000
# The environment variable `slipstream serve` and `slipstream gateway` read the API key from.
API_KEY_ENV = "SLIPSTREAM_API_KEY"
# What the gateway's ServiceAccount may do: the EndpointSlice watcher's list and watch
# (server/gateway/endpointslices.py; tests/test_chart.py checks the two stay equal).
GATEWAY_RULES = ({"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                  "verbs": ["list", "watch"]},)
# The gateway's own drain on SIGTERM (its --shutdown-timeout default) plus a margin.
GATEWAY_GRACE_SECONDS = 40


def gateway_name(name: str) -> str:
    """The gateway Deployment's, ServiceAccount's, Role's and RoleBinding's name."""
    return f"{name}-gateway"


def pods_service_name(name: str) -> str:
    """The headless Service of the model pods (what the gateway watches)."""
    return f"{name}-pods"


def gateway_labels(name: str) -> dict[str, str]:
    """Labels of the gateway's objects and pods: the model pods' with component ``gateway``."""
    return {**labels(name), "app.kubernetes.io/component": GATEWAY_COMPONENT}


def gateway_selector(name: str) -> str:
    """:func:`gateway_selector_labels` as a label-selector string."""
    return ",".join(f"{k}={v}" for k, v in sorted(gateway_selector_labels(name).items()))


def _meta(body: Mapping[str, Any]) -> tuple[str, str]:
    meta = body.get("metadata", {})
    return meta["name"], meta.get("namespace") or "default"


def gateway_args(spec: InferenceServiceSpec, name: str, namespace: str) -> list[str]:
    """The ``slipstream gateway`` argument list (after the ``slipstream`` command)."""
    routing, weights = spec.routing, spec.routing.weights
    return [
        "gateway",
        "--host", "0.0.0.0",
        "--port", str(GATEWAY_PORT),
        "--service", pods_service_name(name),
        "--namespace", namespace,
        "--target-port-name", PORT_NAME,
        "--routing", routing.policy,
        *(arg for scorer in DEFAULT_WEIGHTS for arg in (cli_flag(scorer), str(float(getattr(weights, scorer))))),
        "--max-queue", str(routing.queue_size),
        "--queue-timeout", str(routing.queue_timeout_seconds),
        *(["--tenant-weights", spec.fairness.weights_argument()] if spec.fairness.weights_argument() else []),
        *(["--scheduling-policy", spec.fairness.policy] if spec.fairness.policy != DEFAULT_SCHEDULING_POLICY else []),
        *(["--tenant-token-limits", limits] if (limits := spec.fairness.token_limits_argument(routing.replicas)) else []),
    ]


def api_key_env(spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    """The model pods' ``SLIPSTREAM_API_KEY`` entry of ``spec.env`` (a value or, as it should
    be, a ``secretKeyRef``), for the gateway's own calls to the pods (/metrics is open, the
    tokenizer and KV events are not); [] when the pods run without a key."""
    return [var.manifest() for var in spec.env if var.name == API_KEY_ENV]


def render_gateway_deployment(body: Mapping[str, Any], spec: InferenceServiceSpec | None = None,
                              ) -> dict[str, Any]:
    """The gateway Deployment ``NAME-gateway``: ``spec.routing.replicas`` pods of ``slipstream
    gateway`` on port 8000 (``http``), readiness ``/ready``, liveness ``/health``, spread over
    nodes, small requests, PodSecurity ``restricted``. Raises SpecError (from parse_spec)."""
    name, namespace = _meta(body)
    spec = spec if spec is not None else parse_spec(body.get("spec"), name=name)
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": spec.image,
        "command": ["slipstream"],
        "args": gateway_args(spec, name, namespace),
        "ports": [{"name": PORT_NAME, "containerPort": GATEWAY_PORT, "protocol": "TCP"}],
        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"},
                      "limits": {"memory": "1Gi"}},
        "readinessProbe": {"httpGet": {"path": "/ready", "port": PORT_NAME},
                           "periodSeconds": PROBE_PERIOD_SECONDS, "timeoutSeconds": 2,
                           "failureThreshold": 2},
        "livenessProbe": {"httpGet": {"path": "/health", "port": PORT_NAME},
                          "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 3},
        "securityContext": copy.deepcopy(CONTAINER_SECURITY_CONTEXT),
    }
    if api_key_env(spec):
        container["env"] = api_key_env(spec)
    selector = gateway_selector_labels(name)
    deployment: dict[str, Any] = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": gateway_name(name), "namespace": namespace,
                     "labels": gateway_labels(name), "annotations": {}},
        "spec": {
            "replicas": spec.routing.replicas,
            "selector": {"matchLabels": selector},
            "strategy": {"type": "RollingUpdate",
                         "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {
                "metadata": {
                    "labels": gateway_labels(name),
                    "annotations": {"prometheus.io/scrape": "true",
                                    "prometheus.io/port": str(GATEWAY_PORT),
                                    "prometheus.io/path": "/metrics"},
                },
                "spec": {
                    "serviceAccountName": gateway_name(name),
                    # The EndpointSlice watcher logs in with the mounted token (in-cluster).
                    "automountServiceAccountToken": True,
                    "containers": [container],
                    "terminationGracePeriodSeconds": GATEWAY_GRACE_SECONDS,
                    "enableServiceLinks": False,
                    "securityContext": copy.deepcopy(POD_SECURITY_CONTEXT),
                    # One node going down takes one gateway, not all (ScheduleAnyway: a
                    # one-node cluster still runs both).
                    "topologySpreadConstraints": [{
                        "maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                        "whenUnsatisfiable": "ScheduleAnyway",
                        "labelSelector": {"matchLabels": dict(selector)}}],
                },
            },
        },
    }
    deployment["metadata"]["annotations"][SPEC_HASH_ANNOTATION] = spec_hash(deployment)
    return deployment


def render_gateway_service_account(body: Mapping[str, Any]) -> dict[str, Any]:
    """The gateway pods' ServiceAccount ``NAME-gateway``."""
    name, namespace = _meta(body)
    return {"apiVersion": "v1", "kind": "ServiceAccount",
            "metadata": {"name": gateway_name(name), "namespace": namespace,
                         "labels": gateway_labels(name)}}


def render_gateway_role(body: Mapping[str, Any]) -> dict[str, Any]:
    """The Role ``NAME-gateway``: :data:`GATEWAY_RULES` in the InferenceService's namespace."""
    name, namespace = _meta(body)
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": {"name": gateway_name(name), "namespace": namespace,
                         "labels": gateway_labels(name)},
            "rules": [copy.deepcopy(dict(rule)) for rule in GATEWAY_RULES]}


def render_gateway_role_binding(body: Mapping[str, Any]) -> dict[str, Any]:
    """The RoleBinding ``NAME-gateway``: the Role to the gateway's ServiceAccount."""
    name, namespace = _meta(body)
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": {"name": gateway_name(name), "namespace": namespace,
                         "labels": gateway_labels(name)},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                        "name": gateway_name(name)},
            "subjects": [{"kind": "ServiceAccount", "name": gateway_name(name),
                          "namespace": namespace}]}


def render_pods_service(body: Mapping[str, Any], spec: InferenceServiceSpec | None = None,
                        ) -> dict[str, Any]:
    """The headless Service ``NAME-pods`` of the model pods: no cluster IP, port ``http`` → the
    pods' ``http``. Its EndpointSlices mark pods that are not ready (``publishNotReadyAddresses``
    is left at false, which the API server does not even store, so it is not rendered: a field
    the live object lacks would read as drift). Raises SpecError (from parse_spec)."""
    name, namespace = _meta(body)
    spec = spec if spec is not None else parse_spec(body.get("spec"), name=name)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": pods_service_name(name), "namespace": namespace,
                     "labels": labels(name)},
        "spec": {
            "clusterIP": "None",
            "selector": serving_selector_labels(name, spec),
            "ports": [{"name": PORT_NAME, "port": spec.port, "targetPort": PORT_NAME,
                       "protocol": "TCP"}],
        },
    }


def render_gateway(body: Mapping[str, Any], spec: InferenceServiceSpec,
                   ) -> list[dict[str, Any]]:
    """[ServiceAccount, Role, RoleBinding, Deployment] of the gateway while routing is enabled,
    else []. The order is the order of creation: the pods need their account first."""
    if not spec.routing.enabled:
        return []
    return [render_gateway_service_account(body), render_gateway_role(body),
            render_gateway_role_binding(body), render_gateway_deployment(body, spec)]
