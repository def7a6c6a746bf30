"""The real operator (kopf, in-process) against an emulated Kubernetes API (kmock).

What the emulator covers and what it does not (garbage collection, admission webhooks, CEL
rules, the Deployment controller …) is listed in kube_emulator.py's docstring; here the
Deployment's status is written by hand where a test needs pods to look ready.
"""
from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest

from operator_helpers import NAMESPACE, eventually
from kube_emulator import ApiServer
from slipstream.operator.kube import DEPLOYMENTS, DISRUPTION_BUDGETS, INFERENCESERVICES, PODS, \
    ROLE_BINDINGS, ROLES, SERVICE_ACCOUNTS, SERVICES, Kube
from slipstream.operator.resources import labels
from slipstream.operator.resources import SPEC_HASH_ANNOTATION
from slipstream.operator.scaling import apply_scale

pytestmark = pytest.mark.timeout(60)


def inference_service(name: str = "chat", **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "slipstream.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"model": {"source": "builtin"}, **spec}}


def condition(obj: dict[str, Any] | None, type_: str) -> dict[str, Any] | None:
    for cond in ((obj or {}).get("status") or {}).get("conditions") or ():
        if cond["type"] == type_:
            return cond
    return None


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    return deployment["spec"]["template"]["spec"]["containers"][0]


def events(api: ApiServer, reason: str | None = None) -> list[dict[str, Any]]:
    found = [obj.raw for (res, _, _), obj in api.objects.items()
             if res.plural == "events" and not obj.deleted]
    return [e for e in found if reason is None or e.get("reason") == reason]


async def make_ready(kube: Kube, name: str) -> None:
    """Stand in for the Deployment controller and kubelet: every pod up to date and ready, the
    model pods' and (routing on) the gateway's."""
    for deployment in (name, f"{name}-gateway"):
        dep = await kube.get(DEPLOYMENTS, NAMESPACE, deployment)
        if dep is None:
            continue
        n = dep["spec"]["replicas"]
        await kube.merge_patch(DEPLOYMENTS, NAMESPACE, deployment, {"status": {
            "observedGeneration": dep["metadata"]["generation"], "replicas": n,
            "updatedReplicas": n, "readyReplicas": n, "availableReplicas": n}},
            subresource="status")


async def test_create_makes_deployment_service_status_and_finalizer(api, kube, operator):
    await kube.create(INFERENCESERVICES, inference_service(engine={"maxNumSeqs": 8}))

    dep = await eventually(lambda: kube.get(DEPLOYMENTS, NAMESPACE, "chat"), what="Deployment")
    svc = await eventually(lambda: kube.get(SERVICES, NAMESPACE, "chat"), what="Service")
    isvc = await kube.get(INFERENCESERVICES, NAMESPACE, "chat")
    owner = {"apiVersion": "slipstream.dev/v1alpha1", "kind": "InferenceService",
             "name": "chat", "uid": isvc["metadata"]["uid"], "controller": True,
             "blockOwnerDeletion": True}
    assert dep["metadata"]["ownerReferences"] == [owner]
    assert svc["metadata"]["ownerReferences"] == [owner]
    args = container(dep)["args"]
    assert args[args.index("--max-num-seqs") + 1] == "8"
    assert dep["spec"]["replicas"] == 1
    assert svc["spec"]["ports"][0]["port"] == 80
    assert "slipstream.dev/finalizer" in isvc["metadata"]["finalizers"]

    isvc = await eventually(lambda: _with_condition(kube, "chat", "Ready"), what="status")
    status = isvc["status"]
    assert status["url"] == "http://chat.ml.svc.cluster.local"
    assert status["observedGeneration"] == 1
    assert status["desiredReplicas"] == 1
    assert condition(isvc, "Ready")["status"] == "False"
    assert condition(isvc, "Progressing")["status"] == "True"
    assert condition(isvc, "ScalingActive")["reason"] == "AutoscalingDisabled"
    created = await eventually(lambda: events(api, "Created"), what="Created events")
    # `kubectl describe`'s "From": the operator, not kopf.
    assert created[0]["source"] == {"component": "slipstream-operator"}
    assert created[0]["reportingComponent"] == "slipstream-operator"

    await make_ready(kube, "chat")
    isvc = await eventually(lambda: _with_condition(kube, "chat", "Ready", "True"),
                            what="Ready=True")
    assert isvc["status"]["readyReplicas"] == 1
    assert condition(isvc, "Progressing")["reason"] == "RolloutComplete"


async def _with_condition(kube: Kube, name: str, type_: str, status: str | None = None):
    obj = await kube.get(INFERENCESERVICES, NAMESPACE, name)
    cond = condition(obj, type_)
    return obj if cond and (status is None or cond["status"] == status) else None


async def test_spec_change_rolls_pods_and_replica_change_does_not(kube, operator):
    await kube.create(INFERENCESERVICES, inference_service())
    first = await eventually(lambda: kube.get(DEPLOYMENTS, NAMESPACE, "chat"), what="Deployment")

    isvc = await kube.get(INFERENCESERVICES, NAMESPACE, "chat")
    await kube.merge_patch(INFERENCESERVICES, NAMESPACE, "chat", {"spec": {"replicas": 3}})
    scaled = await eventually(lambda: _deployment_where(kube, lambda d: d["spec"]["replicas"] == 3),
                              what="replicas 3")
    assert scaled["spec"]["template"] == first["spec"]["template"]  # no restart

    await kube.merge_patch(INFERENCESERVICES, NAMESPACE, "chat",
                           {"spec": {"engine": {"maxNumSeqs": 4}, "env": [
                               {"name": "LOG_LEVEL", "value": "debug"}]}})
    rolled = await eventually(lambda: _deployment_where(
        kube, lambda d: "4" in container(d)["args"]), what="new template")
    assert container(rolled)["env"] == [{"name": "HF_HUB_OFFLINE", "value": "1"},
                                        {"name": "LOG_LEVEL", "value": "debug"}]
    assert rolled["spec"]["replicas"] == 3
    assert rolled["metadata"]["annotations"][SPEC_HASH_ANNOTATION] != \
        first["metadata"]["annotations"][SPEC_HASH_ANNOTATION]
    assert rolled["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0

    # A field removed from the spec leaves the Deployment too (the spec hash catches it).
    await kube.merge_patch(INFERENCESERVICES, NAMESPACE, "chat", {"spec": {"env": None}})
    await eventually(lambda: _deployment_where(
        kube, lambda d: container(d)["env"] == [{"name": "HF_HUB_OFFLINE", "value": "1"}]), what="env removed")
    isvc = await eventually(lambda: _where(kube, lambda o: o["status"].get(
        "observedGeneration") == o["metadata"]["generation"]), what="observedGeneration")
    assert isvc["metadata"]["generation"] == 4


async def test_disruption_budget_follows_the_replica_range(api, kube, operator):
    await kube.create(INFERENCESERVICES, inference_service(replicas=3))
    pdb = await eventually(lambda: kube.get(DISRUPTION_BUDGETS, NAMESPACE, "chat"),
                           what="PodDisruptionBudget")
    isvc = await kube.get(INFERENCESERVICES, NAMESPACE, "chat")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["metadata"]["ownerReferences"][0]["uid"] == isvc["metadata"]["uid"]

    await kube.merge_patch(INFERENCESERVICES, NAMESPACE, "chat", {"spec": {"replicas": 1}})
    await eventually(lambda: _no_budget(kube), what="budget deleted")
    await eventually(lambda: any("PodDisruptionBudget chat" in e["message"]
                                 for e in events(api, "Deleted")), what="a Deleted Event")
    await kube.merge_patch(INFERENCESERVICES, NAMESPACE, "chat", {"spec": {"autoscaling": {
        "enabled": True, "maxReplicas": 3}}})
    await eventually(lambda: kube.get(DISRUPTION_BUDGETS, NAMESPACE, "chat"), what="budget back")


async def _no_budget(kube: Kube) -> bool:
    return await kube.get(DISRUPTION_BUDGETS, NAMESPACE, "chat") is None


@pytest.mark.resync(600)  # no resync within the test: the watch on the pods acts
async def test_a_pod_that_cannot_pull_its_image_makes_ready_say_so(api, kube, operator):
    await kube.create(INFERENCESERVICES, inference_service(image="example.com/nope:1"))
    await eventually(lambda: _with_condition(kube, "chat", "Ready"), what="first status")
    await kube.create(PODS, {  # as the kubelet reports a pull that failed
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "chat-abc", "namespace": NAMESPACE, "labels": labels("chat")},
        "spec": {"containers": [{"name": "server", "image": "example.com/nope:1"}]},
        "status": {"phase": "Pending", "containerStatuses": [{
            "name": "server", "ready": False, "restartCount": 0, "image": "example.com/nope:1",
            "imageID": "", "state": {"waiting": {
                "reason": "ErrImagePull",
                "message": 'failed to pull image "example.com/nope:1": not found'}}}]}})
    isvc = await eventually(lambda: _where(kube, lambda o: condition(o, "Ready")["reason"] ==
                                           "ImagePullFailed"), what="Ready=False ImagePullFailed")
    assert 'failed to pull image "example.com/nope:1"' in condition(isvc, "Ready")["message"]


async def test_change_outside_the_pods_leaves_the_deployment_alone(kube, operator):
    await kube.create(INFERENCESERVICES, inference_service(autoscaling={"enabled": False}))
    await eventually(lambda: _where(kube, lambda o: o["status"].get("observedGeneration") == 1),
                     what="first reconcile")
    before = await kube.get(DEPLOYMENTS, NAMESPACE, "chat")
    await kube.merge_patch(INFERENCESERVICES, NAMESPACE, "chat",
                           {"spec": {"autoscaling": {"targetQueueDepth": 9}}})
    await eventually(lambda: _where(kube, lambda o: o["status"].get("observedGeneration") == 2),
                     what="second reconcile")
    after = await kube.get(DEPLOYMENTS, NAMESPACE, "chat")
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]


@pytest.mark.resync(600)  # no resync within the test: the watch on the children acts
async def test_hand_deleted_service_and_hand_edited_deployment_come_back(api, kube, operator):
    await kube.create(INFERENCESERVICES, inference_service())
    svc = await eventually(lambda: kube.get(SERVICES, NAMESPACE, "chat"), what="Service")
    dep = await eventually(lambda: kube.get(DEPLOYMENTS, NAMESPACE, "chat"), what="Deployment")

    await kube.request("DELETE", SERVICES.path(NAMESPACE, "chat"))
    back = await eventually(lambda: kube.get(SERVICES, NAMESPACE, "chat"), what="Service back")
    assert back["metadata"]["uid"] != svc["metadata"]["uid"]
    assert back["spec"]["ports"] == svc["spec"]["ports"]

    edited = copy.deepcopy(dep)
    container(edited)["image"] = "example.com/someone-else:latest"
    edited["spec"]["replicas"] = 7
    await kube.replace(DEPLOYMENTS, edited)
    restored = await eventually(lambda: _deployment_where(
        kube, lambda d: container(d)["image"] == container(dep)["image"]), what="restored")
    assert restored["spec"]["replicas"] == 1
    await eventually(lambda: any("outside the operator" in e["message"]
                                 for e in events(api, "Updated")), what="an Updated event")


async def test_delete_removes_the_finalizer_and_children_are_owned(api, kube, operator):
    await kube.create(INFERENCESERVICES, inference_service())
    await eventually(lambda: _where(kube, lambda o: "slipstream.dev/finalizer" in o[
        "metadata"].get("finalizers", [])), what="finalizer")
    dep = await eventually(lambda: kube.get(DEPLOYMENTS, NAMESPACE, "chat"), what="Deployment")

    await kube.request("DELETE", INFERENCESERVICES.path(NAMESPACE, "chat"))
    await eventually(lambda: _gone(kube), what="InferenceService gone")
    # The emulator has no garbage collector; the owner reference is what lets the real one act.
    uid = dep["metadata"]["ownerReferences"][0]["uid"]
    assert api.objects["slipstream.dev/v1alpha1/inferenceservices", NAMESPACE, "chat"] \
        .history[-2]["metadata"]["uid"] == uid


async def test_gpus_unlike_tensor_are_invalid_spec_without_cel(api, kube, operator):
    """The emulator runs no CEL rule (an API server older than 1.25 neither): the operator's
    own check says it, and two GPUs alone are two tensor-parallel ranks."""
    await kube.create(INFERENCESERVICES, inference_service(
        "tp", parallelism={"tensor": 4}, resources={"gpus": 2, "memory": "32Gi"}))
    await kube.create(INFERENCESERVICES, inference_service("tp2", resources={"gpus": 2, "memory": "32Gi"}))
    isvc = await eventually(lambda: _with_condition(kube, "tp", "Ready"), what="tp status")
    ready = condition(isvc, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec")
    assert "spec.resources.gpus must equal spec.parallelism.tensor" in ready["message"]
    assert await kube.get(DEPLOYMENTS, NAMESPACE, "tp") is None
    dep = await eventually(lambda: kube.get(DEPLOYMENTS, NAMESPACE, "tp2"), what="tp2 Deployment")
    assert container(dep)["args"][-2:] == ["--tensor-parallel-size", "2"]


async def test_invalid_spec_is_reported_and_other_services_still_served(api, kube, operator):
    bad = inference_service("bad", engine={"kvCacheMemory": "8Gi"}, resources={"memory": "4Gi"})
    await kube.create(INFERENCESERVICES, bad)
    await kube.create(INFERENCESERVICES, inference_service("good"))

    isvc = await eventually(lambda: _with_condition(kube, "bad", "Ready"), what="bad status")
    ready = condition(isvc, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec")
    assert "kvCacheMemory" in ready["message"]
    await eventually(lambda: events(api, "InvalidSpec"), what="Warning event")
    assert events(api, "InvalidSpec")[0]["type"] == "Warning"
    assert await kube.get(DEPLOYMENTS, NAMESPACE, "bad") is None
    await eventually(lambda: kube.get(DEPLOYMENTS, NAMESPACE, "good"), what="good Deployment")

    await kube.merge_patch(INFERENCESERVICES, NAMESPACE, "bad",
                           {"spec": {"resources": {"memory": "16Gi"}}})
    await eventually(lambda: kube.get(DEPLOYMENTS, NAMESPACE, "bad"), what="fixed Deployment")
    await asyncio.sleep(1.5)  # a resync or two: the Warning is not repeated
    assert len(events(api, "InvalidSpec")) == 1


async def test_api_errors_are_retried_and_refusals_reported(api, kube, operator):
    api.fail_next("POST", "deployments", 503, name="flaky")
    await kube.create(INFERENCESERVICES, inference_service("flaky"))
    await eventually(lambda: kube.get(DEPLOYMENTS, NAMESPACE, "flaky"), what="retried create")

    api.fail_next("POST", "deployments", 422, name="refused")  # not flaky's resync, which posts too
    await kube.create(INFERENCESERVICES, inference_service("refused"))
    isvc = await eventually(lambda: _with_condition(kube, "refused", "Ready"), what="status")
    assert condition(isvc, "Ready")["reason"] == "ApplyFailed"
    # The periodic resync is level-based: once the API accepts it, the service recovers.
    await eventually(lambda: kube.get(DEPLOYMENTS, NAMESPACE, "refused"), what="later create")


async def test_autoscaler_owns_replicas_while_enabled(api, kube, operator):
    await kube.create(INFERENCESERVICES, inference_service(
        autoscaling={"enabled": True, "minReplicas": 2, "maxReplicas": 6}))
    dep = await eventually(lambda: kube.get(DEPLOYMENTS, NAMESPACE, "chat"), what="Deployment")
    assert dep["spec"]["replicas"] == 2
    isvc = await eventually(lambda: _with_condition(kube, "chat", "ScalingActive"),
                            what="status")
    assert condition(isvc, "ScalingActive")["reason"] == "AwaitingMetrics"

    written = await apply_scale(kube, NAMESPACE, "chat", replicas=9, queue_depth=12.5,
                                kv_cache_utilization=0.91, message="queue 12.5 > target 5")
    assert written == 6  # clamped to maxReplicas
    assert (await kube.get(DEPLOYMENTS, NAMESPACE, "chat"))["spec"]["replicas"] == 6
    status = (await kube.get(INFERENCESERVICES, NAMESPACE, "chat"))["status"]
    assert (status["desiredReplicas"], status["queueDepth"], status["kvCachePercent"]) == \
        (6, 12.5, 91)
    assert condition({"status": status}, "ScalingActive")["status"] == "True"

    # A spec change re-renders the pods but keeps the autoscaler's count …
    await kube.merge_patch(INFERENCESERVICES, NAMESPACE, "chat",
                           {"spec": {"engine": {"maxNumSeqs": 4}}})
    dep = await eventually(lambda: _deployment_where(kube, lambda d: "4" in container(d)["args"]),
                           what="new template")
    assert dep["spec"]["replicas"] == 6
    await asyncio.sleep(1.5)  # resyncs do not touch it either
    assert (await kube.get(DEPLOYMENTS, NAMESPACE, "chat"))["spec"]["replicas"] == 6
    # … and pulls it into new bounds.
    await kube.merge_patch(INFERENCESERVICES, NAMESPACE, "chat",
                           {"spec": {"autoscaling": {"maxReplicas": 3}}})
    await eventually(lambda: _deployment_where(kube, lambda d: d["spec"]["replicas"] == 3),
                     what="clamped to 3")


async def test_existing_deployment_of_someone_else_is_not_taken_over(api, kube, operator):
    foreign = {"apiVersion": "apps/v1", "kind": "Deployment",
               "metadata": {"name": "chat", "namespace": NAMESPACE, "labels": {"app": "x"}},
               "spec": {"selector": {"matchLabels": {"app": "x"}}, "template": {
                   "metadata": {"labels": {"app": "x"}},
                   "spec": {"containers": [{"name": "x", "image": "x"}]}}}}
    await kube.create(DEPLOYMENTS, foreign)
    await kube.create(INFERENCESERVICES, inference_service())
    isvc = await eventually(lambda: _with_condition(kube, "chat", "Ready"), what="status")
    assert condition(isvc, "Ready")["reason"] == "ChildConflict"
    assert container(await kube.get(DEPLOYMENTS, NAMESPACE, "chat"))["image"] == "x"


async def _where(kube: Kube, predicate, name: str = "chat"):
    obj = await kube.get(INFERENCESERVICES, NAMESPACE, name)
    return obj if obj and "status" in obj and predicate(obj) else None


async def _deployment_where(kube: Kube, predicate, name: str = "chat"):
    obj = await kube.get(DEPLOYMENTS, NAMESPACE, name)
    return obj if obj and predicate(obj) else None


async def _gone(kube: Kube, name: str = "chat") -> bool:
    return await kube.get(INFERENCESERVICES, NAMESPACE, name) is None


async def test_routing_brings_the_gateway_and_turning_it_off_removes_it(api, kube, operator):
    await kube.create(INFERENCESERVICES, inference_service(routing={"policy": "prefix"}))
    gateway = await eventually(lambda: kube.get(DEPLOYMENTS, NAMESPACE, "chat-gateway"),
                               what="gateway Deployment")
    isvc = await kube.get(INFERENCESERVICES, NAMESPACE, "chat")
    uid = isvc["metadata"]["uid"]
    children = [gateway] + [await kube.get(resource, NAMESPACE, name) for resource, name in (
        (SERVICE_ACCOUNTS, "chat-gateway"), (ROLES, "chat-gateway"),
        (ROLE_BINDINGS, "chat-gateway"), (SERVICES, "chat-pods"))]
    for child in children:
        assert child is not None
        assert child["metadata"]["ownerReferences"][0]["uid"] == uid
    assert "prefix" in container(gateway)["args"]
    svc = await eventually(lambda: kube.get(SERVICES, NAMESPACE, "chat"), what="Service")
    assert svc["spec"]["selector"] == gateway["spec"]["selector"]["matchLabels"]

    # Model pods ready, gateway not: the service is not Ready, and says why.
    dep = await kube.get(DEPLOYMENTS, NAMESPACE, "chat")
    await kube.merge_patch(DEPLOYMENTS, NAMESPACE, "chat", {"status": {
        "observedGeneration": dep["metadata"]["generation"], "replicas": 1,
        "updatedReplicas": 1, "readyReplicas": 1, "availableReplicas": 1}},
        subresource="status")
    isvc = await eventually(lambda: _where(kube, lambda o: (condition(o, "Ready") or {}).get(
        "reason") == "NoGatewayReplicasReady"), what="Ready=False for the gateway")
    assert condition(isvc, "GatewayReady")["status"] == "False"
    await make_ready(kube, "chat")
    isvc = await eventually(lambda: _with_condition(kube, "chat", "Ready", "True"),
                            what="Ready=True")
    assert condition(isvc, "GatewayReady")["status"] == "True"
    assert isvc["status"]["gateway"] == {"url": "http://chat.ml.svc.cluster.local",
                                         "replicas": 2, "readyReplicas": 2}

    await kube.merge_patch(INFERENCESERVICES, NAMESPACE, "chat",
                           {"spec": {"routing": {"enabled": False}}})
    await eventually(lambda: _where(kube, lambda o: "gateway" not in (o.get("status") or {})),
                     what="status.gateway removed")
    for resource in (DEPLOYMENTS, ROLE_BINDINGS, ROLES, SERVICE_ACCOUNTS):
        assert await kube.get(resource, NAMESPACE, "chat-gateway") is None, resource
    svc = await kube.get(SERVICES, NAMESPACE, "chat")
    assert svc["spec"]["selector"]["app.kubernetes.io/component"] == "model-server"
    assert await kube.get(SERVICES, NAMESPACE, "chat-pods") is not None
