"""The closed autoscaling loop on the real control plane, and what running it for real showed.

The operator runs in-cluster (helm install); its InferenceService's pods are real `slipstream
serve --model sim:tiny` processes started by the process kubelet, created by the real Deployment
and ReplicaSet controllers, listed in EndpointSlices by the real EndpointSlice controller; the
load generator picks pod addresses from those EndpointSlices (there is no kube-proxy), as a
gateway does. Then: another scaler writing the Deployment's replicas is detected and left alone;
an idle service costs almost no status writes; the operator pod killed mid-run and the API
server restarted lose nothing; `helm upgrade` restarts no model pod.

One replica: 4 seats, ~81 ms steps (``time_scale=6``), 10 output tokens → ~5 requests/s.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import aiohttp
import pytest
import yaml

from cluster_helpers import (CHART, OPERATOR_NAMESPACE, RELEASE, condition, forbidden_calls,
                             get, wait_for)

pytestmark = pytest.mark.timeout(900)

NAMESPACE = "loop"
NAME = "chat"
OUTPUT_TOKENS = 10
SCALING = {"enabled": True, "minReplicas": 1, "maxReplicas": 3, "targetQueueDepth": 3,
           "targetKVCacheUtilization": 0.58, "stableWindowSeconds": 10, "panicWindowSeconds": 4,
           "scaleDownDelaySeconds": 20}
TICK = 2.0  # the operator's autoscaler tick
# (requests/s, seconds)
BASELINE, OVERLOAD, AFTER = (1.0, 8.0), (10.0, 45.0), (1.0, 50.0)


def service(name: str = NAME, autoscaling: dict | None = None, replicas: int = 1) -> dict:
    return {
        "apiVersion": "slipstream.dev/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "model": {"source": "sim", "profile": "tiny,time_scale=6"},
            "replicas": replicas,
            "autoscaling": autoscaling or {"enabled": False},
            # 12 blocks of 16 tokens at 8 KiB a token: a request holds 2 blocks.
            "engine": {"maxNumSeqs": 4, "maxNumBatchedTokens": 512, "kvCacheMemory": 12 * 16 * 8192,
                       "blockSize": 16},
            "resources": {"cpu": "250m", "memory": "1Gi"},
            "startupTimeoutSeconds": 120, "shutdownTimeoutSeconds": 30,
        },
    }


@pytest.fixture(scope="module")
def operator(cluster):
    """The chart installed, the namespace made; uninstalled afterwards."""
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CHART / "crds"))
    cluster.helm("upgrade", "--install", RELEASE, str(CHART), "-n", OPERATOR_NAMESPACE,
                 "--create-namespace", "--wait", "--timeout", "5m")
    cluster.kubectl("create", "namespace", NAMESPACE, check=False)
    yield cluster
    cluster.kubectl("delete", "infsvc", "--all", "-n", NAMESPACE, "--wait=true", "--timeout=120s",
                    check=False)
    cluster.helm("uninstall", RELEASE, "-n", OPERATOR_NAMESPACE, "--wait", check=False)


def apply(cluster, obj: dict) -> None:
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(obj))


def ready_endpoints(api, name: str) -> list[str]:
    """Ready, not terminating addresses of the Service's EndpointSlices."""
    from kubernetes import client
    slices = client.DiscoveryV1Api(api).list_namespaced_endpoint_slice(
        NAMESPACE, label_selector=f"kubernetes.io/service-name={name}")
    return sorted(a for s in slices.items for e in s.endpoints or []
                  if e.conditions and e.conditions.ready and not e.conditions.terminating
                  for a in e.addresses)


def deployment_replicas(cluster, name: str = NAME) -> int:
    """The Deployment's spec.replicas (0 before the operator created it)."""
    dep = get(cluster, "deploy", name, "-n", NAMESPACE)
    return dep["spec"]["replicas"] if dep else 0


@dataclass
class Result:
    sent: float
    phase: str
    ttft: float | None = None
    tokens: int = 0
    finish: str | None = None
    error: str | None = None
    address: str = ""


@dataclass
class LoadGenerator:
    """Seeded Poisson arrivals; each request streams a completion from the least-busy address
    the EndpointSlices list as ready."""
    api: object
    name: str = NAME
    seed: int = 6
    results: list[Result] = field(default_factory=list)
    endpoints: list[str] = field(default_factory=list)
    outstanding: dict[str, int] = field(default_factory=dict)
    replicas_seen: list[tuple[float, int]] = field(default_factory=list)

    async def watch(self, cluster) -> None:
        while True:
            self.endpoints = await asyncio.to_thread(ready_endpoints, self.api, self.name)
            replicas = await asyncio.to_thread(deployment_replicas, cluster, self.name)
            if replicas and (not self.replicas_seen or self.replicas_seen[-1][1] != replicas):
                self.replicas_seen.append((time.monotonic(), replicas))
            await asyncio.sleep(0.5)

    async def _one(self, session: aiohttp.ClientSession, result: Result, prompt: list[int]) -> None:
        while not self.endpoints:
            await asyncio.sleep(0.05)
        ip = min(self.endpoints, key=lambda a: self.outstanding.get(a, 0))
        result.address = ip
        self.outstanding[ip] = self.outstanding.get(ip, 0) + 1
        start = time.monotonic()
        try:
            async with session.post(f"http://{ip}:8000/v1/completions", json={
                    "model": self.name, "prompt": prompt, "max_tokens": OUTPUT_TOKENS,
                    "temperature": 0, "stream": True}) as response:
                if response.status != 200:
                    result.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                    return
                async for line in response.content:
                    if not line.startswith(b"data: {"):
                        continue
                    choice = json.loads(line[6:])["choices"][0]
                    if choice.get("text") and result.ttft is None:
                        result.ttft = time.monotonic() - start
                    result.tokens += 1 if choice.get("text") else 0
                    result.finish = choice.get("finish_reason") or result.finish
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            result.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.outstanding[ip] -= 1

    async def play(self, phases: list[tuple[str, float, float]]) -> dict[str, tuple[float, float]]:
        rng = random.Random(self.seed)
        spans, tasks = {}, []
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=120)) as session:
            for phase, rate, seconds in phases:
                start = at = time.monotonic()
                while True:
                    at += rng.expovariate(rate)
                    if at >= start + seconds:
                        break
                    await asyncio.sleep(max(0.0, at - time.monotonic()))
                    result = Result(time.monotonic(), phase)
                    self.results.append(result)
                    prompt = [rng.randrange(300, 900) for _ in range(20)]
                    tasks.append(asyncio.create_task(self._one(session, result, prompt)))
                await asyncio.sleep(max(0.0, start + seconds - time.monotonic()))
                spans[phase] = (start, start + seconds)
            await asyncio.gather(*tasks)
        return spans

    def failed(self) -> list[Result]:
        return [r for r in self.results
                if r.error or r.tokens != OUTPUT_TOKENS or r.finish != "length"]


def operator_user(cluster) -> str:
    dep = get(cluster, "deploy", "-n", OPERATOR_NAMESPACE, "-l",
              f"app.kubernetes.io/instance={RELEASE}")["items"][0]
    return f"system:serviceaccount:{OPERATOR_NAMESPACE}:" \
           f"{dep['spec']['template']['spec']['serviceAccountName']}"


async def test_closed_loop_scales_up_in_the_panic_window_and_down_after_the_delay_losing_nothing(operator):
    cluster = operator
    apply(cluster, service(autoscaling=SCALING))
    api = cluster.api_client()
    load = LoadGenerator(api)
    watcher = asyncio.create_task(load.watch(cluster))
    try:
        deadline = time.monotonic() + 180
        while not load.endpoints:
            assert time.monotonic() < deadline, "the first pod never became ready"
            assert not watcher.done(), f"the endpoint watch stopped: {watcher.exception()!r}"
            await asyncio.sleep(0.5)
        spans = await load.play([("baseline", *BASELINE), ("overload", *OVERLOAD),
                                 ("after", *AFTER)])
        # Wait out the scale-down (it may still be in its delay).
        deadline = time.monotonic() + 60
        while load.replicas_seen[-1][1] != SCALING["minReplicas"] and time.monotonic() < deadline:
            await asyncio.sleep(1)
    finally:
        watcher.cancel()
    zero = spans["baseline"][0]
    seen = [(round(t - zero, 1), n) for t, n in load.replicas_seen]
    report = f"replicas {seen}; phases {[(k, round(a - zero, 1)) for k, (a, _) in spans.items()]}"
    print(f"{len(load.results)} requests; {report}")

    failed = load.failed()
    assert not failed, f"{len(failed)} requests failed, e.g. {failed[:3]}; {report}"
    t0_over, _ = spans["overload"]
    t0_after, _ = spans["after"]
    ups = [t for t, n in load.replicas_seen if n > 1]
    assert ups, report
    # Within the panic window of the overload's start, plus two ticks and a scrape.
    assert t0_over < ups[0] <= t0_over + SCALING["panicWindowSeconds"] + 3 * TICK, report
    assert max(n for _, n in load.replicas_seen) == SCALING["maxReplicas"], report
    downs = [t for (t, n), (_, prev) in zip(load.replicas_seen[1:], load.replicas_seen) if n < prev]
    assert downs and downs[0] >= t0_after + SCALING["scaleDownDelaySeconds"], report
    assert load.replicas_seen[-1][1] == SCALING["minReplicas"], report
    # Pods that left while requests were in flight drained them: requests that went to a pod
    # now gone all finished (counted in `failed` above), and there were such requests.
    live = set(ready_endpoints(api, NAME))
    assert any(r.address not in live for r in load.results), "no request went to a pod that left"
    assert forbidden_calls(cluster, operator_user(cluster)) == []


def test_another_scaler_writing_replicas_is_detected_and_left_alone(operator):
    cluster = operator
    apply(cluster, service(name="fought", autoscaling={**SCALING, "maxReplicas": 2}))
    wait_for(lambda: get(cluster, "deploy", "fought", "-n", NAMESPACE), 60, "the Deployment")
    # An HPA, KEDA or GitOps tool writes the same field under its own field manager.
    for _ in range(3):
        cluster.kubectl("scale", "deploy", "fought", "-n", NAMESPACE, "--replicas", "2")
        time.sleep(2 * TICK)
    cond = wait_for(lambda: (c := condition(get(cluster, "infsvc", "fought", "-n", NAMESPACE),
                                            "ScalingActive")) and c["status"] == "False" and c,
                    30, "ScalingActive=False")
    assert cond["reason"] == "ForeignScaler", cond
    time.sleep(4 * TICK)
    assert deployment_replicas(cluster, "fought") == 2  # left as the other scaler set it
    events = get(cluster, "events", "-n", NAMESPACE, "--field-selector",
                 "involvedObject.name=fought,reason=ForeignScaler")["items"]
    assert len(events) == 1 and events[0]["type"] == "Warning", events
    assert events[0].get("count", 1) == 1 and (events[0].get("series") or {}).get("count", 1) == 1


def status_writes(cluster, user: str, name: str) -> int:
    n = 0
    for line in cluster.plane.audit_log.read_text(errors="replace").splitlines():
        try:
            e = json.loads(line)
        except ValueError:
            continue
        ref = e.get("objectRef") or {}
        if (e.get("user", {}).get("username") == user and e.get("verb") in ("patch", "update")
                and ref.get("resource") == "inferenceservices" and ref.get("name") == name
                and ref.get("subresource") == "status" and e.get("stage") == "ResponseComplete"):
            n += 1
    return n


def test_an_idle_autoscaled_service_costs_almost_no_status_writes(operator):
    cluster = operator
    apply(cluster, service(name="idle", autoscaling=SCALING))
    wait_for(lambda: (c := condition(get(cluster, "infsvc", "idle", "-n", NAMESPACE), "Ready"))
             and c["status"] == "True", 180, "the idle service Ready")
    time.sleep(5)
    user = operator_user(cluster)
    before = status_writes(cluster, user, "idle")
    time.sleep(40)  # 20 autoscaler ticks
    writes = status_writes(cluster, user, "idle") - before
    assert writes <= 2, f"{writes} status writes in 40 s of an idle service"


def test_the_operator_killed_mid_run_comes_back_without_duplicates_or_a_rash_scale_down(operator):
    cluster = operator
    apply(cluster, service(name="steady", autoscaling={**SCALING, "minReplicas": 1}))
    wait_for(lambda: deployment_replicas(cluster, "steady") >= 1, 60, "the Deployment")
    cluster.kubectl("scale", "infsvc", "steady", "-n", NAMESPACE, "--replicas", "2", check=False)
    pods = get(cluster, "pods", "-n", OPERATOR_NAMESPACE)["items"]
    old = pods[0]["metadata"]["name"]
    replicas = deployment_replicas(cluster, "steady")
    cluster.kubectl("delete", "pod", old, "-n", OPERATOR_NAMESPACE, "--grace-period=0", "--force")
    wait_for(lambda: [p for p in get(cluster, "pods", "-n", OPERATOR_NAMESPACE)["items"]
                      if p["metadata"]["name"] != old
                      and (condition(p, "Ready") or {}).get("status") == "True"],
             120, "a new operator pod Ready")
    time.sleep(3 * TICK)
    assert deployment_replicas(cluster, "steady") >= min(replicas, SCALING["minReplicas"])
    sel = "slipstream.dev/inferenceservice=steady"
    assert len(get(cluster, "deploy", "-n", NAMESPACE, "-l", sel)["items"]) == 1
    assert len(get(cluster, "svc", "-n", NAMESPACE, "-l", sel)["items"]) == 1


def test_after_an_api_server_restart_the_operator_acts_again_within_a_bounded_time(operator):
    cluster = operator
    apply(cluster, service(name="restart"))
    wait_for(lambda: get(cluster, "deploy", "restart", "-n", NAMESPACE), 60, "the Deployment")
    cluster.plane.restart_apiserver(down_seconds=5)
    started = time.monotonic()
    cluster.kubectl("scale", "infsvc", "restart", "-n", NAMESPACE, "--replicas", "2")
    wait_for(lambda: deployment_replicas(cluster, "restart") == 2, 90,
             "the operator to apply a change made after the restart")
    print(f"operator acted {time.monotonic() - started:.1f} s after the API server came back")
    assert get(cluster, "infsvc", "restart", "-n", NAMESPACE) is not None


def test_helm_upgrade_with_services_serving_restarts_no_model_pod(operator):
    cluster = operator
    # The fixed-size service of the test before: autoscaled ones may change on their own.
    selector = "slipstream.dev/inferenceservice=restart"
    wait_for(lambda: len([p for p in get(cluster, "pods", "-n", NAMESPACE, "-l", selector)["items"]
                          if (condition(p, "Ready") or {}).get("status") == "True"]) == 2,
             120, "two ready pods")
    pods_before = {p["metadata"]["uid"]: p["status"]["containerStatuses"][0]["restartCount"]
                   for p in get(cluster, "pods", "-n", NAMESPACE, "-l", selector)["items"]
                   if not p["metadata"].get("deletionTimestamp")}
    assert len(pods_before) == 2
    # README's procedure: the CRDs first, then the chart.
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CHART / "crds"))
    cluster.helm("upgrade", RELEASE, str(CHART), "-n", OPERATOR_NAMESPACE, "--reuse-values",
                 "--set", "operator.resyncSeconds=30", "--wait", "--timeout", "5m")
    time.sleep(4 * TICK)
    pods_after = {p["metadata"]["uid"]: p["status"]["containerStatuses"][0]["restartCount"]
                  for p in get(cluster, "pods", "-n", NAMESPACE, "-l", selector)["items"]
                  if not p["metadata"].get("deletionTimestamp")}
    assert pods_after == pods_before
