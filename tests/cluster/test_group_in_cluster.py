"""A model split over two pods on the real control plane (issue 34): the LeaderWorkerSet
controller built from sigs.k8s.io/lws (``make cluster``) with its own webhooks, the chart's
operator, and the process kubelet's pod names (hostname, /etc/hosts, the headless Services'
records) carrying the ranks' rendezvous from the worker pod to the leader's DNS name.

`parallelism: {tensor: 1, pipeline: 2}` on CPU: the operator renders a LeaderWorkerSet, LWS
makes the group (leader ``NAME-0``, worker ``NAME-0-1``, the headless Service ``NAME-0``) and
injects ``LWS_LEADER_ADDRESS`` and ``LWS_WORKER_INDEX``, from which the pods' ``slipstream
serve`` flags meet. The tests run in order on one installation.
"""
from __future__ import annotations

import concurrent.futures
import json
import time
import urllib.error
import urllib.request

import pytest
import yaml

from cluster_helpers import CHART, condition, get, install_chart, uninstall_chart, wait_for
from slipstream.api_types.metrics import GATEWAY_RETRIES, NUM_REQUESTS_RUNNING, parse_exposition

pytestmark = pytest.mark.timeout(1200)

NAMESPACE = "groups"
NAME = "pipelined"
LEADER, WORKER = f"{NAME}-0", f"{NAME}-0-1"
# Two pods loading their stage and warming up, on a busy 2-core machine.
READY_TIMEOUT = 300
CHAT = {"model": NAME, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
        "messages": [{"role": "user", "content": "Name three colours."}]}
# Still generating when the worker's ranks die (1-3 s after its deletion with a grace period of 1 s).
LONG = {**CHAT, "max_tokens": 1024, "messages": [{"role": "user", "content": "Tell a long story."}]}


def service() -> dict:
    return {
        "apiVersion": "slipstream.dev/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": NAME, "namespace": NAMESPACE},
        "spec": {
            "model": {"source": "builtin"},
            "replicas": 1,
            "parallelism": {"tensor": 1, "pipeline": 2},
            "engine": {"kvCacheMemory": "96Mi"},
            "routing": {"replicas": 1, "queueTimeoutSeconds": 400},
            "resources": {"cpu": "1", "memory": "3Gi"},
            "startupTimeoutSeconds": 400, "shutdownTimeoutSeconds": 5,
        },
    }


@pytest.fixture(scope="module")
def installed(cluster):
    """LWS started on the session's cluster (it stays), the chart installed (CRDs applied
    first), the InferenceService applied; uninstalled afterwards."""
    cluster.start_lws()
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CHART / "crds"))
    install_chart(cluster)
    cluster.kubectl("create", "namespace", NAMESPACE, check=False)
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(service()))
    yield cluster
    uninstall_chart(cluster)


def group_pods(cluster) -> dict[str, dict]:
    """The model pods of the service by name, not terminating."""
    pods = get(cluster, "pods", "-n", NAMESPACE, "-l",
               f"slipstream.dev/inferenceservice={NAME},app.kubernetes.io/component=model-server")["items"]
    return {p["metadata"]["name"]: p for p in pods if not p["metadata"].get("deletionTimestamp")}


def ready(pod: dict | None) -> bool:
    return (condition(pod, "Ready") or {}).get("status") == "True"


def service_ready(cluster) -> dict | None:
    obj = get(cluster, "infsvc", NAME, "-n", NAMESPACE)
    return obj if (condition(obj, "Ready") or {}).get("status") == "True" else None


def gateway_address(cluster) -> str:
    """A ready address of the Service NAME (the gateway pods): where kube-proxy would send."""
    slices = get(cluster, "endpointslices", "-n", NAMESPACE, "-l", f"kubernetes.io/service-name={NAME}")["items"]
    return sorted(a for s in slices for e in s.get("endpoints") or []
                  if (e.get("conditions") or {}).get("ready") for a in e["addresses"])[0]


def chat(address: str, body: dict = CHAT, timeout: float = 60) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://{address}:8000/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def one_process_answer() -> str:
    """What one in-process engine answers to CHAT (greedy), for the group to equal."""
    from slipstream.server.engine import LLM, SamplingParams
    llm = LLM(kv_cache_memory_bytes=64 << 20)
    out = llm.chat(CHAT["messages"], SamplingParams(temperature=0, max_tokens=CHAT["max_tokens"], ignore_eos=True))
    return out[0].outputs[0].text


def scrape(address: str) -> dict:
    with urllib.request.urlopen(f"http://{address}:8000/metrics", timeout=10) as resp:
        return parse_exposition(resp.read().decode())


def gateway_retries(address: str) -> float:
    """Requests the gateway sent again before their first byte (any reason)."""
    return sum(v for name, samples in scrape(address).items() if name == GATEWAY_RETRIES + "_total"
               for _, v in samples)


def test_pipeline_two_is_one_leaderworkerset_group_whose_pods_find_the_leader_by_name(installed):
    obj = wait_for(lambda: service_ready(installed), READY_TIMEOUT, f"InferenceService {NAME} Ready")
    lws = get(installed, "leaderworkersets", NAME, "-n", NAMESPACE)
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    assert lws["metadata"]["ownerReferences"][0]["uid"] == obj["metadata"]["uid"]
    assert get(installed, "deploy", NAME, "-n", NAMESPACE) is None
    pods = group_pods(installed)
    assert sorted(pods) == [LEADER, WORKER] and all(ready(p) for p in pods.values()), \
        {n: p["status"].get("conditions") for n, p in pods.items()}
    # LWS's pod webhook put the group's variables into the real pods; the worker's command line
    # read them (the kubelet expands $(VAR)).
    for name, index in ((LEADER, "0"), (WORKER, "1")):
        [server] = pods[name]["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in server.get("env") or []}
        assert env["LWS_LEADER_ADDRESS"] == f"{LEADER}.{LEADER}.{NAMESPACE}", env
        assert env["LWS_WORKER_INDEX"] == index and env["LWS_GROUP_SIZE"] == "2"
        assert pods[name]["spec"]["hostname"] == name and pods[name]["spec"]["subdomain"] == LEADER
    # LWS's pod webhook sees only a group's pods (its release's objectSelector), at its host URL.
    hooks = {h["name"]: h for h in get(installed, "mutatingwebhookconfiguration",
                                      "lws-mutating-webhook-configuration")["webhooks"]}
    assert hooks["mpod.kb.io"]["objectSelector"] == {
        "matchExpressions": [{"key": "leaderworkerset.sigs.k8s.io/name", "operator": "Exists"}]}
    assert hooks["mpod.kb.io"]["clientConfig"]["url"].startswith("https://127.0.0.1:")
    # The headless Service LWS made for the group lists both pods by hostname (cluster DNS's data).
    slices = get(installed, "endpointslices", "-n", NAMESPACE, "-l", f"kubernetes.io/service-name={LEADER}")
    hostnames = {e.get("hostname"): e["addresses"][0] for s in slices["items"] for e in s.get("endpoints") or []}
    assert hostnames == {LEADER: pods[LEADER]["status"]["podIP"], WORKER: pods[WORKER]["status"]["podIP"]}
    # The gateway routes to the leader only: the Service NAME-pods selects leaders.
    model_slices = get(installed, "endpointslices", "-n", NAMESPACE, "-l",
                       f"kubernetes.io/service-name={NAME}-pods")["items"]
    assert [a for s in model_slices for e in s.get("endpoints") or [] for a in e["addresses"]] == \
        [pods[LEADER]["status"]["podIP"]]


def test_the_group_answers_through_the_gateway_with_one_processs_tokens(installed):
    gateway = wait_for(lambda: gateway_address(installed), 60, "a ready gateway pod")
    status, body = wait_for(lambda: (r := chat(gateway))[0] == 200 and r, 60, "an answer through the gateway",
                            interval=2)
    assert body["usage"]["completion_tokens"] == CHAT["max_tokens"]
    assert body["choices"][0]["message"]["content"] == one_process_answer()


REQUESTS = 6


def test_deleting_the_worker_recreates_the_group_and_no_request_before_its_first_byte_is_lost(installed):
    """RecreateGroupOnPodRestart: the worker pod deleted, LWS deletes the leader too and makes a
    new group. A request generating when the worker's ranks die fails on the old leader with a
    503 and the gateway sends it again; requests sent meanwhile wait in the gateway for the new
    group. None had its first byte, and every one is answered."""
    gateway = gateway_address(installed)
    pods = group_pods(installed)
    old = {n: p["metadata"]["uid"] for n, p in pods.items()}
    leader_ip = pods[LEADER]["status"]["podIP"]
    status, body = chat(gateway)
    assert status == 200
    want = body["choices"][0]["message"]["content"]
    retries = gateway_retries(gateway)
    waited: list[float] = []

    def ask(body: dict, delay: float) -> tuple[int, dict]:
        time.sleep(delay)
        sent = time.monotonic()
        code, reply = chat(gateway, body, timeout=450)
        waited.append(time.monotonic() - sent)
        return code, reply

    began = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(REQUESTS + 1) as pool:
        long = pool.submit(ask, LONG, 0)
        wait_for(lambda: sum(v for _, v in scrape(leader_ip)[NUM_REQUESTS_RUNNING]) >= 1, 30,
                 "the long request generating on the leader")
        # Grace 1 s: its preStop pause is cut short, its ranks die while the long one generates.
        installed.kubectl("delete", "pod", WORKER, "-n", NAMESPACE, "--grace-period=1", "--wait=false")
        # Spread over the worker's death and the group's restart.
        short = [pool.submit(ask, CHAT, i * 2.0) for i in range(REQUESTS)]
        code, reply = long.result()
        assert code == 200, reply
        assert reply["usage"]["completion_tokens"] == LONG["max_tokens"]
        assert reply["choices"][0]["finish_reason"] == "length"
        answers = [(code, reply["choices"][0]["message"]["content"] if code == 200 else reply)
                   for code, reply in (f.result() for f in short)]
    assert answers == [(200, want)] * REQUESTS, answers
    # The long one was sent again (the old leader's 503, or its connection gone).
    assert gateway_retries(gateway) > retries
    new = wait_for(lambda: (pods := group_pods(installed)) and sorted(pods) == [LEADER, WORKER]
                   and all(ready(p) for p in pods.values()) and pods, READY_TIMEOUT, "the new group ready")
    # A new group: both pods are new objects, not the old ones restarted.
    assert all(new[n]["metadata"]["uid"] != old[n] for n in (LEADER, WORKER)), (old, new)
    assert wait_for(lambda: service_ready(installed), 60, f"{NAME} Ready again")
    print(f"group recreated, {REQUESTS + 1} requests answered in {time.monotonic() - began:.0f} s "
          f"(each took {', '.join(f'{w:.0f}' for w in sorted(waited))} s)")
