"""spec.parallelism rendered (issue 34): tensor ranks in one pod (a Deployment), and pipeline
stages over pods (a LeaderWorkerSet whose group is one replica)."""
from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest

from slipstream.api_types.parallelism import GPUS_EQUAL_TENSOR_RULE, LWS_WORKER_INDEX_LABEL, MASTER_PORT
from slipstream.operator.gateway_resources import render_pods_service
from slipstream.operator.group_resources import render_leader_worker_set, workload_resource
from slipstream.operator.kube import DEPLOYMENTS, LEADER_WORKER_SETS
from slipstream.operator.render import render_children
from slipstream.operator.resources import (SPEC_HASH_ANNOTATION, render_deployment, render_service,
                                           selector_labels, serving_pod_selector)
from slipstream.operator.spec import SpecError, parse_spec

VERSION = "1.37"  # the newest Kubernetes kubernetes-validate knows
LLAMA_70B = {"model": {"uri": "hf://meta-llama/Meta-Llama-3-70B-Instruct"},
             "parallelism": {"tensor": 4, "pipeline": 2},
             "resources": {"cpu": "16", "memory": "256Gi", "gpus": 4}, "replicas": 3}


def isvc(**spec: Any) -> dict[str, Any]:
    return {"apiVersion": "slipstream.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "llama", "namespace": "ml"}, "spec": spec}


def server(pod_template: dict[str, Any]) -> dict[str, Any]:
    return pod_template["spec"]["containers"][0]


def test_gpus_unlike_tensor_are_refused_with_the_cel_rules_message():
    with pytest.raises(SpecError) as caught:
        parse_spec({"parallelism": {"tensor": 4}, "resources": {"gpus": 2}})
    assert caught.value.reason == "InvalidSpec"
    assert caught.value.message == GPUS_EQUAL_TENSOR_RULE.message


# --- tensor > 1, pipeline 1: one pod per replica -------------------------------------------------

def test_tensor_two_on_gpus_passes_the_size_limits_two_gpus_and_mounts_dev_shm():
    dep = render_deployment(isvc(parallelism={"tensor": 2}, resources={"gpus": 2, "memory": "32Gi"}))
    pod = dep["spec"]["template"]["spec"]
    args = server(dep["spec"]["template"])["args"]
    assert args[-2:] == ["--tensor-parallel-size", "2"]
    assert "--pipeline-parallel-size" not in args and "--nnodes" not in args
    assert server(dep["spec"]["template"])["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert pod["volumes"] == [{"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}}]
    assert {"name": "shm", "mountPath": "/dev/shm"} in server(dep["spec"]["template"])["volumeMounts"]
    assert "hostIPC" not in pod
    kubernetes_validate.validate(dep, VERSION, strict=True)


def test_gpus_alone_give_as_many_tensor_ranks():
    dep = render_deployment(isvc(resources={"gpus": 4, "memory": "32Gi"}))
    assert server(dep["spec"]["template"])["args"][-2:] == ["--tensor-parallel-size", "4"]


def test_tensor_two_on_cpu_runs_two_ranks_without_a_gpu_and_with_dev_shm():
    dep = render_deployment(isvc(parallelism={"tensor": 2}, resources={"memory": "8Gi"}))
    container = server(dep["spec"]["template"])
    assert container["args"][-2:] == ["--tensor-parallel-size", "2"]
    assert "nvidia.com/gpu" not in container["resources"]["limits"]
    assert dep["spec"]["template"]["spec"]["volumes"] == [
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}}]


def test_one_rank_passes_no_parallel_flag():
    for spec in ({}, {"resources": {"gpus": 1}}, {"parallelism": {"tensor": 1, "pipeline": 1}}):
        args = server(render_deployment(isvc(**spec))["spec"]["template"])["args"]
        assert not any(a.startswith(("--tensor", "--pipeline", "--nnodes")) for a in args), spec


# --- pipeline > 1: a LeaderWorkerSet, one group per replica --------------------------------------

def test_pipeline_two_renders_a_leader_worker_set_of_groups_of_two_pods():
    lws = render_leader_worker_set(isvc(**LLAMA_70B))
    assert (lws["apiVersion"], lws["kind"], lws["metadata"]["name"]) == (
        "leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet", "llama")
    spec = lws["spec"]
    assert spec["replicas"] == 3  # groups, not pods
    assert spec["startupPolicy"] == "LeaderCreated"
    assert spec["rolloutStrategy"] == {"type": "RollingUpdate", "rollingUpdateConfiguration": {
        "maxUnavailable": 1, "maxSurge": 0}}
    # Not LWS's shared headless Service named "llama": that name is the operator's ClusterIP Service.
    assert spec["networkConfig"] == {"subdomainPolicy": "UniquePerReplica"}
    template = spec["leaderWorkerTemplate"]
    assert (template["size"], template["restartPolicy"]) == (2, "RecreateGroupOnPodRestart")
    for pod in (template["leaderTemplate"], template["workerTemplate"]):
        assert server(pod)["resources"]["limits"]["nvidia.com/gpu"] == 4
        assert selector_labels("llama").items() <= pod["metadata"]["labels"].items()
        assert {"name": "shm", "mountPath": "/dev/shm"} in server(pod)["volumeMounts"]


def test_every_pod_of_a_group_takes_its_rank_and_the_leaders_address_from_lws():
    template = render_leader_worker_set(isvc(**LLAMA_70B))["spec"]["leaderWorkerTemplate"]
    for pod in (template["leaderTemplate"], template["workerTemplate"]):
        args = server(pod)["args"]
        assert args[args.index("--pipeline-parallel-size"):] == [
            "--pipeline-parallel-size", "2", "--tensor-parallel-size", "4", "--nnodes", "2",
            "--node-rank", "$(LWS_WORKER_INDEX)", "--master-addr", "$(LWS_LEADER_ADDRESS)",
            "--master-port", str(MASTER_PORT)]
    assert MASTER_PORT == 29500


def test_the_leader_is_ready_when_it_serves_and_a_worker_when_it_is_healthy():
    template = render_leader_worker_set(isvc(**LLAMA_70B))["spec"]["leaderWorkerTemplate"]
    leader, worker = server(template["leaderTemplate"]), server(template["workerTemplate"])
    assert leader["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert leader["startupProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert worker["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert worker["startupProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert worker["livenessProbe"] == leader["livenessProbe"]
    annotations = template["workerTemplate"]["metadata"]["annotations"]
    assert "prometheus.io/scrape" not in annotations
    assert template["leaderTemplate"]["metadata"]["annotations"]["prometheus.io/scrape"] == "true"


def test_the_services_and_the_scale_selector_pick_only_the_group_leaders():
    body = isvc(**LLAMA_70B, routing={"enabled": False})
    spec = parse_spec(body["spec"], name="llama")
    leaders = {**selector_labels("llama"), LWS_WORKER_INDEX_LABEL: "0"}
    assert render_service(body)["spec"]["selector"] == leaders
    assert render_pods_service(body)["spec"]["selector"] == leaders
    assert serving_pod_selector("llama", spec).split(",") == sorted(f"{k}={v}" for k, v in leaders.items())
    one_pod = isvc(replicas=3, routing={"enabled": False})
    assert render_service(one_pod)["spec"]["selector"] == selector_labels("llama")
    assert render_pods_service(one_pod)["spec"]["selector"] == selector_labels("llama")


def test_render_children_puts_the_leader_worker_set_where_the_deployment_was():
    kinds = [c["kind"] for c in render_children(isvc(**LLAMA_70B))]
    assert kinds[:3] == ["LeaderWorkerSet", "Service", "Service"]
    assert "Deployment" in kinds  # the gateway's, not the model's
    assert [c["metadata"]["name"] for c in render_children(isvc(**LLAMA_70B))
            if c["kind"] == "Deployment"] == ["llama-gateway"]


def test_workload_kind_follows_the_pipeline_size():
    assert workload_resource(parse_spec(LLAMA_70B)) == (LEADER_WORKER_SETS, "LeaderWorkerSet")
    assert workload_resource(parse_spec({"resources": {"gpus": 8}})) == (DEPLOYMENTS, "Deployment")


def test_the_spec_hash_sees_a_change_of_the_group_size():
    two = render_leader_worker_set(isvc(**LLAMA_70B))
    four = render_leader_worker_set(isvc(**{**LLAMA_70B, "parallelism": {"tensor": 4, "pipeline": 4}}))
    other_count = render_leader_worker_set(isvc(**{**LLAMA_70B, "replicas": 5}))
    hashes = [o["metadata"]["annotations"][SPEC_HASH_ANNOTATION] for o in (two, four, other_count)]
    assert hashes[0] != hashes[1] and hashes[0] == hashes[2]


def test_the_server_parser_takes_the_groups_arguments():
    """The contract with `slipstream serve` (the engine half of issue 34): its own parser takes
    what a group's pods run, the kubelet having expanded LWS's variables."""
    from slipstream.server.cli import serve_parser
    parser = serve_parser()
    template = render_leader_worker_set(isvc(**LLAMA_70B))["spec"]["leaderWorkerTemplate"]
    args = [a.replace("$(LWS_WORKER_INDEX)", "1").replace("$(LWS_LEADER_ADDRESS)", "llama-0.llama-0.ml")
            for a in server(template["workerTemplate"])["args"][1:]]
    parsed = parser.parse_args(args)
    assert (parsed.tensor_parallel_size, parsed.pipeline_parallel_size, parsed.nnodes, parsed.node_rank,
            parsed.master_addr, parsed.master_port) == (4, 2, 2, 1, "llama-0.llama-0.ml", MASTER_PORT)
