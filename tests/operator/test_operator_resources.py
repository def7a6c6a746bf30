"""The pure renderers: InferenceService → Deployment, Services, PodDisruptionBudget and the
gateway's objects, checked against Kubernetes' own schemas (kubernetes-validate, strict: unknown
fields fail) and against what the pods need."""
from __future__ import annotations

import copy
import re
from typing import Any

import kubernetes_validate
import pytest
import yaml

from operator_helpers import CRD_PATH, EXAMPLES
from pod_security import restricted_violations
from slipstream.operator.render import render_children
from slipstream.operator.resources import (PRESTOP_SLEEP_SECONDS, SPEC_HASH_ANNOTATION, server_args,
                                           needs_disruption_budget, pod_selector, render_deployment,
                                           render_disruption_budget, render_service, spec_hash)
from slipstream.operator.gateway_resources import GATEWAY_RULES, gateway_args, \
    render_gateway, render_gateway_deployment, render_pods_service
from slipstream.operator.model_spec import quantity_bytes
from slipstream.operator.spec import SpecError, parse_spec

# The newest Kubernetes kubernetes-validate knows, and the oldest this CRD supports (CEL rules
# in CRDs are on by default from 1.25).
VERSIONS = ("1.37", "1.25")


def isvc(name: str = "chat", namespace: str = "ml", **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "slipstream.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": name, "namespace": namespace}, "spec": spec}


SPECS = {
    "defaults": {},
    "gpu": {"resources": {"cpu": "8", "memory": "32Gi", "gpus": 1},
            "engine": {"kvCacheMemory": "40Gi", "maxModelLen": 8192}},
    "gpu-profiled": {"resources": {"memory": "1Gi", "gpus": 1},
                     "engine": {"gpuMemoryUtilization": 0.85, "enforceEager": True}},
    "dequantized": {"engine": {"quantization": "none"}},
    "deep-queue": {"engine": {"maxWaiting": 1024}},
    "long-prefill-cap": {"engine": {"maxNumBatchedTokens": 2048, "longPrefillTokenThreshold": 256}},
    "pvc": {"model": {"source": "pvc", "claimName": "weights", "path": "llama/1b"}},
    "image": {"model": {"source": "image", "path": "/models/m.gguf", "servedModelName": "m"}},
    "autoscaling": {"autoscaling": {"enabled": True, "minReplicas": 3, "maxReplicas": 9}},
    "scheduling": {"nodeSelector": {"pool": "gpu"}, "tolerations": [
        {"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]},
    "env": {"env": [{"name": "A", "value": "1"}, {"name": "POD", "valueFrom": {
        "fieldRef": {"fieldPath": "metadata.name"}}}]},
    "zero-replicas": {"replicas": 0, "port": 9000, "shutdownTimeoutSeconds": 0},
    "sim": {"model": {"source": "sim", "profile": "llama3-8b-h100,time_scale=2,seed=3"},
            "resources": {"cpu": "250m", "memory": "512Mi"}},
    "routing-off": {"routing": {"enabled": False}},
    "routing": {"routing": {"policy": "prefix", "weights": {"prefix": 2, "queue": 0.25},
                            "queueSize": 50, "queueTimeoutSeconds": 900, "replicas": 3},
                "env": [{"name": "SLIPSTREAM_API_KEY", "valueFrom": {"secretKeyRef": {
                    "name": "chat-key", "key": "key"}}}]},
}
CASES = [pytest.param(isvc(**spec), id=key) for key, spec in SPECS.items()] + [
    pytest.param(yaml.safe_load(path.read_text()), id=path.name) for path in EXAMPLES]


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    return deployment["spec"]["template"]["spec"]["containers"][0]


def arg(deployment: dict[str, Any], flag: str) -> str | None:
    args = container(deployment)["args"]
    return args[args.index(flag) + 1] if flag in args else None


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("body", CASES)
def test_rendered_objects_pass_kubernetes_validate_strict(body, version):
    body = copy.deepcopy(body)
    body["metadata"]["uid"] = "0d9d8a4e-7b6a-4b7e-9a64-0e0b8f3c2a11"  # as from a cluster
    children = render_children(body)
    spec = parse_spec(body["spec"], name=body["metadata"]["name"])
    workload = "LeaderWorkerSet" if spec.pipeline_parallel_size > 1 else "Deployment"
    assert [c["kind"] for c in children] == [workload, "Service", "Service"] + (
        ["PodDisruptionBudget"] if needs_disruption_budget(spec) else []) + (
        ["ServiceAccount", "Role", "RoleBinding", "Deployment"] if spec.routing.enabled else [])
    for child in children:
        if child["kind"] == "LeaderWorkerSet":  # not Kubernetes' own: its pod templates are
            for template in child["spec"]["leaderWorkerTemplate"].values():
                if isinstance(template, dict):
                    kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate",
                                                  "metadata": {"name": "t"}, "template": template},
                                                 version, strict=True)
            continue
        kubernetes_validate.validate(child, version, strict=True)


COMMON_ARGS = ["serve", "--model", "builtin", "--host", "0.0.0.0", "--port", "8000",
               "--served-model-name", "chat", "--max-num-seqs", "32",
               "--max-num-batched-tokens", "512", "--block-size", "16", "--shutdown-timeout", "30"]


def test_server_args_carry_the_engine_settings():
    dep = render_deployment(isvc(engine={"maxNumSeqs": 7, "maxNumBatchedTokens": 300,
                                         "kvCacheMemory": "256Mi", "maxModelLen": 1024,
                                         "blockSize": 32}, port=8123))
    assert container(dep)["command"] == ["slipstream"]
    assert container(dep)["args"] == [
        "serve", "--model", "builtin", "--host", "0.0.0.0", "--port", "8123",
        "--served-model-name", "chat", "--max-num-seqs", "7", "--max-num-batched-tokens", "300",
        "--block-size", "32", "--shutdown-timeout", "30",
        "--kv-cache-memory-bytes", str(256 * 2 ** 20), "--max-model-len", "1024"]
    assert container(dep)["ports"] == [{"name": "http", "containerPort": 8123,
                                        "protocol": "TCP"}]


def test_unset_kv_cache_memory_passes_no_size_so_the_engine_profiles_the_gpu():
    assert container(render_deployment(isvc()))["args"] == COMMON_ARGS
    assert container(render_deployment(isvc(resources={"gpus": 1})))["args"] == COMMON_ARGS
    assert container(render_deployment(isvc(engine={"kvCacheMemory": "1Gi"})))["args"] == \
        COMMON_ARGS + ["--kv-cache-memory-bytes", str(2 ** 30)]


def test_gpu_memory_utilization_and_enforce_eager_are_passed_only_when_set():
    gpu = {"gpus": 1}
    assert container(render_deployment(isvc(resources=gpu, engine={
        "gpuMemoryUtilization": 0.85, "enforceEager": True})))["args"] == \
        COMMON_ARGS + ["--gpu-memory-utilization", "0.85", "--enforce-eager"]
    assert container(render_deployment(isvc(resources=gpu, engine={
        "gpuMemoryUtilization": 1, "enforceEager": False})))["args"] == \
        COMMON_ARGS + ["--gpu-memory-utilization", "1"]


def test_long_prefill_token_threshold_is_passed_only_when_set_and_checked():
    assert "--long-prefill-token-threshold" not in container(render_deployment(isvc()))["args"]
    assert container(render_deployment(isvc(engine={"longPrefillTokenThreshold": 256})))["args"] == \
        COMMON_ARGS + ["--long-prefill-token-threshold", "256"]
    with pytest.raises(SpecError, match="longPrefillTokenThreshold must be an integer ≥ 1"):
        parse_spec(isvc(engine={"longPrefillTokenThreshold": 0})["spec"], name="x")


def test_max_waiting_is_passed_only_when_set_and_checked():
    assert container(render_deployment(isvc(engine={"maxWaiting": 0})))["args"] == COMMON_ARGS + ["--max-waiting", "0"]
    with pytest.raises(SpecError, match="maxWaiting must be an integer ≥ 0"):
        parse_spec(isvc(engine={"maxWaiting": -1})["spec"], name="x")


def test_quantization_is_passed_only_when_set_and_checked():
    assert container(render_deployment(isvc()))["args"] == COMMON_ARGS
    assert container(render_deployment(isvc(engine={"quantization": "none"})))["args"] == \
        COMMON_ARGS + ["--quantization", "none"]
    with pytest.raises(SpecError, match="quantization must be 'auto' or 'none'"):
        parse_spec(isvc(engine={"quantization": "int4"})["spec"], name="x")


@pytest.mark.parametrize("value", [0, -0.5, 1.5, True, "0.9"])
def test_gpu_memory_utilization_outside_zero_to_one_is_refused(value):
    with pytest.raises(SpecError, match="gpuMemoryUtilization must be a number in"):
        parse_spec({"engine": {"gpuMemoryUtilization": value}})


def test_an_unset_kv_cache_must_still_fit_a_cpu_pod_but_not_a_gpu_pods_host_memory():
    """Unset on CPU, the engine takes 1 GiB of the pod's memory; on a GPU the pool is in GPU
    memory, so the pod's host memory limit says nothing about it."""
    with pytest.raises(SpecError, match=r"kvCacheMemory \(unset, so the engine's 1Gi\) must be "
                                        r"below spec.resources.memory \(1Gi\)"):
        parse_spec({"resources": {"memory": "1Gi"}})
    parse_spec({"resources": {"memory": "1536Mi"}})
    parse_spec({"resources": {"memory": "1Gi", "gpus": 1}})
    parse_spec({"resources": {"memory": "1Gi", "gpus": 1}, "engine": {"kvCacheMemory": "40Gi"}})
    with pytest.raises(SpecError, match=r"kvCacheMemory \(2Gi\) must be below"):
        parse_spec({"resources": {"memory": "2Gi"}, "engine": {"kvCacheMemory": "2Gi"}})


@pytest.mark.parametrize("memory,limit", [("16Gi", "2Gi"), ("8Gi", "2Gi"), ("3Gi", "768Mi"),
                                          ("1000M", "238Mi")])
def test_gpu_pods_get_a_memory_backed_dev_shm_and_cpu_pods_none(memory, limit):
    pod = render_deployment(isvc(resources={"memory": memory, "gpus": 1}))["spec"]["template"][
        "spec"]
    assert pod["volumes"] == [{"name": "shm", "emptyDir": {"medium": "Memory",
                                                           "sizeLimit": limit}}]
    assert pod["containers"][0]["volumeMounts"] == [{"name": "shm", "mountPath": "/dev/shm"}]
    cpu = render_deployment(isvc(resources={"memory": memory}, engine={
        "kvCacheMemory": "256Mi"}))["spec"]["template"]["spec"]
    assert "volumes" not in cpu and "volumeMounts" not in cpu["containers"][0]


def test_a_gpu_pod_with_a_pvc_mounts_both_the_weights_and_dev_shm():
    pod = render_deployment(isvc(model={"source": "pvc", "claimName": "w", "path": "m"},
                                 resources={"gpus": 1}))["spec"]["template"]["spec"]
    assert [v["name"] for v in pod["volumes"]] == ["model", "shm"]
    assert pod["containers"][0]["volumeMounts"] == [
        {"name": "model", "mountPath": "/mnt/models", "readOnly": True},
        {"name": "shm", "mountPath": "/dev/shm"}]


def test_the_gpu_example_profiles_the_gpu_with_one_gpu_and_dev_shm():
    [path] = [p for p in EXAMPLES if p.name == "inferenceservice-gpu-pvc.yaml"]
    dep = render_deployment(yaml.safe_load(path.read_text()))
    kubernetes_validate.validate(dep, VERSIONS[0], strict=True)
    pod = dep["spec"]["template"]["spec"]
    assert container(dep)["resources"]["limits"] == {"memory": "16Gi", "nvidia.com/gpu": 1}
    assert container(dep)["args"] == [
        "serve", "--model", "/mnt/models/llama-3.2-1b-instruct", "--host", "0.0.0.0",
        "--port", "8000", "--served-model-name", "llama-3.2-1b-instruct", "--max-num-seqs", "128",
        "--max-num-batched-tokens", "4096", "--block-size", "16", "--shutdown-timeout", "60",
        "--gpu-memory-utilization", "0.9", "--max-model-len", "8192", "--long-prefill-token-threshold", "1024"]
    assert pod["volumes"] == [
        {"name": "model", "persistentVolumeClaim": {"claimName": "model-weights",
                                                    "readOnly": True}},
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}}]
    assert {"name": "shm", "mountPath": "/dev/shm"} in container(dep)["volumeMounts"]


def test_unset_max_model_len_leaves_the_models_own():
    assert arg(render_deployment(isvc()), "--max-model-len") is None


def test_gpus_become_the_nvidia_limit_and_cpu_pods_have_none():
    gpu = container(render_deployment(isvc(resources={"gpus": 1})))["resources"]
    assert gpu["limits"]["nvidia.com/gpu"] == 1
    assert "nvidia.com/gpu" not in gpu["requests"]
    cpu = container(render_deployment(isvc()))["resources"]
    assert "nvidia.com/gpu" not in cpu["limits"]
    assert cpu == {"requests": {"cpu": "2", "memory": "4Gi"}, "limits": {"memory": "4Gi"}}


def test_pvc_model_is_mounted_read_only_and_passed_by_path():
    dep = render_deployment(isvc(model={"source": "pvc", "claimName": "w", "path": "m/dir"}))
    pod = dep["spec"]["template"]["spec"]
    assert pod["volumes"] == [{"name": "model", "persistentVolumeClaim": {
        "claimName": "w", "readOnly": True}}]
    assert container(dep)["volumeMounts"] == [{"name": "model", "mountPath": "/mnt/models",
                                               "readOnly": True}]
    assert arg(dep, "--model") == "/mnt/models/m/dir"
    assert arg(render_deployment(isvc(model={"source": "image", "path": "/w.gguf"})),
               "--model") == "/w.gguf"


def test_probes_give_the_model_time_to_load_and_the_server_time_to_drain():
    dep = render_deployment(isvc(startupTimeoutSeconds=900, shutdownTimeoutSeconds=45))
    c = container(dep)
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    startup = c["startupProbe"]
    assert startup["httpGet"]["path"] == "/ready"  # /health answers before the model loads
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 900
    assert c["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", str(PRESTOP_SLEEP_SECONDS)]
    grace = dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > PRESTOP_SLEEP_SECONDS + 45
    assert dep["spec"]["progressDeadlineSeconds"] > 900
    assert dep["spec"]["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {
        "maxUnavailable": 0, "maxSurge": 1}}


def test_pods_are_scraped_by_prometheus_on_the_server_port():
    annotations = render_deployment(isvc(port=9000))["spec"]["template"]["metadata"][
        "annotations"]
    assert annotations == {"prometheus.io/scrape": "true", "prometheus.io/port": "9000",
                           "prometheus.io/path": "/metrics"}


def test_service_selects_the_deployments_pods_on_port_80_without_routing():
    dep, svc = render_deployment(isvc()), render_service(isvc(routing={"enabled": False}))
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert svc["spec"]["type"] == "ClusterIP"
    assert svc["spec"]["ports"] == [{"name": "http", "port": 80, "targetPort": "http",
                                     "protocol": "TCP"}]
    assert pod_labels["app.kubernetes.io/instance"] == "chat"
    assert pod_labels["app.kubernetes.io/managed-by"] == "slipstream-operator"
    assert pod_selector("chat") == ("app.kubernetes.io/component=model-server,"
                                    "slipstream.dev/inferenceservice=chat")


def test_replicas_start_at_min_replicas_when_autoscaling():
    assert render_deployment(isvc(replicas=5))["spec"]["replicas"] == 5
    assert render_deployment(isvc(replicas=5, autoscaling={
        "enabled": True, "minReplicas": 2}))["spec"]["replicas"] == 2


def test_spec_hash_ignores_replicas_and_sees_removed_fields():
    base = render_deployment(isvc(env=[{"name": "A", "value": "1"}]))
    assert spec_hash(render_deployment(isvc(env=[{"name": "A", "value": "1"}], replicas=4))) \
        == base["metadata"]["annotations"][SPEC_HASH_ANNOTATION]
    assert spec_hash(render_deployment(isvc())) != \
        base["metadata"]["annotations"][SPEC_HASH_ANNOTATION]


def test_children_are_adopted_only_when_the_owner_has_a_uid():
    body = isvc()
    assert all("ownerReferences" not in c["metadata"] for c in render_children(body))
    body["metadata"].update(uid="u-1", labels={"team": "a"})
    for child in render_children(body):
        assert child["metadata"]["ownerReferences"] == [{
            "apiVersion": "slipstream.dev/v1alpha1", "kind": "InferenceService", "name": "chat",
            "uid": "u-1", "controller": True, "blockOwnerDeletion": True}]
        assert child["metadata"]["labels"]["team"] == "a"
        assert child["metadata"]["namespace"] == "ml"


def test_rendering_is_a_pure_function_of_the_spec():
    spec = parse_spec({"replicas": 2})
    assert render_deployment(isvc(replicas=2)) == render_deployment(isvc(), spec)


@pytest.mark.parametrize("body", CASES)
def test_server_accepts_the_rendered_arguments(body):
    """The contract with `slipstream serve`: its own parser takes what the pods run."""
    from slipstream.server.cli import serve_parser  # imports the engine's defaults: slow
    spec = parse_spec(body["spec"], name=body["metadata"]["name"])
    # A group's pods take their rank and the leader's address from LWS's environment, which the
    # kubelet substitutes into $(VAR) references.
    env = {"LWS_WORKER_INDEX": "1", "LWS_LEADER_ADDRESS": "leader-0.leader-0.default"}
    argv = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in container(render_deployment(body))["args"][1:]]
    args = serve_parser().parse_args(argv)
    assert (args.tensor_parallel_size, args.pipeline_parallel_size) == (spec.tensor_parallel_size,
                                                                        spec.parallelism.pipeline)
    assert (args.max_num_seqs, args.max_num_batched_tokens, args.kv_cache_memory_bytes,
            args.block_size, args.port, args.host) == (
        spec.engine.max_num_seqs, spec.engine.max_num_batched_tokens,
        quantity_bytes(spec.engine.kv_cache_memory), spec.engine.block_size, spec.port, "0.0.0.0")
    assert args.max_model_len == spec.engine.max_model_len
    assert args.shutdown_timeout == spec.shutdown_timeout_seconds
    if spec.engine.gpu_memory_utilization is not None:
        assert args.gpu_memory_utilization == spec.engine.gpu_memory_utilization
    assert args.enforce_eager is spec.engine.enforce_eager
    assert args.quantization == (spec.engine.quantization or "auto")
    assert args.max_waiting == (128 if spec.engine.max_waiting is None else spec.engine.max_waiting)
    assert args.long_prefill_token_threshold == (spec.engine.long_prefill_token_threshold or 0)


def test_sim_source_runs_the_server_with_a_simulated_model():
    dep = render_deployment(isvc(model={"source": "sim", "profile": "tiny,output_len=20-200"}))
    assert arg(dep, "--model") == "sim:tiny,output_len=20-200"
    assert "volumes" not in dep["spec"]["template"]["spec"]
    # The KV cache of a simulated GPU is counted, not allocated: pod memory may be below it.
    parse_spec({"model": {"source": "sim", "profile": "tiny"}, "resources": {"memory": "512Mi"}})


def test_every_server_profile_and_option_fits_the_crds_profile_field():
    """The operator checks only the shape of a profile (it imports nothing of the server);
    the shape must admit every profile the server knows and what its parser accepts."""
    from slipstream.api_types.model_uri import SIM_PROFILE
    from slipstream.server.sim.options import parse_sim_model
    from slipstream.server.sim.cost_model import PROFILES
    crd_pattern = yaml.safe_load(CRD_PATH.read_text())["spec"]["versions"][0]["schema"][
        "openAPIV3Schema"]["properties"]["spec"]["properties"]["model"]["properties"][
        "profile"]["pattern"]
    assert crd_pattern == SIM_PROFILE.pattern
    for profile in [*PROFILES, "tiny,time_scale=0.25,output_len=20-200,seed=7",
                    "llama3-8b-l4,time_scale=1e-1"]:
        assert SIM_PROFILE.match(profile), profile
        parse_sim_model(f"sim:{profile}")
    for bad in ("Tiny", "tiny,", "tiny,speed=2", "tiny,seed=x", "sim:tiny", "tiny time_scale=2"):
        assert not SIM_PROFILE.match(bad), bad


@pytest.mark.parametrize("body", CASES)
def test_model_pods_pass_pod_security_restricted(body):
    """GPU, PVC and sim pods too: a namespace enforcing `restricted` admits them."""
    pod = render_deployment(body)["spec"]["template"]["spec"]
    assert restricted_violations(pod) == []
    assert pod["securityContext"] == {
        "runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001, "fsGroup": 10001,
        "seccompProfile": {"type": "RuntimeDefault"}}
    assert container({"spec": {"template": {"spec": pod}}})["securityContext"] == {
        "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def test_the_restricted_check_refuses_what_the_admission_plugin_refuses():
    pod = render_deployment(isvc())["spec"]["template"]["spec"]
    del pod["securityContext"]["seccompProfile"]
    pod["containers"][0]["securityContext"] = {"capabilities": {"add": ["SYS_ADMIN"]}}
    pod["volumes"] = [{"name": "host", "hostPath": {"path": "/"}}]
    pod["securityContext"]["runAsUser"] = 0
    assert restricted_violations(pod) == [
        "volume host has type ['hostPath']", "runAsUser must not be 0",
        "container server: allowPrivilegeEscalation must be false",
        "container server: capabilities must drop ALL",
        "container server: adds capabilities ['SYS_ADMIN']",
        "container server: seccompProfile must be RuntimeDefault or Localhost"]


@pytest.mark.parametrize("spec,wanted", [
    ({}, False), ({"replicas": 2}, True), ({"replicas": 0}, False),
    ({"replicas": 5, "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 1}}, False),
    ({"autoscaling": {"enabled": True}}, True),
], ids=["one-pod", "two-pods", "zero", "autoscaled-to-one", "autoscaled"])
def test_a_disruption_budget_exists_while_more_than_one_pod_can_run(spec, wanted):
    assert needs_disruption_budget(parse_spec(spec)) is wanted
    assert (render_disruption_budget(isvc(**spec)) is not None) is wanted


def test_disruption_budget_lets_one_pod_go_at_a_time_and_is_owned():
    body = isvc(replicas=3)
    body["metadata"]["uid"] = "u-1"
    dep, _, _, pdb, *_ = render_children(body)
    assert pdb["apiVersion"] == "policy/v1"
    assert pdb["spec"] == {"maxUnavailable": 1, "selector": dep["spec"]["selector"]}
    assert pdb["metadata"]["labels"] == dep["metadata"]["labels"]
    assert pdb["metadata"]["ownerReferences"][0]["uid"] == "u-1"


# ---- the gateway (issue 12) -------------------------------------------------------------------

def children_by_kind_and_name(body: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(c["kind"], c["metadata"]["name"]): c for c in render_children(body)}


def test_with_routing_the_service_selects_the_gateway_pods_and_the_headless_one_the_model_pods():
    children = children_by_kind_and_name(isvc(port=9000))
    model, gateway = children["Deployment", "chat"], children["Deployment", "chat-gateway"]
    svc, pods = children["Service", "chat"], children["Service", "chat-pods"]
    model_labels = model["spec"]["template"]["metadata"]["labels"]
    gateway_labels = gateway["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"] == gateway["spec"]["selector"]["matchLabels"]
    assert svc["spec"]["selector"].items() <= gateway_labels.items()
    assert not svc["spec"]["selector"].items() <= model_labels.items()
    assert svc["spec"]["ports"] == [{"name": "http", "port": 80, "targetPort": "http",
                                     "protocol": "TCP"}]
    assert pods["spec"] == {"clusterIP": "None",
                            "selector": model["spec"]["selector"]["matchLabels"],
                            "ports": [{"name": "http", "port": 9000, "targetPort": "http",
                                       "protocol": "TCP"}]}
    assert not pods["spec"]["selector"].items() <= gateway_labels.items()
    # The autoscaler's and the PodDisruptionBudget's selector stay on the model pods.
    assert pod_selector("chat") == "app.kubernetes.io/component=model-server," \
                                   "slipstream.dev/inferenceservice=chat"


def test_routing_off_renders_no_gateway_and_keeps_the_headless_service():
    children = children_by_kind_and_name(isvc(routing={"enabled": False}))
    assert sorted(children) == [("Deployment", "chat"), ("Service", "chat"),
                                ("Service", "chat-pods")]
    assert render_gateway(isvc(), parse_spec({"routing": {"enabled": False}})) == []


def test_gateway_runs_slipstream_gateway_with_exactly_the_routing_spec():
    body = isvc(namespace="team", image="registry.example.com/slipstream:1.2", routing={
        "policy": "least-loaded", "weights": {"prefix": 2, "queue": 0.25, "kvCache": 0,
                                              "affinity": 1.5},
        "queueSize": 50, "queueTimeoutSeconds": 900, "replicas": 3})
    dep = render_gateway_deployment(body)
    c = container(dep)
    assert c["image"] == "registry.example.com/slipstream:1.2"  # the model pods' image
    assert c["command"] == ["slipstream"]
    assert c["args"] == [
        "gateway", "--host", "0.0.0.0", "--port", "8000", "--service", "chat-pods",
        "--namespace", "team", "--target-port-name", "http", "--routing", "least-loaded",
        "--weight-prefix", "2.0", "--weight-queue", "0.25", "--weight-kv-cache", "0.0",
        "--weight-affinity", "1.5", "--max-queue", "50", "--queue-timeout", "900"]
    assert dep["spec"]["replicas"] == 3
    assert dep["metadata"]["name"] == "chat-gateway"
    assert c["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    assert "env" not in c


def test_gateway_defaults_are_kv_events_two_replicas_and_the_issues_weights():
    args = gateway_args(parse_spec({}), "chat", "ml")
    flags = dict(zip(args[1::2], args[2::2]))
    assert flags == {"--host": "0.0.0.0", "--port": "8000", "--service": "chat-pods",
                     "--namespace": "ml", "--target-port-name": "http", "--routing": "kv-events",
                     "--weight-prefix": "3.0", "--weight-queue": "1.0",
                     "--weight-kv-cache": "0.5", "--weight-affinity": "0.5",
                     "--max-queue": "1000", "--queue-timeout": "300"}
    assert render_gateway_deployment(isvc())["spec"]["replicas"] == 2


def test_gateway_gets_the_model_pods_api_key_the_same_way():
    key = {"name": "SLIPSTREAM_API_KEY", "valueFrom": {"secretKeyRef": {"name": "k",
                                                                         "key": "key"}}}
    body = isvc(env=[{"name": "A", "value": "1"}, key])
    assert container(render_gateway_deployment(body))["env"] == [key]
    assert key in container(render_deployment(body))["env"]


def test_gateway_pods_probe_ready_and_health_spread_over_nodes_and_ask_little():
    dep = render_gateway_deployment(isvc())
    pod, c = dep["spec"]["template"]["spec"], container(dep)
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["resources"]["requests"] == {"cpu": "100m", "memory": "256Mi"}
    [spread] = pod["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname" and spread["maxSkew"] == 1
    assert spread["labelSelector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    assert pod["serviceAccountName"] == "chat-gateway"
    assert restricted_violations(pod) == []
    # A GPU service's gateway needs no GPU and no GPU node.
    gpu = render_gateway_deployment(isvc(resources={"gpus": 1}, nodeSelector={"pool": "gpu"}))
    assert "nodeSelector" not in gpu["spec"]["template"]["spec"]
    assert "nvidia.com/gpu" not in str(container(gpu)["resources"])


def test_gateway_account_may_only_list_and_watch_endpointslices_in_its_namespace():
    body = isvc(namespace="team")
    body["metadata"]["uid"] = "u-1"
    children = children_by_kind_and_name(body)
    role = children["Role", "chat-gateway"]
    binding = children["RoleBinding", "chat-gateway"]
    assert role["rules"] == list(GATEWAY_RULES) == [{
        "apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
        "verbs": ["list", "watch"]}]
    assert role["metadata"]["namespace"] == "team"
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": "chat-gateway"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "chat-gateway",
                                    "namespace": "team"}]
    assert children["ServiceAccount", "chat-gateway"]["metadata"]["namespace"] == "team"
    for child in children.values():
        assert child["metadata"]["ownerReferences"][0]["uid"] == "u-1"
        assert child["metadata"]["labels"]["slipstream.dev/inferenceservice"] == "chat"


def test_a_routing_change_changes_the_gateways_hash_not_the_model_pods():
    a, b = isvc(), isvc(routing={"policy": "prefix"})
    assert render_deployment(a) == render_deployment(b)
    hashes = [render_gateway_deployment(x)["metadata"]["annotations"][SPEC_HASH_ANNOTATION]
              for x in (a, b, isvc(routing={"replicas": 5}))]
    assert hashes[0] != hashes[1] and hashes[0] == hashes[2]


def test_headless_service_follows_the_server_port():
    assert render_pods_service(isvc(port=8123))["spec"]["ports"][0]["port"] == 8123


@pytest.mark.parametrize("body", CASES)
def test_gateway_accepts_the_rendered_arguments(body):
    """The contract with `slipstream gateway`: its own parser takes what the gateway pods run."""
    from slipstream.server.gateway.cli import gateway_parser
    spec = parse_spec(body["spec"], name=body["metadata"]["name"])
    if not spec.routing.enabled:
        return
    args = gateway_parser().parse_args(container(render_gateway_deployment(body))["args"][1:])
    assert (args.host, args.port, args.routing, args.max_queue, args.queue_timeout) == (
        "0.0.0.0", 8000, spec.routing.policy, spec.routing.queue_size,
        spec.routing.queue_timeout_seconds)


@pytest.mark.parametrize("weight", [float("inf"), float("nan"), -1])
def test_a_routing_weight_that_is_not_a_finite_number_at_least_0_is_refused(weight):
    """An infinite weight turned every gateway score into NaN and each request into a 500."""
    with pytest.raises(SpecError, match=r"spec\.routing\.weights\.queue must be a (finite )?number ≥ 0"):
        parse_spec({"routing": {"weights": {"queue": weight}}}, name="x")


def test_fairness_reaches_the_pods_and_the_gateway_with_the_same_weights():
    spec = parse_spec({"fairness": {"policy": "priority", "tenants": [{"name": "team-a", "weight": 3},
                                                                      {"name": "team-b", "weight": 0.5},
                                                                      {"name": "big", "weight": 999.25}]}})
    args = server_args(spec, "chat")
    assert args[args.index("--scheduling-policy") + 1] == "priority"
    assert args[args.index("--tenant-weights") + 1] == "team-a=3,team-b=0.5,big=999.25"
    gateway = gateway_args(spec, "chat", "ml")
    assert gateway[gateway.index("--tenant-weights") + 1] == "team-a=3,team-b=0.5,big=999.25"
    assert gateway[gateway.index("--scheduling-policy") + 1] == "priority"
    # The parsers on the other side read them back as given.
    from slipstream.api_types.tenancy import parse_tenant_weights
    assert parse_tenant_weights("team-a=3,team-b=0.5,big=999.25") == {"team-a": 3.0, "team-b": 0.5, "big": 999.25}
    # Defaults: the engine's own default policy, no weights, nothing to pass.
    plain = server_args(parse_spec({}), "chat")
    assert "--scheduling-policy" not in plain and "--tenant-weights" not in plain
    assert "--tenant-token-limits" not in gateway_args(spec, "chat", "ml")


def test_token_limits_reach_the_gateway_split_between_its_replicas():
    spec = parse_spec({"routing": {"replicas": 3}, "fairness": {"tenants": [
        {"name": "batch", "tokensPerMinute": 20000}, {"name": "team-a", "weight": 3}, {"name": "tiny", "tokensPerMinute": 1}]}})
    gateway = gateway_args(spec, "chat", "ml")
    assert gateway[gateway.index("--tenant-token-limits") + 1] == "batch=6667,tiny=1"  # rounded up
    assert "--tenant-token-limits" not in server_args(spec, "chat")  # the pods do not enforce them
    from slipstream.server.gateway.cli import gateway_parser
    args = gateway_parser().parse_args(gateway[1:])
    assert args.tenant_token_limits == {"batch": 6667, "tiny": 1}
    for bad, says in (({"fairness": {"tenants": [{"name": "a", "tokensPerMinute": 0}]}}, "tokensPerMinute"),
                      ({"fairness": {"tenants": [{"name": "a", "tokensPerMinute": 1.5}]}}, "tokensPerMinute"),
                      ({"routing": {"enabled": False}, "fairness": {"tenants": [{"name": "a", "tokensPerMinute": 9}]}},
                       "needs spec.routing.enabled"),
                      ({"fairness": {"tenants": [{"name": str(i)} for i in range(1001)]}}, "tenants")):
        with pytest.raises(ValueError, match=says):
            parse_spec(bad)
    for bad, says in (({"tenants": [{"name": "a"}, {"name": "a"}]}, "repeated: a"),
                      ({"tenants": [{"name": "a,b"}]}, "without ','"),
                      ({"tenants": [{"name": "a", "weight": 0}]}, "weight"),
                      ({"tenants": [{"name": " "}]}, "space"), ({"tenants": [{"name": " a"}]}, "space"),
                      ({"tenants": [{"name": "a", "weight": 1e9}]}, "weight"),
                      ({"policy": "lottery"}, "policy")):
        with pytest.raises(ValueError, match=says):
            parse_spec({"fairness": bad})
