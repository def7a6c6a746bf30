"""Pure renderer of the LeaderWorkerSet that runs an InferenceService with
``spec.parallelism.pipeline`` > 1 (issue 34), and which workload kind a spec gets.

One replica is one LWS group of ``pipeline`` pods (kubernetes-sigs/lws ``leaderworkerset.x-k8s.io/v1``):
pod 0, the leader, runs the scheduler, the HTTP API and pipeline stage 0; pods 1 … M-1 run the
later stages' workers and answer ``/health`` only. Both templates are the Deployment's pod
template (:func:`~.resources.render_deployment`); its server arguments already carry the group's
flags (:func:`~.resources.parallel_args`), which read the rank and the leader's address from the
variables LWS's pod webhook injects. The Services select the leaders only
(:func:`~.resources.serving_selector_labels`), so the gateway sees one endpoint per group.
"""
from __future__ import annotations

import copy
from typing import Any, Mapping

from slipstream.api_types.parallelism import LWS_GROUP, LWS_KIND, LWS_VERSION
from slipstream.operator.kube import DEPLOYMENTS, LEADER_WORKER_SETS, Resource
from slipstream.operator.resources import SPEC_HASH_ANNOTATION, render_deployment, spec_hash
from slipstream.operator.spec import InferenceServiceSpec, parse_spec

# A pod of a group that fails restarts the whole group: the ranks' collectives cannot take a
# rank back mid-run, and the survivors would hang in them.
RESTART_POLICY = "RecreateGroupOnPodRestart"
# The workers start once the leader pod exists (not once it is ready: it is ready only when
# its workers have joined the rendezvous).
STARTUP_POLICY = "LeaderCreated"
# LWS's default, one shared headless Service named like the set, would take the name of the
# Service NAME (the ClusterIP one the operator owns): one headless Service per group instead,
# named like its leader pod (NAME-0, NAME-1 …), which LWS creates and owns.
SUBDOMAIN_POLICY = "UniquePerReplica"


def workload_resource(spec: InferenceServiceSpec) -> tuple[Resource, str]:
    """(resource, kind) of the model pods' workload: a LeaderWorkerSet with
    ``parallelism.pipeline`` > 1, else a Deployment. Both are named like the InferenceService
    and scaled through ``spec.replicas`` (an LWS's replica is a group)."""
    if spec.pipeline_parallel_size > 1:
        return LEADER_WORKER_SETS, LWS_KIND
    return DEPLOYMENTS, "Deployment"


def worker_template(leader: Mapping[str, Any]) -> dict[str, Any]:
    """The workers' pod template: the leader's, with startup and readiness probes on
    ``/health`` (a worker serves no API and is never ``/ready``), and no Prometheus scrape
    (the leader exports the group's metrics)."""
    template = copy.deepcopy(dict(leader))
    template.get("metadata", {}).get("annotations", {}).pop("prometheus.io/scrape", None)
    for container in template["spec"]["containers"]:
        for probe in ("startupProbe", "readinessProbe"):
            if probe in container:
                container[probe]["httpGet"]["path"] = "/health"
    return template


def render_leader_worker_set(body: Mapping[str, Any], spec: InferenceServiceSpec | None = None,
                             kube_version: tuple[int, int] | None = None) -> dict[str, Any]:
    """The LeaderWorkerSet for InferenceService ``body`` (a dict with metadata.name/namespace):
    ``spec.replicas`` groups (the initial count, as the Deployment's) of ``pipeline`` pods,
    group restart on any pod's restart, rolling updates one group at a time without surge (a
    surge group would need ``pipeline`` more nodes' GPUs). ``kube_version``: see
    :func:`~.resources.render_deployment`. Raises SpecError when the spec cannot be served."""
    name = body.get("metadata", {})["name"]
    spec = spec if spec is not None else parse_spec(body.get("spec"), name=name)
    deployment = render_deployment(body, spec, kube_version)
    leader = deployment["spec"]["template"]
    metadata = copy.deepcopy(deployment["metadata"])
    metadata["annotations"].pop(SPEC_HASH_ANNOTATION, None)
    lws: dict[str, Any] = {
        "apiVersion": f"{LWS_GROUP}/{LWS_VERSION}",
        "kind": LWS_KIND,
        "metadata": metadata,
        "spec": {
            "replicas": deployment["spec"]["replicas"],
            "startupPolicy": STARTUP_POLICY,
            "rolloutStrategy": {"type": "RollingUpdate",
                                "rollingUpdateConfiguration": {"maxUnavailable": 1, "maxSurge": 0}},
            "networkConfig": {"subdomainPolicy": SUBDOMAIN_POLICY},
            "leaderWorkerTemplate": {
                "size": spec.pipeline_parallel_size,
                "restartPolicy": RESTART_POLICY,
                "leaderTemplate": leader,
                "workerTemplate": worker_template(leader),
            },
        },
    }
    lws["metadata"]["annotations"][SPEC_HASH_ANNOTATION] = spec_hash(lws)
    return lws


def render_workload(body: Mapping[str, Any], spec: InferenceServiceSpec,
                    kube_version: tuple[int, int] | None = None) -> dict[str, Any]:
    """The Deployment or LeaderWorkerSet (:func:`workload_resource`) of ``body``'s model pods."""
    if spec.pipeline_parallel_size > 1:
        return render_leader_worker_set(body, spec, kube_version)
    return render_deployment(body, spec, kube_version)
