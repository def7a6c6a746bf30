"""spec.model.uri in the operator: what each source renders (the download init container, the
model cache volume, the server's arguments) and what the status says while a pod downloads,
after it has, and when it could not."""
from __future__ import annotations

import datetime
import json
import re
from typing import Any

import pytest

from slipstream.operator import status as st
from slipstream.operator.model_spec import parse_uri
from slipstream.operator.render import render_children
from slipstream.operator.resources import (DOWNLOAD_CONTAINER, MODEL_CACHE_MOUNT, MODEL_REVISION_FILE,
                                           MODEL_REVISION_MOUNT, render_deployment)
from slipstream.operator.spec import SpecError, parse_spec

T0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)


def isvc(**model: Any) -> dict[str, Any]:
    return {"metadata": {"name": "chat", "namespace": "ml", "generation": 2},
            "spec": {"model": model, "resources": {"memory": "8Gi"},
                     "env": [{"name": "HF_ENDPOINT", "value": "http://127.0.0.1:9000"}]}}


def pod_spec(**model: Any) -> dict[str, Any]:
    return render_deployment(isvc(**model))["spec"]["template"]["spec"]


def arg(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_an_hf_uri_downloads_in_an_init_container_into_the_shared_cache_the_server_reads_offline():
    pod = pod_spec(uri="hf://Qwen/Qwen3-0.6B@main", secretRef={"name": "hf-token"},
                   cache={"claimName": "model-cache", "maxSize": "100Gi"})
    [init] = pod["initContainers"]
    assert init["name"] == DOWNLOAD_CONTAINER
    assert init["args"][:2] == ["download", "hf://Qwen/Qwen3-0.6B@main"]
    assert arg(init["args"], "--cache-dir") == MODEL_CACHE_MOUNT
    assert arg(init["args"], "--max-cache-bytes") == str(100 << 30)
    assert arg(init["args"], "--termination-message-path") == init["terminationMessagePath"]
    assert init["envFrom"] == [{"secretRef": {"name": "hf-token"}}]
    env = {e["name"]: e["value"] for e in init["env"]}
    assert env == {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9000"}
    assert init["volumeMounts"] == [{"name": "model-cache", "mountPath": MODEL_CACHE_MOUNT},
                                    {"name": "model-revision", "mountPath": MODEL_REVISION_MOUNT}]
    assert pod["volumes"] == [{"name": "model-cache", "persistentVolumeClaim": {"claimName": "model-cache"}},
                              {"name": "model-revision", "emptyDir": {"sizeLimit": "1Mi"}}]
    [server] = pod["containers"]
    assert arg(server["args"], "--model") == "hf://Qwen/Qwen3-0.6B@main"
    assert arg(server["args"], "--model-cache-dir") == MODEL_CACHE_MOUNT
    assert {"name": "model-cache", "mountPath": MODEL_CACHE_MOUNT, "readOnly": True} in server["volumeMounts"]
    assert server["env"][0] == {"name": "HF_HUB_OFFLINE", "value": "1"}
    assert "envFrom" not in server  # the token reaches the download step only


def test_a_bare_hub_id_is_an_hf_uri():
    assert parse_uri("Qwen/Qwen3-8B").uri == "hf://Qwen/Qwen3-8B"
    pod = pod_spec(uri="Qwen/Qwen3-8B")
    assert pod["initContainers"][0]["args"][1] == "hf://Qwen/Qwen3-8B"


def test_without_a_cache_claim_each_pod_downloads_into_an_empty_dir_or_a_node_directory():
    revision = {"name": "model-revision", "emptyDir": {"sizeLimit": "1Mi"}}
    assert pod_spec(uri="hf://org/name")["volumes"] == [{"name": "model-cache", "emptyDir": {}}, revision]
    assert pod_spec(uri="hf://org/name", cache={"hostPath": "/var/cache/models"})["volumes"] == [
        {"name": "model-cache", "hostPath": {"path": "/var/cache/models", "type": "DirectoryOrCreate"}}, revision]


@pytest.mark.parametrize("uri", ["hf://org/name", "hf://org/name:Q4_K_M", "s3://models/llama/8b"])
def test_the_server_serves_the_revision_its_pods_download_step_fetched_through_a_pod_local_file(uri):
    """A shared cache's refs/main may move (another service's pod fetches a newer main) while this
    pod runs: the download step writes what it resolved into a pod-local emptyDir, and the server,
    restarted in place (the init container does not run again), pins its model to that file."""
    pod = pod_spec(uri=uri, cache={"claimName": "model-cache"})
    [init], [server] = pod["initContainers"], pod["containers"]
    assert arg(init["args"], "--revision-file") == MODEL_REVISION_FILE
    assert arg(server["args"], "--model-revision-file") == MODEL_REVISION_FILE
    assert MODEL_REVISION_FILE.startswith(MODEL_REVISION_MOUNT + "/")
    [volume] = [v for v in pod["volumes"] if v["name"] == "model-revision"]
    assert volume == {"name": "model-revision", "emptyDir": {"sizeLimit": "1Mi"}}  # the pod's own, never shared
    assert {"name": "model-revision", "mountPath": MODEL_REVISION_MOUNT} in init["volumeMounts"]
    assert {"name": "model-revision", "mountPath": MODEL_REVISION_MOUNT, "readOnly": True} in server["volumeMounts"]


@pytest.mark.parametrize("model", [{"uri": "pvc://claim/llama"}, {"source": "builtin"}])
def test_a_model_without_a_download_step_gets_no_revision_file(model):
    pod = pod_spec(**model)
    assert "--model-revision-file" not in pod["containers"][0]["args"]
    assert all(v["name"] != "model-revision" for v in pod.get("volumes", []))


def test_an_s3_uri_passes_the_endpoint_region_and_credentials_to_the_download_step():
    pod = pod_spec(uri="s3://models/llama/8b", secretRef={"name": "aws"},
                   s3={"endpoint": "http://127.0.0.1:8333", "region": "eu-west-1"})
    [init] = pod["initContainers"]
    assert init["args"][:2] == ["download", "s3://models/llama/8b"]
    assert arg(init["args"], "--s3-endpoint") == "http://127.0.0.1:8333"
    assert {"name": "AWS_REGION", "value": "eu-west-1"} in init["env"]
    assert init["envFrom"] == [{"secretRef": {"name": "aws"}}]
    assert arg(pod["containers"][0]["args"], "--model") == "s3://models/llama/8b"


def test_a_pvc_uri_renders_exactly_as_source_pvc():
    by_uri = render_children(isvc(uri="pvc://weights/llama/8b"))
    by_source = render_children(isvc(source="pvc", claimName="weights", path="llama/8b"))
    assert by_uri[0]["spec"] == by_source[0]["spec"]
    assert arg(by_uri[0]["spec"]["template"]["spec"]["containers"][0]["args"], "--model") == \
        "/mnt/models/llama/8b"
    assert "initContainers" not in by_uri[0]["spec"]["template"]["spec"]


@pytest.mark.parametrize("model", [{"uri": "builtin"}, {"uri": "sim:tiny"}, {}, {"source": "builtin"}])
def test_sources_without_a_download_have_no_init_container(model):
    pod = pod_spec(**model)
    assert "initContainers" not in pod and "volumes" not in pod
    assert "--model-cache-dir" not in pod["containers"][0]["args"]


def test_uri_and_the_older_source_fields_are_exclusive_with_a_message_saying_so():
    with pytest.raises(SpecError, match="names the model on its own"):
        parse_spec({"model": {"uri": "hf://org/name", "source": "image", "path": "/m"}})
    with pytest.raises(SpecError, match="ftp:// is not supported"):
        parse_spec({"model": {"uri": "ftp://example/model"}})
    with pytest.raises(SpecError, match="an OCI URI is"):
        parse_spec({"model": {"uri": "oci://ghcr.io/Org/Model:1"}})
    with pytest.raises(SpecError, match="configures the download step"):
        parse_spec({"model": {"uri": "pvc://weights/x", "secretRef": {"name": "t"}}})
    # an object stored before uri existed has source: builtin, defaulted by the API server
    assert parse_spec({"model": {"uri": "hf://org/name", "source": "builtin"}}).model.uri == "hf://org/name"


def init_status(**state: Any) -> dict[str, Any]:
    return {"name": DOWNLOAD_CONTAINER, "state": state, "restartCount": 0}


def pod(name: str, init: dict[str, Any], ready: bool = False) -> dict[str, Any]:
    return {"metadata": {"name": name},
            "status": {"initContainerStatuses": [init],
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


DEPLOYMENT = {"metadata": {"generation": 1}, "spec": {"replicas": 2},
              "status": {"observedGeneration": 1, "replicas": 2, "readyReplicas": 0}}


def test_ready_says_downloading_and_for_how_long_while_a_pod_fetches_its_model():
    pods = [pod("chat-a", init_status(running={"startedAt": "2026-01-01T00:00:00Z"})),
            pod("chat-b", init_status(waiting={"reason": "PodInitializing"}))]
    status, reason, message = st.ready_condition(DEPLOYMENT, pods, T0 + datetime.timedelta(seconds=42))
    assert (status, reason) == ("False", "Downloading")
    assert "pod chat-a is downloading the model for 42 s" in message


def test_a_failed_download_is_the_ready_reason_with_the_model_and_status_code_from_its_message():
    error = {"model": "hf://org/gated", "error": "hf://org/gated: 401 Unauthorized: gated repository; "
                                                 "set HF_TOKEN or spec.model.secretRef", "reason": "GatedRepo",
             "status": 401}
    failing = {"name": DOWNLOAD_CONTAINER, "restartCount": 2,
               "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s"}},
               "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "message": json.dumps(error)}}}
    status, reason, message = st.ready_condition(DEPLOYMENT, [pod("chat-a", failing)], T0)
    assert (status, reason) == ("False", "DownloadFailed")
    assert "hf://org/gated: 401 Unauthorized" in message and "back-off" in message
    assert "CrashLoopBackOff" not in reason


def test_status_model_reports_the_revision_bytes_and_seconds_of_the_newest_download():
    spec = parse_spec({"model": {"uri": "hf://org/name"}})

    def done(at: str, revision: str, seconds: float) -> dict[str, Any]:
        report = {"model": "hf://org/name", "revision": revision, "bytes": 1234, "seconds": seconds,
                  "path": "/x"}
        return init_status(terminated={"exitCode": 0, "finishedAt": at, "message": json.dumps(report)})

    pods = [pod("a", done("2026-01-01T00:00:05Z", "abc", 12.5), True),
            pod("b", done("2026-01-01T00:01:00Z", "def", 0.2), True)]
    assert st.model_report(spec, pods, None) == {"uri": "hf://org/name", "revision": "def",
                                                 "bytes": 1234, "downloadSeconds": 0.2}
    previous = {"uri": "hf://org/name", "revision": "abc", "bytes": 1, "downloadSeconds": 3}
    assert st.model_report(spec, [], previous) == previous
    other = parse_spec({"model": {"uri": "hf://org/other"}})
    assert st.model_report(other, pods, previous) is None  # a new uri: no stale revision
    assert st.model_report(parse_spec({}), pods, previous) is None
    full = st.compute_status(isvc(uri="hf://org/name"), spec, DEPLOYMENT, url="u", now=T0, pods=pods)
    assert full["model"]["revision"] == "def"


def test_a_model_image_is_an_image_volume_on_kubernetes_1_35_and_later():
    body = isvc(uri="oci://registry.example:5000/models/smollm2:q4")
    for version in ((1, 35), (1, 36), None):
        pod = render_deployment(body, kube_version=version)["spec"]["template"]["spec"]
        assert pod["volumes"] == [{"name": "model", "image": {
            "reference": "registry.example:5000/models/smollm2:q4", "pullPolicy": "IfNotPresent"}}]
        assert "initContainers" not in pod and "shareProcessNamespace" not in pod
        assert arg(pod["containers"][0]["args"], "--model") == "/mnt/model-image/models"


def expand_command(text: str) -> str:
    """Kubernetes' expansion of a command without variables defined: "$$" is an escaped "$",
    "$(NAME)" stays as written (the kubelet's, e2e/cluster/kubelet/env.py, is the real one)."""
    return re.sub(r"\$\$", "$", text)


def test_before_1_35_a_model_image_runs_as_a_modelcar_sidecar_linking_its_files_for_the_server():
    pod = render_deployment(isvc(uri="oci://registry.example/models/smollm2:q4"),
                            kube_version=(1, 33))["spec"]["template"]["spec"]
    [car] = pod["initContainers"]
    assert car["image"] == "registry.example/models/smollm2:q4"
    assert car["restartPolicy"] == "Always"  # a native sidecar: it starts (and pulls) first
    # what the shell gets after the kubelet's $(VAR) expansion ("$$" -> "$"): its own pid, "$$"
    assert expand_command(car["command"][-1]).startswith("ln -sfn /proc/$$/root/models ")
    assert pod["shareProcessNamespace"] is True
    assert pod["volumes"] == [{"name": "model", "emptyDir": {"sizeLimit": "1Mi"}}]
    server = pod["containers"][0]
    assert arg(server["args"], "--model") == "/mnt/modelcar/models"
    assert {"name": "model", "mountPath": "/mnt/modelcar", "readOnly": True} in server["volumeMounts"]


@pytest.mark.parametrize("mount,version,image_volume", [
    ("image-volume", (1, 33), True), ("modelcar", (1, 36), False), ("auto", (1, 34), False)])
def test_spec_model_oci_mount_forces_either(mount, version, image_volume):
    body = isvc(uri="oci://registry.example/models/m:1", oci={"mount": mount})
    pod = render_deployment(body, kube_version=version)["spec"]["template"]["spec"]
    assert ("image" in pod["volumes"][0]) is image_volume


def test_the_operator_reads_the_clusters_version_once(monkeypatch):
    import asyncio

    from slipstream.operator.kube import Kube

    calls = []

    async def request(self, method, path, body=None, content_type=None):
        calls.append(path)
        return {"major": "1", "minor": "34+", "gitVersion": "v1.34.2"}

    monkeypatch.setattr(Kube, "request", request)
    kube = Kube("http://127.0.0.1:1")
    assert asyncio.run(kube.server_version()) == (1, 34)
    assert asyncio.run(kube.server_version()) == (1, 34)
    assert calls == ["/version"]


def test_oci_on_a_cluster_older_than_native_sidecars_is_refused_naming_the_version():
    with pytest.raises(SpecError, match="1.29 or later.*1.28") as info:
        render_deployment(isvc(uri="oci://registry.example/models/m:1"), kube_version=(1, 28))
    assert info.value.reason == "UnsupportedCluster"


def test_the_users_hf_hub_offline_replaces_the_operators_not_duplicates_it():
    body = isvc(uri="hf://org/name")
    body["spec"]["env"].append({"name": "HF_HUB_OFFLINE", "value": "0"})
    env = render_deployment(body)["spec"]["template"]["spec"]["containers"][0]["env"]
    assert [e["value"] for e in env if e["name"] == "HF_HUB_OFFLINE"] == ["0"]


SOURCES = {"builtin": {"source": "builtin"}, "default": {}, "builtin-uri": {"uri": "builtin"},
           "image": {"source": "image", "path": "/models/m.gguf"},
           "pvc": {"uri": "pvc://weights/llama/8b"}, "oci": {"uri": "oci://registry.example/models/m:1"},
           "sim": {"uri": "sim:tiny"}, "hf": {"uri": "hf://org/name"}, "s3": {"uri": "s3://models/llama"}}


@pytest.mark.parametrize("kube_version", [None, (1, 33)], ids=["image-volume", "modelcar"])
@pytest.mark.parametrize("model", SOURCES.values(), ids=SOURCES.keys())
def test_every_server_container_is_hub_offline_and_only_the_download_step_online(model, kube_version):
    """The images do not set HF_HUB_OFFLINE (docker run … --model hf://… downloads): in a pod the
    operator does, whatever the source, so a server never reaches out; the user's env follows."""
    pod = render_deployment(isvc(**model), kube_version=kube_version)["spec"]["template"]["spec"]
    [server] = pod["containers"]
    assert server["env"] == [{"name": "HF_HUB_OFFLINE", "value": "1"},
                             {"name": "HF_ENDPOINT", "value": "http://127.0.0.1:9000"}]
    for init in pod.get("initContainers", []):
        offline = [e["value"] for e in init.get("env", []) if e["name"] == "HF_HUB_OFFLINE"]
        assert offline == (["0"] if init["name"] == DOWNLOAD_CONTAINER else [])
    assert any(c["name"] == DOWNLOAD_CONTAINER for c in pod.get("initContainers", [])) is (
        "uri" in model and model["uri"].startswith(("hf://", "s3://")))


@pytest.mark.parametrize("model", SOURCES.values(), ids=SOURCES.keys())
def test_a_spec_without_env_still_gets_hf_hub_offline_and_the_users_value_wins(model):
    body = isvc(**model)
    del body["spec"]["env"]
    assert render_deployment(body)["spec"]["template"]["spec"]["containers"][0]["env"] == [
        {"name": "HF_HUB_OFFLINE", "value": "1"}]
    body["spec"]["env"] = [{"name": "HF_HUB_OFFLINE", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}}]
    assert render_deployment(body)["spec"]["template"]["spec"]["containers"][0]["env"] == body["spec"]["env"]
