"""spec.model.uri on the real control plane, the operator installed by the chart: a Hub model
(the loopback Hub of tests/hub_server.py on the pod network's gateway) downloads once into a
shared ReadWriteMany cache for two pods, a third pod starts from the cache, a new revision
downloads again, and a bad token or a missing model gives Ready=False naming the model and the
status code without a retry storm; an S3 model (moto's server, tests/s3_server.py) downloads
with the credentials of a Secret; a model image from a registry on loopback
(go-containerregistry's ``registry``) is served through an image volume, and through a modelcar
sidecar (a native sidecar linking its image's /models through /proc/PID/root) before them.

The tests in this module run in order on one installation.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Iterator

import pytest
import yaml

from cluster_helpers import condition, get, install_chart, uninstall_chart, wait_for
from controlplane import BIN, POD_GATEWAY_IP, free_port
from hub_server import HubServer, Repo
from test_operator_in_cluster import MODEL_READY_TIMEOUT, chat, pods_of, ready_pod_ips

from slipstream.server.models.loader import BUILTIN_FILE, builtin_model_path

pytestmark = pytest.mark.cluster

NS = "model-sources"
REPO_ID = "acme/smollm2-gguf"
HF_URI = f"hf://{REPO_ID}:*Q4_1.gguf"


@pytest.fixture(scope="module")
def installed(cluster):
    install_chart(cluster)
    cluster.kubectl("create", "namespace", NS, check=False)
    yield cluster
    uninstall_chart(cluster)
    cluster.kubectl("delete", "namespace", NS, "--wait=false", check=False)


@pytest.fixture(scope="module")
def gguf() -> bytes:
    return builtin_model_path().read_bytes()


@pytest.fixture(scope="module")
def hub(gguf):
    """The Hub on the pod network's gateway, which pods reach; one GGUF repository holding the
    built-in model beside a decoy quantization, a gated repository."""
    server = HubServer(host=POD_GATEWAY_IP)
    server.add(REPO_ID, Repo(files={BUILTIN_FILE: gguf, "SmolLM2-135M-Instruct.Q8_0.gguf": b"not this one",
                                    "README.md": b"# SmolLM2 GGUF\n", "pytorch_model.bin": b"never fetched"}))
    server.add("acme/gated", Repo(files={BUILTIN_FILE: gguf}, gated=True, allowed_tokens={"hf_granted"}))
    server.start()
    yield server
    server.stop()


def apply(cluster, *docs: dict) -> None:
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))


def service(name: str, model: dict, hub: HubServer, replicas: int = 1) -> dict:
    return {"apiVersion": "slipstream.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"model": model, "replicas": replicas, "routing": {"enabled": False},
                     "engine": {"kvCacheMemory": "256Mi", "maxNumSeqs": 4},
                     "resources": {"cpu": "500m", "memory": "2Gi"},
                     "env": [{"name": "HF_ENDPOINT", "value": hub.endpoint}]}}


def ready(cluster, name: str, replicas: int) -> dict | None:
    obj = get(cluster, "infsvc", name, "-n", NS)
    c = condition(obj, "Ready")
    if c and c["status"] == "True" and (obj.get("status") or {}).get("readyReplicas") == replicas:
        return obj
    return None


def gguf_downloads(hub: HubServer, data: bytes) -> int:
    return hub.count("GET", hashlib.sha256(data).hexdigest())


def test_two_pods_download_a_hub_model_once_into_the_shared_cache_and_serve_it(installed, hub, gguf):
    cache_dir = Path(tempfile.mkdtemp(prefix="slipstream-model-cache-"))
    cache_dir.chmod(0o777)
    apply(installed, {
        "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": "model-sources-cache"},
        "spec": {"capacity": {"storage": "5Gi"}, "accessModes": ["ReadWriteMany"], "storageClassName": "",
                 "hostPath": {"path": str(cache_dir)}, "persistentVolumeReclaimPolicy": "Retain",
                 "claimRef": {"namespace": NS, "name": "model-cache"}}}, {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "model-cache", "namespace": NS},
        "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "", "volumeName": "model-sources-cache",
                 "resources": {"requests": {"storage": "5Gi"}}}})
    apply(installed, service("hub", {"uri": HF_URI, "cache": {"claimName": "model-cache"}}, hub, replicas=2))

    # While the first pod fetches, the service says so (the listing shows it in Reason).
    seen = wait_for(lambda: (c := condition(get(installed, "infsvc", "hub", "-n", NS), "Ready"))
                    and c["reason"] in ("Downloading", "ReplicasReady", "NoReplicasReady") and c, 120,
                    "a Ready condition")
    obj = wait_for(lambda: ready(installed, "hub", 2), MODEL_READY_TIMEOUT, "both Hub pods Ready")
    assert gguf_downloads(hub, gguf) == 1, hub.requests  # two pods, one download
    assert hub.count(contains="pytorch_model.bin") == 0 and hub.count(contains="Q8_0") == 0
    report = obj["status"]["model"]
    assert report["uri"] == HF_URI and report["revision"] == hub.repos[REPO_ID].sha, report
    assert report["bytes"] >= len(gguf)
    listing = installed.kubectl("get", "infsvc", "hub", "-n", NS).stdout
    assert "REASON" in listing.splitlines()[0], listing
    reply = chat(ready_pod_ips(installed, "hub", NS)[0], "hub")
    assert reply["choices"][0]["message"]["content"]
    print("first Ready condition seen:", seen["reason"])

    # A third pod starts from the cache: nothing comes down again.
    installed.kubectl("scale", "infsvc", "hub", "-n", NS, "--replicas=3")
    wait_for(lambda: ready(installed, "hub", 3), MODEL_READY_TIMEOUT, "the third Hub pod Ready")
    assert gguf_downloads(hub, gguf) == 1, hub.requests


def test_a_new_revision_downloads_again_and_the_status_names_it(installed, hub, gguf):
    # The same weights with a trailing pad: a new file, so its bytes come down again.
    changed = gguf + b"\0" * 32
    old_sha = hub.repos[REPO_ID].sha
    hub.add(REPO_ID, Repo(files={BUILTIN_FILE: changed, "README.md": b"# SmolLM2 GGUF, v2\n"}))
    new_sha = hub.repos[REPO_ID].sha
    assert new_sha != old_sha
    apply(installed, service("hub", {"uri": f"hf://{REPO_ID}@{new_sha}:*Q4_1.gguf",
                                     "cache": {"claimName": "model-cache"}}, hub, replicas=3))
    obj = wait_for(lambda: (o := ready(installed, "hub", 3)) and o["status"].get("model", {}).get(
        "revision") == new_sha and o, MODEL_READY_TIMEOUT * 2, "the new revision served")
    assert gguf_downloads(hub, changed) == 1, hub.requests
    assert obj["status"]["model"]["uri"].endswith(f"@{new_sha}:*Q4_1.gguf")


REFUSED = [("gated", "acme/gated", "hf_wrong", "403"), ("missing", "acme/missing", "hf_granted", "404")]


def test_a_refused_download_is_ready_false_naming_the_model_and_the_code_without_a_retry_storm(installed, hub):
    """A gated model with a wrong token (403) and a missing one (404), side by side."""
    for name, repo, token, _ in REFUSED:
        installed.kubectl("create", "secret", "generic", f"{name}-token", "-n", NS,
                          f"--from-literal=HF_TOKEN={token}", check=False)
        apply(installed, service(name, {"uri": f"hf://{repo}", "secretRef": {"name": f"{name}-token"}}, hub))
    before = {}
    for name, repo, _, code in REFUSED:
        failed = wait_for(lambda: (c := condition(get(installed, "infsvc", name, "-n", NS), "Ready"))
                          and c["reason"] == "DownloadFailed" and c, 120, f"{name}: Ready=False DownloadFailed")
        assert failed["status"] == "False"
        assert repo in failed["message"] and code in failed["message"], failed
        before[repo] = (hub.count(contains=repo), time.monotonic())
    time.sleep(30)
    # The download step fails at once on a 4xx (no retries of its own); the kubelet's back-off
    # spaces the restarts (10 s, 20 s, ...): a handful of attempts in 30 s, not hundreds.
    for name, repo, _, _ in REFUSED:
        count, since = before[repo]
        attempts = hub.count(contains=repo) - count
        assert attempts <= 12 * (time.monotonic() - since) / 30, (repo, hub.requests[-40:])
        installed.kubectl("delete", "infsvc", name, "-n", NS, "--wait=false")


def test_an_s3_model_downloads_with_the_secrets_credentials_and_serves(installed, hub, gguf):
    import boto3
    from s3_server import start_s3

    s3 = start_s3(POD_GATEWAY_IP)
    try:
        client = boto3.client("s3", endpoint_url=s3.url, region_name="us-east-1",
                              aws_access_key_id="testing", aws_secret_access_key="testing")
        client.create_bucket(Bucket="models")
        client.put_object(Bucket="models", Key=f"smollm2/{BUILTIN_FILE}", Body=gguf)
        installed.kubectl("create", "secret", "generic", "s3-credentials", "-n", NS,
                          "--from-literal=AWS_ACCESS_KEY_ID=testing", "--from-literal=AWS_SECRET_ACCESS_KEY=testing",
                          check=False)
        apply(installed, service("s3", {"uri": "s3://models/smollm2", "secretRef": {"name": "s3-credentials"},
                                        "s3": {"endpoint": s3.url, "region": "us-east-1"}}, hub))
        obj = wait_for(lambda: ready(installed, "s3", 1), MODEL_READY_TIMEOUT, "the S3 model's pod Ready")
        report = obj["status"]["model"]
        assert report["uri"] == "s3://models/smollm2" and report["revision"] and report["bytes"] >= len(gguf), report
        assert any(method == "GET" and path.endswith(BUILTIN_FILE) for method, path, _ in s3.seen), s3.seen
        reply = chat(ready_pod_ips(installed, "s3", NS)[0], "s3")
        assert reply["choices"][0]["message"]["content"]
        installed.kubectl("delete", "infsvc", "s3", "-n", NS, "--wait=false")
    finally:
        s3.shutdown()


@contextlib.contextmanager
def model_image(tmp_path: Path) -> Iterator[str]:
    """A registry on loopback (a free port) holding the built-in model as ``/models/<file>`` in
    a one-layer image; yields the image's reference, stops the registry after."""
    port = free_port()
    registry = subprocess.Popen([str(BIN / "registry"), "-port", str(port)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    try:
        layer = tmp_path / "layer.tar"
        with tarfile.open(layer, "w") as tar:
            tar.add(builtin_model_path(), arcname=f"models/{BUILTIN_FILE}")
        ref = f"127.0.0.1:{port}/models/smollm2:q4_1"
        wait_for(lambda: subprocess.run([str(BIN / "crane"), "append", "-f", str(layer), "-t", ref],
                                        capture_output=True).returncode == 0, 30, "the image pushed")
        yield ref
    finally:
        registry.terminate()
        registry.wait(10)


def test_a_model_image_from_a_registry_serves_through_an_image_volume(installed, hub, gguf, tmp_path):
    with model_image(tmp_path) as ref:
        apply(installed, service("image", {"uri": f"oci://{ref}"}, hub))
        wait_for(lambda: ready(installed, "image", 1), MODEL_READY_TIMEOUT, "the model image's pod Ready")
        [pod] = pods_of(installed, "image", NS)
        # (pullPolicy as rendered, IfNotPresent, or Always where the AlwaysPullImages admission plugin runs)
        assert any(v.get("image", {}).get("reference") == ref for v in pod["spec"]["volumes"]), pod["spec"]["volumes"]
        reply = chat(ready_pod_ips(installed, "image", NS)[0], "image")
        assert reply["choices"][0]["message"]["content"]


def test_before_image_volumes_a_modelcar_sidecar_serves_the_model_image_and_stops_with_its_pod(
        installed, hub, tmp_path):
    """oci.mount modelcar (what auto picks before Kubernetes 1.35): the model image runs as a
    native sidecar in a shared process namespace; the server reads its /models through the link
    the sidecar made, and the sidecar stops when the pod is deleted."""
    with model_image(tmp_path) as ref:
        apply(installed, service("modelcar", {"uri": f"oci://{ref}", "oci": {"mount": "modelcar"}}, hub))
        dep = wait_for(lambda: get(installed, "deploy", "modelcar", "-n", NS), 60, "the modelcar Deployment")
        template = dep["spec"]["template"]["spec"]
        assert template["shareProcessNamespace"] is True
        [car] = template["initContainers"]
        assert car["restartPolicy"] == "Always" and car["image"] == ref
        print(json.dumps(car["command"]))
        wait_for(lambda: ready(installed, "modelcar", 1), MODEL_READY_TIMEOUT, "the modelcar pod Ready")
        [pod] = pods_of(installed, "modelcar", NS)
        assert pod["spec"]["shareProcessNamespace"] is True
        [car] = pod["spec"]["initContainers"]
        assert car["restartPolicy"] == "Always" and car["image"] == ref
        [car_status] = pod["status"]["initContainerStatuses"]
        assert car_status["started"] is True and "running" in car_status["state"], car_status
        assert car_status["imageID"].startswith(f"{ref.rsplit(':', 1)[0]}@sha256:"), car_status
        reply = chat(ready_pod_ips(installed, "modelcar", NS)[0], "modelcar")
        assert reply["choices"][0]["message"]["content"]
        installed.kubectl("delete", "infsvc", "modelcar", "-n", NS, "--wait=false")
        name = pod["metadata"]["name"]
        wait_for(lambda: get(installed, "pod", name, "-n", NS) is None, 120, "the modelcar pod gone")
        events = get(installed, "events", "-n", NS, "--field-selector", f"involvedObject.name={name}")["items"]
        stopped = [e["message"] for e in events if e["reason"] == "Killing"]
        assert "Stopping container modelcar" in stopped, stopped
