"""Reconcile and autoscaling of an InferenceService with ``spec.parallelism.pipeline`` > 1 against
the API emulator: the LeaderWorkerSet in place of the Deployment, the switch between the two, the
status in groups, and the autoscaler writing the LWS's replicas.

The emulator serves LeaderWorkerSets from a CRD stand-in (:data:`LWS_CRD`, schema left open);
no LWS controller runs, so a group's status is written by hand as the controller would. The real
controller on the local control plane is a later session's (e2e/cluster).
"""
from __future__ import annotations

from typing import Any

import kmock
import pytest

from kube_emulator import ApiServer
from operator_helpers import NAMESPACE
from slipstream.api_types.parallelism import LWS_GROUP, LWS_KIND, LWS_PLURAL, LWS_VERSION, \
    LWS_WORKER_INDEX_LABEL
from slipstream.operator.kube import DEPLOYMENTS, INFERENCESERVICES, LEADER_WORKER_SETS, PODS, \
    SERVICES, Kube
from slipstream.operator.reconcile import reconcile
from slipstream.operator.resources import labels
from slipstream.operator.scaling import apply_scale

pytestmark = pytest.mark.timeout(60)

# What `kubectl apply` of LWS's CRD gives the API server, as far as these tests need: the
# resource, its status and scale subresources (the schema is LWS's business).
LWS_CRD = {"spec": {"group": LWS_GROUP, "scope": "Namespaced",
                    "names": {"kind": LWS_KIND, "plural": LWS_PLURAL, "singular": "leaderworkerset"},
                    "versions": [{"name": LWS_VERSION, "subresources": {"status": {}, "scale": {}},
                                  "schema": {"openAPIV3Schema": {
                                      "type": "object", "x-kubernetes-preserve-unknown-fields": True}}}]}}


@pytest.fixture
async def lws_api(crd: dict[str, Any]):
    """The emulator with the InferenceService CRD and LWS's."""
    async with ApiServer() as server, kmock.Server(server):
        server.add_crd(crd)
        server.add_crd(LWS_CRD)
        yield server


@pytest.fixture
async def lws_kube(lws_api: ApiServer):
    client = Kube(str(lws_api.url))
    yield client
    await client.close()


def inference_service(name: str = "llama", pipeline: int = 2, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "slipstream.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"model": {"source": "sim", "profile": "tiny"}, "routing": {"enabled": False},
                     "parallelism": {"tensor": 2, "pipeline": pipeline}, **spec}}


async def set_pipeline(kube: Kube, name: str, pipeline: int) -> None:
    await kube.merge_patch(INFERENCESERVICES, NAMESPACE, name, {"spec": {"parallelism": {"pipeline": pipeline}}})


async def groups_ready(kube: Kube, name: str, ready: int) -> None:
    """Stand in for the LWS controller: ``ready`` groups of the current spec ready."""
    lws = await kube.get(LEADER_WORKER_SETS, NAMESPACE, name)
    want = lws["spec"]["replicas"]
    await kube.merge_patch(LEADER_WORKER_SETS, NAMESPACE, name, {"status": {
        "observedGeneration": lws["metadata"]["generation"], "replicas": want,
        "updatedReplicas": want, "readyReplicas": ready}}, subresource="status")


async def test_pipeline_two_is_applied_as_an_owned_leader_worker_set_and_no_deployment(lws_kube):
    kube = lws_kube
    await kube.create(INFERENCESERVICES, inference_service(replicas=2))
    outcome = await reconcile(kube, NAMESPACE, "llama")

    lws = await kube.get(LEADER_WORKER_SETS, NAMESPACE, "llama")
    isvc = await kube.get(INFERENCESERVICES, NAMESPACE, "llama")
    assert "created LeaderWorkerSet llama" in outcome.actions
    assert await kube.get(DEPLOYMENTS, NAMESPACE, "llama") is None
    assert lws["metadata"]["ownerReferences"][0]["uid"] == isvc["metadata"]["uid"]
    assert (lws["spec"]["replicas"], lws["spec"]["leaderWorkerTemplate"]["size"]) == (2, 2)
    service = await kube.get(SERVICES, NAMESPACE, "llama")
    assert service["spec"]["selector"][LWS_WORKER_INDEX_LABEL] == "0"
    assert LWS_WORKER_INDEX_LABEL + "=0" in isvc["status"]["selector"].split(",")

    assert (await reconcile(kube, NAMESPACE, "llama")).actions == ()  # in sync: nothing to do


async def test_status_counts_ready_groups(lws_kube):
    kube = lws_kube
    await kube.create(INFERENCESERVICES, inference_service(replicas=2))
    await reconcile(kube, NAMESPACE, "llama")
    await groups_ready(kube, "llama", 1)
    outcome = await reconcile(kube, NAMESPACE, "llama")

    status = (await kube.get(INFERENCESERVICES, NAMESPACE, "llama"))["status"]
    assert outcome.ready == "True"
    assert (status["replicas"], status["readyReplicas"], status["desiredReplicas"]) == (2, 1, 2)
    progressing = next(c for c in status["conditions"] if c["type"] == "Progressing")
    assert progressing["reason"] == "RollingOut"  # one group of two not ready yet
    await groups_ready(kube, "llama", 2)
    await reconcile(kube, NAMESPACE, "llama")
    status = (await kube.get(INFERENCESERVICES, NAMESPACE, "llama"))["status"]
    progressing = next(c for c in status["conditions"] if c["type"] == "Progressing")
    assert progressing["reason"] == "RolloutComplete"


async def test_crossing_pipeline_one_swaps_the_deployment_and_the_leader_worker_set(lws_kube):
    kube = lws_kube
    await kube.create(INFERENCESERVICES, inference_service(pipeline=1))
    await reconcile(kube, NAMESPACE, "llama")
    assert await kube.get(DEPLOYMENTS, NAMESPACE, "llama") is not None

    await set_pipeline(kube, "llama", 2)
    outcome = await reconcile(kube, NAMESPACE, "llama")
    assert await kube.get(DEPLOYMENTS, NAMESPACE, "llama") is None
    assert await kube.get(LEADER_WORKER_SETS, NAMESPACE, "llama") is not None
    assert any(a.startswith("deleted Deployment llama: spec.parallelism.pipeline is 2")
               for a in outcome.actions), outcome.actions

    await set_pipeline(kube, "llama", 1)
    outcome = await reconcile(kube, NAMESPACE, "llama")
    assert await kube.get(LEADER_WORKER_SETS, NAMESPACE, "llama") is None
    assert await kube.get(DEPLOYMENTS, NAMESPACE, "llama") is not None
    assert any(a.startswith("deleted LeaderWorkerSet llama") for a in outcome.actions), outcome.actions


async def test_without_the_lws_crd_the_service_says_to_install_it(api, kube):
    await kube.create(INFERENCESERVICES, inference_service())
    outcome = await reconcile(kube, NAMESPACE, "llama")

    ready = next(c for c in (await kube.get(INFERENCESERVICES, NAMESPACE, "llama"))["status"]["conditions"]
                 if c["type"] == "Ready")
    assert (outcome.ready, outcome.error) == ("False", "LeaderWorkerSetMissing")
    assert "install the LeaderWorkerSet controller" in ready["message"]


async def test_the_autoscaler_scales_the_leader_worker_sets_groups(lws_kube):
    kube = lws_kube
    await kube.create(INFERENCESERVICES, inference_service(
        autoscaling={"enabled": True, "minReplicas": 1, "maxReplicas": 3}))
    await reconcile(kube, NAMESPACE, "llama")
    assert (await kube.get(LEADER_WORKER_SETS, NAMESPACE, "llama"))["spec"]["replicas"] == 1

    assert await apply_scale(kube, NAMESPACE, "llama", replicas=5, message="queue") == 3
    assert (await kube.get(LEADER_WORKER_SETS, NAMESPACE, "llama"))["spec"]["replicas"] == 3
    assert (await kube.get(INFERENCESERVICES, NAMESPACE, "llama"))["status"]["desiredReplicas"] == 3
    # The reconcile loop leaves the autoscaler's count alone.
    await reconcile(kube, NAMESPACE, "llama")
    assert (await kube.get(LEADER_WORKER_SETS, NAMESPACE, "llama"))["spec"]["replicas"] == 3


async def test_the_autoscalers_tick_scrapes_only_group_leaders(lws_kube):
    from slipstream.operator.autoscaling_loop import Autoscaler
    kube = lws_kube
    await kube.create(INFERENCESERVICES, inference_service(
        autoscaling={"enabled": True, "minReplicas": 1, "maxReplicas": 3}))
    await reconcile(kube, NAMESPACE, "llama")
    for index, ready in (("0", False), ("1", True)):  # a starting leader, a ready worker
        await kube.create(PODS, {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"llama-0-{index}", "namespace": NAMESPACE,
                         "labels": {**labels("llama"), LWS_WORKER_INDEX_LABEL: index}},
            "spec": {"containers": [{"name": "server", "image": "slipstream"}]},
            "status": {"phase": "Running", "podIP": "127.0.0.9", "conditions": [
                {"type": "Ready", "status": "True" if ready else "False"}]}})
    autoscaler = Autoscaler()
    try:
        body = await kube.get(INFERENCESERVICES, NAMESPACE, "llama")
        result = await autoscaler.tick(kube, NAMESPACE, "llama", body)
    finally:
        await autoscaler.close()
    # The worker is ready but is no endpoint: the one leader counts, as starting.
    assert (result.ready, result.starting) == (0, 1)
