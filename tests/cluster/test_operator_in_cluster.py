"""README's "Deploy on Kubernetes", command by command, on the real control plane: `helm install`
runs the operator as a pod under the chart's ServiceAccount and RBAC only; `kubectl apply -f
examples/` gives Ready services where they can run here and exactly a real cluster's state where
they cannot; `kubectl get`/`describe`/`scale`, a spec change, `kubectl delete` and `helm
uninstall` do what README says.

The tests in this module run in order on one installation (each one's name says what it proves).
"""
from __future__ import annotations

import json
import tempfile
import urllib.request
from pathlib import Path

import pytest
import yaml

from invalid_specs import INVALID, header
from cluster_helpers import (EXAMPLES, OPERATOR_NAMESPACE, RELEASE, condition,
                             forbidden_calls, get, install_chart, uninstall_chart, wait_for)

# Startup of a built-in model pod (torch import, model load, warm-up) on a busy 2-core machine.
MODEL_READY_TIMEOUT = 240


def examples() -> dict[str, dict]:
    """Every example InferenceService by file stem."""
    return {p.stem.removeprefix("inferenceservice-"): yaml.safe_load(p.read_text())
            for p in sorted(EXAMPLES.glob("inferenceservice-*.yaml"))}


def ns_of(doc: dict) -> str:
    return doc["metadata"].get("namespace", "default")


def pods_of(cluster, name: str, namespace: str) -> list[dict]:
    """The model pods of InferenceService ``name`` (not its gateway's), not terminating."""
    out = get(cluster, "pods", "-n", namespace, "-l",
              f"slipstream.dev/inferenceservice={name},app.kubernetes.io/component=model-server")
    return [p for p in out["items"] if not p["metadata"].get("deletionTimestamp")]


def ready_pod_ips(cluster, name: str, namespace: str) -> list[str]:
    return sorted(p["status"]["podIP"] for p in pods_of(cluster, name, namespace)
                  if (condition(p, "Ready") or {}).get("status") == "True")


def infsvc_ready(cluster, name: str, namespace: str) -> dict | None:
    obj = get(cluster, "infsvc", name, "-n", namespace)
    c = condition(obj, "Ready")
    return obj if c and c["status"] == "True" else None


def chat(ip: str, model: str, port: int = 8000) -> dict:
    body = json.dumps({"model": model, "max_tokens": 8,
                       "messages": [{"role": "user", "content": "Say hi."}]}).encode()
    req = urllib.request.Request(f"http://{ip}:{port}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


@pytest.fixture(scope="module")
def installed(cluster):
    """The chart installed as README says, operator Ready (``installed_at``: just before);
    whatever the tests leave is removed afterwards, so later modules start clean."""
    install_chart(cluster)
    yield cluster
    uninstall_chart(cluster)


def operator_user(cluster) -> str:
    dep = get(cluster, "deploy", "-n", OPERATOR_NAMESPACE, "-l",
              "app.kubernetes.io/instance=" + RELEASE)["items"][0]
    sa = dep["spec"]["template"]["spec"]["serviceAccountName"]
    return f"system:serviceaccount:{OPERATOR_NAMESPACE}:{sa}"


def test_helm_install_runs_the_operator_in_cluster_under_the_charts_serviceaccount(installed):
    pods = get(installed, "pods", "-n", OPERATOR_NAMESPACE)["items"]
    assert len(pods) == 1
    pod = pods[0]
    assert condition(pod, "Ready")["status"] == "True"
    user = operator_user(installed)
    assert pod["spec"]["serviceAccountName"] == user.rsplit(":", 1)[1]
    # The operator talks to the API server as that ServiceAccount (the audit log proves it),
    # and is refused nothing.
    wait_for(lambda: f'"username":"{user}"' in installed.plane.audit_log.read_text(errors="replace"),
             60, "a request from the operator's ServiceAccount")
    assert forbidden_calls(installed, user, since=installed.installed_at) == []


def test_every_example_is_accepted_and_reaches_the_state_a_real_cluster_gives_it(installed):
    docs = examples()
    for doc in docs.values():
        installed.kubectl("create", "namespace", ns_of(doc), check=False)
    # The GPU example reads a claim that exists, bound, on a real cluster with its weights.
    claim_ns = ns_of(docs["gpu-pvc"])
    installed.kubectl("apply", "-f", "-", input=yaml.safe_dump_all([{
        "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": "model-weights"},
        "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadOnlyMany"],
                 "storageClassName": "", "hostPath": {"path": "/tmp/slipstream-model-weights"},
                 "claimRef": {"namespace": claim_ns, "name": "model-weights"}}}, {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim",
        "metadata": {"name": "model-weights", "namespace": claim_ns},
        "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": "", "volumeName": "model-weights",
                 "resources": {"requests": {"storage": "1Gi"}}}}]))
    # The Hub example's shared cache exists too; its Hub is a closed port on the pod's loopback
    # (tests reach nothing off this machine), so it is a cluster where the Hub cannot be reached.
    hub_doc = docs["hub"]
    cache_dir = Path(tempfile.mkdtemp(prefix="slipstream-model-cache-examples-"))
    cache_dir.chmod(0o777)  # a hostPath volume is not chowned to the pod's fsGroup
    installed.kubectl("apply", "-f", "-", input=yaml.safe_dump_all([{
        "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": "model-cache-examples"},
        "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteMany"],
                 "storageClassName": "", "hostPath": {"path": str(cache_dir)},
                 "claimRef": {"namespace": ns_of(hub_doc), "name": "model-cache"}}}, {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim",
        "metadata": {"name": "model-cache", "namespace": ns_of(hub_doc)},
        "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "", "volumeName": "model-cache-examples",
                 "resources": {"requests": {"storage": "1Gi"}}}}]))
    hub_doc["spec"]["env"] = [{"name": "HF_ENDPOINT", "value": "http://127.0.0.1:9"}]
    # The S3 example likewise: its credentials exist, its endpoint is a closed loopback port.
    s3_doc = docs["s3"]
    installed.kubectl("create", "secret", "generic", "s3-credentials", "-n", ns_of(s3_doc),
                      "--from-literal=AWS_ACCESS_KEY_ID=example", "--from-literal=AWS_SECRET_ACCESS_KEY=example")
    s3_doc["spec"]["model"]["s3"]["endpoint"] = "http://127.0.0.1:9"
    for key, doc in docs.items():
        if key not in ("hub", "s3"):
            installed.kubectl("apply", "-f", str(EXAMPLES / f"inferenceservice-{key}.yaml"))
    installed.kubectl("apply", "-f", "-", input=yaml.safe_dump_all([hub_doc, s3_doc]))

    # The built-in model runs: Ready, the EndpointSlice of its pods' headless Service lists the
    # ready pod, it answers.
    builtin = docs["builtin"]
    name, namespace = builtin["metadata"]["name"], ns_of(builtin)
    wait_for(lambda: infsvc_ready(installed, name, namespace), MODEL_READY_TIMEOUT,
             f"InferenceService {name} Ready")
    ips = ready_pod_ips(installed, name, namespace)
    slices = get(installed, "endpointslices", "-n", namespace,
                 "-l", f"kubernetes.io/service-name={name}-pods")["items"]
    listed = sorted(a for s in slices for e in s.get("endpoints") or []
                    if (e.get("conditions") or {}).get("ready") for a in e["addresses"])
    assert listed == ips and ips
    reply = chat(ips[0], builtin["spec"]["model"].get("servedModelName", name))
    assert reply["choices"][0]["message"]["content"]

    # A GPU pod on a node without GPUs: Pending, the scheduler says why, and so does the service.
    gpu = docs["gpu-pvc"]
    gname, gns = gpu["metadata"]["name"], ns_of(gpu)
    pending = wait_for(lambda: [p for p in pods_of(installed, gname, gns)
                                if (condition(p, "PodScheduled") or {}).get("reason") == "Unschedulable"],
                       60, "the GPU pod Unschedulable")
    # (Its nodeSelector asks for a GPU node before its nvidia.com/gpu limit is even counted.)
    said = condition(pending[0], "PodScheduled")["message"]
    assert "0/1 nodes are available" in said and "node affinity/selector" in said, said
    # The API server kept what a GPU pod needs: one GPU, a memory-backed /dev/shm, no KV size.
    pod_spec = pending[0]["spec"]
    [server] = pod_spec["containers"]
    assert server["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}} in pod_spec["volumes"]
    assert {"name": "shm", "mountPath": "/dev/shm"}.items() <= next(
        m for m in server["volumeMounts"] if m["name"] == "shm").items()
    assert "--kv-cache-memory-bytes" not in server["args"]
    assert server["args"][server["args"].index("--gpu-memory-utilization") + 1] == "0.9"
    ready = wait_for(lambda: (c := condition(get(installed, "infsvc", gname, "-n", gns), "Ready"))
                     and "nodes are available" in c.get("message", "") and c, 60,
                     "the GPU service's Ready condition in the scheduler's words")
    assert ready["status"] == "False" and ready["reason"] == "PodsPending", ready

    # A foreign image: the kubelet cannot pull it, and the service's condition says so.
    image = docs["image-path"]
    iname, ins = image["metadata"]["name"], ns_of(image)
    wait_for(lambda: any(
        (cs.get("state", {}).get("waiting") or {}).get("reason") in ("ErrImagePull", "ImagePullBackOff")
        for p in pods_of(installed, iname, ins) for cs in p["status"].get("containerStatuses", [])),
        60, "the foreign image's pod in ErrImagePull")
    wait_for(lambda: "ImagePull" in json.dumps(condition(
        get(installed, "infsvc", iname, "-n", ins), "Ready")), 60,
        "the image service's Ready condition naming the pull failure")

    # The Hub and S3 models: their download steps cannot reach the store, and each service says
    # so, naming its model.
    for doc, named in ((hub_doc, "HuggingFaceTB/SmolLM2-135M-Instruct"), (s3_doc, "s3://models/qwen3-0.6b")):
        dname, dns = doc["metadata"]["name"], ns_of(doc)
        failed = wait_for(lambda: (c := condition(get(installed, "infsvc", dname, "-n", dns), "Ready"))
                          and c["reason"] == "DownloadFailed" and c, 180,
                          f"the {dname} example's Ready condition naming the failed download")
        assert named in failed["message"], failed
        installed.kubectl("delete", "infsvc", dname, "-n", dns, "--wait=false")

    # The 70B pipeline example is a LeaderWorkerSet group. Without the LWS controller (the
    # session's cluster starts it only for tests/cluster/test_group_in_cluster.py) the service
    # says what is missing; with it, the group exists and its GPU pods cannot be scheduled here.
    group = docs["70b-pipeline"]
    gname, gns = group["metadata"]["name"], ns_of(group)
    served = "leaderworkersets" in installed.kubectl("api-resources", "--api-group=leaderworkerset.x-k8s.io",
                                                     "-o", "name").stdout
    if served:
        lws = wait_for(lambda: get(installed, "leaderworkersets", gname, "-n", gns), 60, "the example's group")
        assert lws["metadata"]["ownerReferences"][0]["name"] == gname
        assert lws["spec"]["leaderWorkerTemplate"]["size"] == group["spec"]["parallelism"]["pipeline"]
        ready = wait_for(lambda: condition(get(installed, "infsvc", gname, "-n", gns), "Ready"), 60,
                         "the pipeline example's Ready condition")
        assert ready["status"] == "False", ready
    else:
        missing = wait_for(lambda: (c := condition(get(installed, "infsvc", gname, "-n", gns), "Ready"))
                           and c["reason"] == "LeaderWorkerSetMissing" and c, 60,
                           "the pipeline example's Ready condition naming the missing LeaderWorkerSet controller")
        assert missing["status"] == "False" and "kubernetes-sigs/lws" in missing["message"], missing

    # Everything else that can run here turns Ready.
    for key, doc in docs.items():
        if key in ("gpu-pvc", "image-path", "builtin", "hub", "s3", "70b-pipeline"):
            continue
        wait_for(lambda: infsvc_ready(installed, doc["metadata"]["name"], ns_of(doc)),
                 MODEL_READY_TIMEOUT, f"InferenceService {doc['metadata']['name']} Ready")

    assert forbidden_calls(installed, operator_user(installed), since=installed.installed_at) == []


def test_specs_only_the_operator_can_judge_get_invalid_spec_with_their_message(installed):
    judged = [p for p in INVALID if header(p, "rejected by") == "operator"]
    assert judged
    for path in judged:
        needle = header(path, "message mentions")
        doc = yaml.safe_load(path.read_text())
        installed.kubectl("apply", "-f", str(path))
        name, namespace = doc["metadata"]["name"], ns_of(doc)
        cond = wait_for(lambda: (c := condition(get(installed, "infsvc", name, "-n", namespace), "Ready"))
                        and c.get("reason") == "InvalidSpec" and c, 60, f"{name}: Ready=False InvalidSpec")
        assert cond["status"] == "False" and needle in cond["message"], cond
        assert get(installed, "deploy", name, "-n", namespace) is None
        installed.kubectl("delete", "-f", str(path), "--wait=true")


def test_model_pods_run_under_pod_security_restricted(installed):
    installed.kubectl("create", "namespace", "restricted")
    installed.kubectl("label", "namespace", "restricted",
                      "pod-security.kubernetes.io/enforce=restricted")
    # The admission plugin is on: a pod without the restricted settings is refused.
    plain = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "plain", "namespace": "restricted"},
             "spec": {"containers": [{"name": "c", "image": "ghcr.io/slipstream-dev/slipstream:0.1.0"}]}}
    refused = installed.kubectl("create", "-f", "-", input=yaml.safe_dump(plain), check=False)
    assert refused.returncode != 0 and 'violates PodSecurity "restricted' in refused.stderr, refused.stderr
    sim = examples()["sim"]
    sim["metadata"]["namespace"] = "restricted"
    sim["spec"].pop("autoscaling", None)
    installed.kubectl("apply", "-f", "-", input=yaml.safe_dump(sim))
    wait_for(lambda: infsvc_ready(installed, sim["metadata"]["name"], "restricted"),
             MODEL_READY_TIMEOUT, "the sim service Ready in a restricted namespace")
    installed.kubectl("delete", "namespace", "restricted", "--wait=false")


def test_kubectl_get_shows_the_printer_columns_and_describe_the_events(installed):
    out = installed.kubectl("get", "infsvc", "-A").stdout
    header = out.splitlines()[0].split()
    assert header[:9] == ["NAMESPACE", "NAME", "READY", "REASON", "REPLICAS", "DESIRED", "QUEUE", "KV%", "URL"]
    builtin = examples()["builtin"]
    described = installed.kubectl("describe", "infsvc", builtin["metadata"]["name"],
                                  "-n", ns_of(builtin)).stdout
    assert "Events:" in described
    assert "slipstream-operator" in described      # From: the operator, not "kopf"
    assert "e+09" not in described                 # times as durations or RFC 3339, not epochs


def test_kubectl_scale_goes_through_the_scale_subresource_to_three_pods(installed):
    sim = examples()["sim"]
    name, namespace = sim["metadata"]["name"], ns_of(sim)
    if (sim["spec"].get("autoscaling") or {}).get("enabled"):
        installed.kubectl("patch", "infsvc", name, "-n", namespace, "--type=merge",
                          "-p", '{"spec": {"autoscaling": {"enabled": false}}}')
    installed.kubectl("scale", "infsvc", name, "-n", namespace, "--replicas", "3")
    wait_for(lambda: len(ready_pod_ips(installed, name, namespace)) == 3, 120,
             "three ready pods after kubectl scale")
    scale = json.loads(installed.kubectl(
        "get", "--raw", f"/apis/slipstream.dev/v1alpha1/namespaces/{namespace}/inferenceservices/{name}/scale").stdout)
    assert scale["spec"]["replicas"] == 3
    wait_for(lambda: json.loads(installed.kubectl(
        "get", "--raw", f"/apis/slipstream.dev/v1alpha1/namespaces/{namespace}/inferenceservices/{name}/scale").stdout
    )["status"].get("replicas") == 3, 60, "the scale subresource's status.replicas = 3")


def test_a_spec_change_rolls_the_pods(installed):
    sim = examples()["sim"]
    name, namespace = sim["metadata"]["name"], ns_of(sim)
    before = {p["metadata"]["name"] for p in pods_of(installed, name, namespace)}
    installed.kubectl("patch", "infsvc", name, "-n", namespace, "--type=merge", "-p",
                      json.dumps({"spec": {"env": [{"name": "ROLL", "value": "1"}]}}))

    def rolled():
        pods = pods_of(installed, name, namespace)
        ready = [p for p in pods if (condition(p, "Ready") or {}).get("status") == "True"]
        return (len(pods) == 3 and len(ready) == 3
                and not before & {p["metadata"]["name"] for p in pods})
    wait_for(rolled, 180, "three new ready pods after the spec change")


def test_kubectl_delete_garbage_collects_the_children(installed):
    sim = examples()["sim"]
    name, namespace = sim["metadata"]["name"], ns_of(sim)
    selector = f"slipstream.dev/inferenceservice={name}"
    kinds = "deploy,svc,pdb,pods,sa,role,rolebinding"
    children = {o["kind"] for o in get(installed, kinds, "-n", namespace, "-l", selector)["items"]}
    assert children == {"Deployment", "Service", "PodDisruptionBudget", "Pod", "ServiceAccount",
                        "Role", "RoleBinding"}, children
    installed.kubectl("delete", "infsvc", name, "-n", namespace, "--wait=true", "--timeout=120s")
    wait_for(lambda: not get(installed, kinds, "-n", namespace, "-l", selector)["items"],
             120, "the Deployments, Services, PodDisruptionBudget, pods and the gateway's "
                  "ServiceAccount, Role and RoleBinding gone")


def test_helm_uninstall_leaves_nothing_of_ours_but_the_crds(installed):
    # README: delete the InferenceServices while the operator runs, then uninstall.
    installed.kubectl("delete", "infsvc", "--all", "-A", "--wait=true", "--timeout=180s")
    installed.helm("uninstall", RELEASE, "-n", OPERATOR_NAMESPACE, "--wait", "--timeout", "3m")
    # Pods leave after their grace period (preStop, then the server's drain).
    def left() -> list[str]:
        return [f"{o['kind']}/{o['metadata']['name']}" for o in get(
            installed, "all,sa,role,rolebinding,pdb,cm", "-A",
            "-l", "app.kubernetes.io/name=slipstream")["items"]]
    wait_for(lambda: left() == [], 120, "nothing labelled app.kubernetes.io/name=slipstream")
    cluster_scoped = get(installed, "clusterrole,clusterrolebinding", "-l",
                         "app.kubernetes.io/name=slipstream")["items"]
    assert cluster_scoped == []
    assert get(installed, "crd", "inferenceservices.slipstream.dev") is not None
