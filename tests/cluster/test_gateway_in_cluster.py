"""The inference gateway on the real control plane (issue 12): `helm install`, an InferenceService
with spec.routing, and what the operator renders for it, run for real.

The operator (in-cluster, under the chart's RBAC) creates the gateway's ServiceAccount, Role and
RoleBinding (the API server lets it grant EndpointSlice list/watch only because it holds them),
the gateway Deployment and the headless Service NAME-pods, all owned by the InferenceService. The
process kubelet runs `slipstream gateway` from the repository's venv with the ServiceAccount token
mounted; the gateway watches the EndpointSlices of NAME-pods with it, under its Role only (the
audit log shows no 403). There is no kube-proxy: the test reaches a gateway pod at the address
the EndpointSlice controller lists for the Service NAME, as kube-proxy would route to it.

The tests in this module run in order on one installation.
"""
from __future__ import annotations

import concurrent.futures
import json
import urllib.error
import urllib.request

import pytest
import yaml

from cluster_helpers import (CHART, OPERATOR_NAMESPACE, RELEASE, condition, forbidden_calls,
                             get, install_chart, uninstall_chart, wait_for)

pytestmark = pytest.mark.timeout(900)

NAMESPACE = "routing"
NAME = "routed"
# Model and gateway pods starting on a busy 2-core machine.
READY_TIMEOUT = 240


def service(routing: dict | None = None) -> dict:
    return {
        "apiVersion": "slipstream.dev/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": NAME, "namespace": NAMESPACE},
        "spec": {
            "model": {"source": "sim", "profile": "tiny,time_scale=4,output_len=8"},
            "replicas": 1,
            "routing": routing if routing is not None else {"policy": "least-loaded"},
            "engine": {"maxNumSeqs": 4, "maxNumBatchedTokens": 256},
            "resources": {"cpu": "250m", "memory": "1Gi"},
            "startupTimeoutSeconds": 120, "shutdownTimeoutSeconds": 5,
        },
    }


@pytest.fixture(scope="module")
def installed(cluster):
    """The chart installed (CRDs applied first, as an upgrade would), the namespace made;
    uninstalled afterwards."""
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CHART / "crds"))
    install_chart(cluster)
    cluster.kubectl("create", "namespace", NAMESPACE, check=False)
    yield cluster
    uninstall_chart(cluster)


def operator_user(cluster) -> str:
    dep = get(cluster, "deploy", "-n", OPERATOR_NAMESPACE, "-l",
              f"app.kubernetes.io/instance={RELEASE}")["items"][0]
    return f"system:serviceaccount:{OPERATOR_NAMESPACE}:" \
           f"{dep['spec']['template']['spec']['serviceAccountName']}"


def apply(cluster, obj: dict) -> None:
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(obj))


def slice_addresses(cluster, service_name: str) -> list[str]:
    """Ready, not terminating addresses in the EndpointSlices of ``service_name``."""
    slices = get(cluster, "endpointslices", "-n", NAMESPACE,
                 "-l", f"kubernetes.io/service-name={service_name}")["items"]
    return sorted(a for s in slices for e in s.get("endpoints") or []
                  if (e.get("conditions") or {}).get("ready")
                  and not (e.get("conditions") or {}).get("terminating") for a in e["addresses"])


def ready_ips(cluster, component: str) -> list[str]:
    pods = get(cluster, "pods", "-n", NAMESPACE, "-l",
               f"slipstream.dev/inferenceservice={NAME},app.kubernetes.io/component={component}")
    return sorted(p["status"]["podIP"] for p in pods["items"]
                  if not p["metadata"].get("deletionTimestamp")
                  and (condition(p, "Ready") or {}).get("status") == "True")


def chat(ip: str, port: int = 8000) -> dict:
    body = json.dumps({"model": NAME, "max_tokens": 8,
                       "messages": [{"role": "user", "content": "Say hi."}]}).encode()
    req = urllib.request.Request(f"http://{ip}:{port}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def test_the_operator_creates_the_gateway_its_account_role_binding_and_the_headless_service(installed):
    apply(installed, service())
    owner = wait_for(lambda: get(installed, "infsvc", NAME, "-n", NAMESPACE), 30, "the service")
    uid = owner["metadata"]["uid"]
    found = {}
    for kind, name in (("deploy", f"{NAME}-gateway"), ("sa", f"{NAME}-gateway"),
                       ("role", f"{NAME}-gateway"), ("rolebinding", f"{NAME}-gateway"),
                       ("svc", f"{NAME}-pods"), ("svc", NAME), ("deploy", NAME)):
        found[kind, name] = obj = wait_for(lambda: get(installed, kind, name, "-n", NAMESPACE),
                                           60, f"{kind}/{name}")
        [ref] = obj["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == \
            ("InferenceService", NAME, uid, True), (kind, name)
    assert found["role", f"{NAME}-gateway"]["rules"] == [{
        "apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
        "verbs": ["list", "watch"]}]
    headless = found["svc", f"{NAME}-pods"]["spec"]
    assert headless["clusterIP"] == "None" and not headless.get("publishNotReadyAddresses")
    gateway = found["deploy", f"{NAME}-gateway"]
    assert found["svc", NAME]["spec"]["selector"] == gateway["spec"]["selector"]["matchLabels"]
    assert gateway["spec"]["replicas"] == 2
    assert gateway["spec"]["template"]["spec"]["serviceAccountName"] == f"{NAME}-gateway"
    # Written once: the live objects match the render (nothing the server drops reads as drift).
    updated = get(installed, "events", "-n", NAMESPACE, "--field-selector",
                  f"involvedObject.name={NAME},reason=Updated")["items"]
    assert updated == [], [e["message"] for e in updated]
    # Creating a Role that grants EndpointSlice reads was not refused: the operator holds them.
    assert forbidden_calls(installed, operator_user(installed), since=installed.installed_at) == []


def test_gateway_pods_turn_ready_and_the_service_is_ready_with_its_gateway(installed):
    obj = wait_for(lambda: (o := get(installed, "infsvc", NAME, "-n", NAMESPACE))
                   and (condition(o, "Ready") or {}).get("status") == "True" and o,
                   READY_TIMEOUT, f"InferenceService {NAME} Ready")
    gateway_ready = condition(obj, "GatewayReady")
    assert gateway_ready["status"] == "True", gateway_ready
    assert obj["status"]["gateway"]["url"] == f"http://{NAME}.{NAMESPACE}.svc.cluster.local"
    assert obj["status"]["gateway"]["readyReplicas"] >= 1
    # The Service NAME lists the gateway pods, NAME-pods the model pods; neither the other's.
    gateways = wait_for(lambda: ready_ips(installed, "gateway"), 60, "a ready gateway pod")
    models = ready_ips(installed, "model-server")
    wait_for(lambda: slice_addresses(installed, NAME) == gateways, 60,
             f"the EndpointSlices of {NAME} listing the ready gateway pods {gateways}")
    wait_for(lambda: slice_addresses(installed, f"{NAME}-pods") == models, 60,
             f"the EndpointSlices of {NAME}-pods listing the model pods {models}")


def test_a_request_through_the_gateway_reaches_a_model_pod(installed):
    gateway_ip = slice_addresses(installed, NAME)[0]  # where kube-proxy would send it
    # The gateway learns the model pods from their EndpointSlices (a watch); retry until it has.
    reply = wait_for(lambda: chat(gateway_ip), 60, "an answer through the gateway", interval=2)
    assert reply["object"] == "chat.completion"
    assert reply["choices"][0]["message"]["content"] is not None
    # The gateway's own calls were allowed by its Role alone.
    gateway_user = f"system:serviceaccount:{NAMESPACE}:{NAME}-gateway"
    audit = installed.plane.audit_log.read_text(errors="replace")
    assert f'"username":"{gateway_user}"' in audit
    assert forbidden_calls(installed, gateway_user) == []


def test_routing_off_removes_the_gateway_and_points_the_service_at_the_model_pods(installed):
    installed.kubectl("patch", "infsvc", NAME, "-n", NAMESPACE, "--type=merge",
                      "-p", json.dumps({"spec": {"routing": {"enabled": False}}}))
    wait_for(lambda: all(get(installed, kind, f"{NAME}-gateway", "-n", NAMESPACE) is None
                         for kind in ("deploy", "sa", "role", "rolebinding")), 60,
             "the gateway's Deployment, ServiceAccount, Role and RoleBinding deleted")
    svc = get(installed, "svc", NAME, "-n", NAMESPACE)
    assert svc["spec"]["selector"]["app.kubernetes.io/component"] == "model-server"
    models = ready_ips(installed, "model-server")
    wait_for(lambda: slice_addresses(installed, NAME) == models, 60,
             f"the EndpointSlices of {NAME} listing the model pods")
    obj = get(installed, "infsvc", NAME, "-n", NAMESPACE)
    assert "gateway" not in obj["status"]
    assert condition(obj, "GatewayReady")["reason"] == "RoutingDisabled"
    assert forbidden_calls(installed, operator_user(installed), since=installed.installed_at) == []


def test_deleting_the_service_garbage_collects_everything_it_owned(installed):
    # Routing back on (kubectl apply leaves the patched `enabled: false` unless it names it).
    apply(installed, service({"enabled": True, "policy": "least-loaded"}))
    wait_for(lambda: get(installed, "deploy", f"{NAME}-gateway", "-n", NAMESPACE), 60,
             "the gateway back")
    selector = f"slipstream.dev/inferenceservice={NAME}"
    kinds = "deploy,svc,pods,sa,role,rolebinding"
    installed.kubectl("delete", "infsvc", NAME, "-n", NAMESPACE, "--wait=true", "--timeout=120s")
    wait_for(lambda: not get(installed, kinds, "-n", NAMESPACE, "-l", selector)["items"], 120,
             "every child of the InferenceService gone (garbage collection)")


COLD = "cold"
IDLE = 30  # scaleToZeroAfterSeconds of the scale-from-zero service
COLD_REQUESTS = 12


def test_a_service_at_zero_replicas_answers_every_request_and_goes_back_to_zero(installed):
    """Scale from zero for real: the Deployment at 0, requests held by the gateway, the operator
    reading the gateway's waiting requests as demand, the Deployment controller and the kubelet
    starting the pod, the gateway hearing of it from the EndpointSlice; then, idle, back to 0."""
    cold = service({"policy": "least-loaded", "replicas": 1, "queueTimeoutSeconds": 240})
    cold["metadata"]["name"] = COLD
    del cold["spec"]["replicas"]
    cold["spec"]["autoscaling"] = {"enabled": True, "minReplicas": 0, "maxReplicas": 1,
                                   "scaleToZeroAfterSeconds": IDLE}
    apply(installed, cold)
    models = f"slipstream.dev/inferenceservice={COLD},app.kubernetes.io/component=model-server"
    # At zero the service is Ready once its gateway is; no model pod runs.
    obj = wait_for(lambda: (o := get(installed, "infsvc", COLD, "-n", NAMESPACE))
                   and (condition(o, "Ready") or {}).get("status") == "True" and o,
                   READY_TIMEOUT, f"InferenceService {COLD} Ready at zero replicas")
    assert get(installed, "deploy", COLD, "-n", NAMESPACE)["spec"]["replicas"] == 0
    assert get(installed, "pods", "-n", NAMESPACE, "-l", models)["items"] == []
    gateway_ip = wait_for(lambda: slice_addresses(installed, COLD), 60, f"a ready gateway of {COLD}")[0]

    def ask(i: int) -> tuple[int, str]:
        body = json.dumps({"model": COLD, "max_tokens": 8,
                           "messages": [{"role": "user", "content": f"Cold {i}."}]}).encode()
        req = urllib.request.Request(f"http://{gateway_ip}:8000/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=300) as resp:
                return resp.status, json.loads(resp.read())["choices"][0]["finish_reason"]
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode(errors="replace")[:200]

    with concurrent.futures.ThreadPoolExecutor(COLD_REQUESTS) as pool:
        answers = list(pool.map(ask, range(COLD_REQUESTS)))
    assert all(status == 200 for status, _ in answers), answers
    status = get(installed, "infsvc", COLD, "-n", NAMESPACE)["status"]
    assert [(e["fromReplicas"], e["toReplicas"]) for e in status["scalingHistory"]][:1] == [(0, 1)], status
    # Idle: back to zero after scaleToZeroAfterSeconds, the pod gone.
    wait_for(lambda: get(installed, "deploy", COLD, "-n", NAMESPACE)["spec"]["replicas"] == 0,
             IDLE + 90, f"{COLD} scaled back to zero")
    wait_for(lambda: not get(installed, "pods", "-n", NAMESPACE, "-l", models)["items"], 90,
             f"{COLD}'s model pod gone")
    obj = get(installed, "infsvc", COLD, "-n", NAMESPACE)
    assert (condition(obj, "Ready") or {}).get("status") == "True", obj["status"]
    assert [(e["fromReplicas"], e["toReplicas"]) for e in obj["status"]["scalingHistory"]][-1] == (1, 0)
    installed.kubectl("delete", "infsvc", COLD, "-n", NAMESPACE, "--wait=true", "--timeout=120s")
