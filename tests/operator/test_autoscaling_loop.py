"""The autoscaler's tick against the Kubernetes API emulator, with small aiohttp /metrics servers on
127.0.0.x standing in for pods (published as Pod objects with their ``podIP``): directly with a
synthetic clock, and as the real operator's kopf timer."""
from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from typing import Any, AsyncIterator

import aiohttp
import kopf
import pytest
from aiohttp import web

from kube_emulator import ApiServer
from operator_helpers import NAMESPACE, eventually, running_operator
from slipstream.operator.autoscaling_loop import Autoscaler, autoscaling_enabled
from slipstream.operator.foreign import ScalerObject, foreign_writer, replicas_writers, \
    scalers_of, targets
from slipstream.operator.gateway_resources import gateway_labels
from slipstream.operator.handlers import OperatorConfig, register
from slipstream.operator.kube import DEPLOYMENTS, FIELD_MANAGER, HORIZONTAL_POD_AUTOSCALERS, \
    INFERENCESERVICES, PODS, Kube
from slipstream.operator.reconcile import reconcile
from slipstream.operator.resources import labels
from slipstream.operator.scaling import status_write_due

pytestmark = pytest.mark.timeout(60)


class FakePod:
    """A pod's /metrics: the three gauges, or a failure (``mode`` ``error``: HTTP 500, ``hang``)."""

    def __init__(self, name: str, ip: str):
        self.name, self.ip = name, ip
        self.waiting, self.running, self.kv = 0.0, 0.0, 0.0
        self.mode = "ok"
        self.scrapes = 0
        self.extra = ""  # more exposition lines (counters, histograms)

    async def metrics(self, _: web.Request) -> web.Response:
        self.scrapes += 1
        if self.mode == "error":
            return web.Response(status=500)
        if self.mode == "hang":
            await asyncio.sleep(30)
        return web.Response(text=(
            f'slipstream:num_requests_waiting{{model_name="chat"}} {self.waiting}\n'
            f'slipstream:num_requests_running{{model_name="chat"}} {self.running}\n'
            f'slipstream:kv_cache_usage_perc{{model_name="chat"}} {self.kv}\n' + self.extra))


@pytest.fixture
async def pods() -> AsyncIterator[tuple[int, list[FakePod]]]:
    """Four fake pods on 127.0.0.2-5, all on one port (a pod spec has one port for all pods)."""
    for _ in range(20):
        with socket.socket() as probe:
            probe.bind(("127.0.0.2", 0))
            port = probe.getsockname()[1]
        fakes = [FakePod(f"chat-{i}", f"127.0.0.{i + 2}") for i in range(4)]
        runners = []
        try:
            for fake in fakes:
                app = web.Application()
                app.router.add_get("/metrics", fake.metrics)
                runner = web.AppRunner(app, shutdown_timeout=0.1)
                await runner.setup()
                runners.append(runner)
                await web.TCPSite(runner, fake.ip, port).start()
        except OSError:  # the port is taken on one of the addresses: try another
            for runner in runners:
                await runner.cleanup()
            continue
        try:
            yield port, fakes
        finally:
            for runner in runners:
                await runner.cleanup()
        return
    pytest.fail("no port free on 127.0.0.2-5")


def inference_service(port: int, **autoscaling: Any) -> dict[str, Any]:
    return {"apiVersion": "slipstream.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "chat", "namespace": NAMESPACE},
            "spec": {"model": {"source": "builtin"}, "port": port, "autoscaling": {
                "enabled": True, "policy": "queue", "minReplicas": 1, "maxReplicas": 4, "targetQueueDepth": 2,
                "stableWindowSeconds": 10, "panicWindowSeconds": 2, "scaleDownDelaySeconds": 4,
                **autoscaling}}}


async def publish(kube: Kube, fake: FakePod, ready: bool = True, owner: str = "chat") -> None:
    """A Pod object for ``fake`` as the kubelet would report it."""
    await kube.create(PODS, {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": fake.name, "namespace": NAMESPACE, "labels": labels(owner)},
        "spec": {"containers": [{"name": "server", "image": "slipstream"}]},
        "status": {"phase": "Running", "podIP": fake.ip, "conditions": [
            {"type": "Ready", "status": "True" if ready else "False"}]}})


async def status_of(kube: Kube) -> dict[str, Any]:
    return (await kube.get(INFERENCESERVICES, NAMESPACE, "chat")).get("status") or {}


def scaling_condition(status: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == "ScalingActive")


async def replicas(kube: Kube) -> int:
    return (await kube.get(DEPLOYMENTS, NAMESPACE, "chat"))["spec"]["replicas"]


@pytest.fixture
async def service(kube: Kube, pods) -> tuple[Kube, list[FakePod]]:
    """The InferenceService ``chat`` (autoscaling on) reconciled once: Deployment at 1 replica."""
    port, fakes = pods
    await kube.create(INFERENCESERVICES, inference_service(port))
    await reconcile(kube, NAMESPACE, "chat")
    return kube, fakes


@pytest.fixture
async def make_autoscaler() -> AsyncIterator[Any]:
    """Autoscaler(...) whose scrape sessions are closed after the test."""
    made: list[Autoscaler] = []

    def make(**kwargs: Any) -> Autoscaler:
        made.append(Autoscaler(**kwargs))
        return made[-1]

    yield make
    for autoscaler in made:
        await autoscaler.close()


class Clock:
    def __init__(self, now: float = 1_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


async def tick(autoscaler: Autoscaler, kube: Kube):
    body = await kube.get(INFERENCESERVICES, NAMESPACE, "chat")
    return await autoscaler.tick(kube, NAMESPACE, "chat", body)


# --- one tick at a time ---------------------------------------------------------------------------

async def test_a_long_queue_scales_up_and_the_status_records_the_tick(service, make_autoscaler):
    kube, fakes = service
    await publish(kube, fakes[0])
    fakes[0].waiting, fakes[0].running, fakes[0].kv = 9, 4, 0.5
    result = await tick(make_autoscaler(clock=Clock()), kube)

    assert result.decision.panicking and result.replicas == 4  # ceil(9 / 2) = 5 pods, max 4
    assert await replicas(kube) == 4
    status = await status_of(kube)
    assert (status["desiredReplicas"], status["queueDepth"], status["kvCacheUtilization"],
            status["kvCachePercent"], status["scrapeFailures"]) == (4, 9, 0.5, 50, 0)
    assert status["lastScaleTime"].endswith("Z")
    [entry] = status["scalingHistory"]
    assert (entry["fromReplicas"], entry["toReplicas"]) == (1, 4) and "panic" in entry["reason"]
    assert status["autoscaler"]["observations"] == [[1_000_000.0, 9.0, 0.5]]
    assert scaling_condition(status)["status"] == "True"
    assert scaling_condition(status)["reason"] == "MetricsAvailable"


async def test_pods_that_do_not_answer_are_counted_and_named(service, make_autoscaler):
    kube, fakes = service
    for fake in fakes[:3]:
        await publish(kube, fake)
    await kube.merge_patch(DEPLOYMENTS, NAMESPACE, "chat", {"spec": {"replicas": 3}})
    fakes[1].mode, fakes[2].mode = "error", "hang"
    autoscaler = make_autoscaler(clock=Clock(), scrape_timeout=0.5)
    result = await tick(autoscaler, kube)
    assert sorted(result.failures) == ["chat-1", "chat-2"]
    status = await status_of(kube)
    assert status["scrapeFailures"] == 2
    assert "2 of 3 ready pods did not answer" in scaling_condition(status)["message"]
    assert "chat-2: no answer within 0.5s" in scaling_condition(status)["message"]

    fakes[0].mode = "error"  # nobody answers: not active, and the count holds
    result = await tick(autoscaler, kube)
    status = await status_of(kube)
    assert (scaling_condition(status)["status"], scaling_condition(status)["reason"]) == \
        ("False", "MetricsUnavailable")
    assert status["scrapeFailures"] == 3 and await replicas(kube) == 3


async def test_starting_pods_are_not_scraped_and_other_services_pods_are_ignored(service, make_autoscaler):
    kube, fakes = service
    await publish(kube, fakes[0], ready=False)
    await publish(kube, fakes[1], owner="other")  # the emulator ignores label selectors
    fakes[1].waiting = 100
    result = await tick(make_autoscaler(clock=Clock()), kube)
    assert (result.ready, result.starting) == (0, 1)
    assert fakes[0].scrapes == 0 and fakes[1].scrapes == 0
    status = await status_of(kube)
    assert scaling_condition(status)["reason"] == "NoReadyPods" and await replicas(kube) == 1


async def test_without_pods_the_tick_writes_nothing(service, make_autoscaler):
    kube, _ = service
    before = await kube.get(INFERENCESERVICES, NAMESPACE, "chat")
    assert await tick(make_autoscaler(clock=Clock()), kube) is None
    assert (await kube.get(INFERENCESERVICES, NAMESPACE, "chat"))["metadata"]["resourceVersion"] == \
        before["metadata"]["resourceVersion"]


async def test_scale_down_waits_for_the_delay_and_survives_an_operator_restart(service, make_autoscaler):
    kube, fakes = service
    for fake in fakes[:3]:
        await publish(kube, fake)
    await kube.merge_patch(DEPLOYMENTS, NAMESPACE, "chat", {"spec": {"replicas": 3}})
    clock = Clock()
    # memory_seconds=0: the policy's memory is persisted every tick (by default every 30 s,
    # so a restart forgets at most that much).
    first = make_autoscaler(clock=clock, memory_seconds=0)
    for _ in range(2):  # idle pods, ticks at t and t+2: lower recommendations begin
        result = await tick(first, kube)
        assert result.decision.desired_replicas == 3 and "waits for 4s" in result.decision.reason
        clock.now += 2
    # A new operator process (no memory) continues from status.autoscaler: 4 s have passed.
    result = await tick(make_autoscaler(clock=clock), kube)
    assert result.replicas == 2  # 3 → 1 wanted, at most halved per tick
    assert await replicas(kube) == 2
    assert [e["toReplicas"] for e in (await status_of(kube))["scalingHistory"]] == [2]


async def test_the_timer_runs_only_for_objects_with_autoscaling_on():
    assert autoscaling_enabled({"autoscaling": {"enabled": True}})
    assert not autoscaling_enabled({"autoscaling": {"enabled": False}})
    assert not autoscaling_enabled({"replicas": 3})
    assert not autoscaling_enabled({"autoscaling": {"enabled": "true"}})


# --- the operator's timer ---------------------------------------------------------------------------

@pytest.fixture
async def fast_operator(api: ApiServer) -> AsyncIterator[None]:
    """The real operator with a 0.3-second autoscaler tick."""
    registry = kopf.OperatorRegistry()
    url = str(api.url)
    register(registry, OperatorConfig(
        resync_seconds=1.0, autoscale_seconds=0.3,
        login=lambda **_: kopf.ConnectionInfo(server=url, insecure=True), kube=lambda: Kube(url)))
    settings = kopf.OperatorSettings()
    settings.watching.server_timeout = 10
    settings.networking.request_timeout = 10
    async with running_operator(registry=registry, settings=settings, clusterwide=True, standalone=True):
        yield


def events(api: ApiServer, reason: str) -> list[dict[str, Any]]:
    return [obj.raw for (res, _, _), obj in api.objects.items()
            if res.plural == "events" and not obj.deleted and obj.raw.get("reason") == reason]


async def test_operator_scales_on_load_posts_an_event_and_lets_go_when_autoscaling_is_off(
        api, kube, pods, fast_operator):
    port, fakes = pods
    await kube.create(INFERENCESERVICES, inference_service(port))
    await eventually(lambda: kube.get(DEPLOYMENTS, NAMESPACE, "chat"), what="Deployment")
    await publish(kube, fakes[0])
    fakes[0].waiting = 7
    await eventually(lambda: _replicas_are(kube, 4), what="scale-up to 4")
    scaled = await eventually(lambda: events(api, "Scaled"), what="Scaled event")
    assert "replicas 1 → 4" in scaled[0]["message"] and "panic" in scaled[0]["message"]
    assert scaled[0]["involvedObject"]["name"] == "chat"

    # Autoscaling off: replicas follow spec.replicas (kubectl scale), whatever the queue.
    await kube.merge_patch(INFERENCESERVICES, NAMESPACE, "chat",
                           {"spec": {"replicas": 2, "autoscaling": {"enabled": False}}})
    await eventually(lambda: _replicas_are(kube, 2), what="spec.replicas")
    await eventually(lambda: _reason_is(kube, "AutoscalingDisabled"), what="ScalingActive AutoscalingDisabled")
    await asyncio.sleep(0.6)  # a tick already under way when the spec changed may still scrape once
    scrapes = fakes[0].scrapes
    await asyncio.sleep(1.5)  # five ticks' worth
    assert await replicas(kube) == 2 and fakes[0].scrapes == scrapes


async def _reason_is(kube: Kube, reason: str) -> bool:
    conditions = (await status_of(kube)).get("conditions") or []
    return any(c["type"] == "ScalingActive" and c.get("reason") == reason for c in conditions)


async def _replicas_are(kube: Kube, n: int) -> bool:
    with contextlib.suppress(TypeError):
        return await replicas(kube) == n
    return False


# --- status writes -----------------------------------------------------------------------------

@pytest.mark.slow
async def test_an_idle_service_writes_its_status_a_few_times_not_every_tick(api, service,
                                                                            make_autoscaler):
    """One idle service, 60 ticks (2 simulated minutes): the first tick's verdict, then the
    policy's memory every 30 s. (It was a write per tick: 63 in 141 s on a real cluster.)"""
    kube, fakes = service
    await publish(kube, fakes[0])
    clock = Clock()
    autoscaler = make_autoscaler(clock=clock)
    versions = []
    for _ in range(60):
        await tick(autoscaler, kube)
        versions.append((await kube.get(INFERENCESERVICES, NAMESPACE, "chat"))["metadata"][
            "resourceVersion"])
        clock.now += 2
    writes = len(set(versions))  # each status write is a new resourceVersion
    assert 1 + 3 <= writes <= 1 + 120 // 30
    memory = (await status_of(kube))["autoscaler"]
    assert memory["observations"][-1][0] >= clock.now - 2 - 30  # persisted within 30 s


async def test_load_changes_are_written_at_once_when_they_change_the_count(service,
                                                                           make_autoscaler):
    kube, fakes = service
    await publish(kube, fakes[0])
    clock = Clock()
    autoscaler = make_autoscaler(clock=clock)
    await tick(autoscaler, kube)
    clock.now += 2
    fakes[0].waiting = 9
    await tick(autoscaler, kube)  # 2 s after the last write: the new count goes out at once
    status = await status_of(kube)
    assert (status["desiredReplicas"], status["queueDepth"]) == (4, 9)


def test_status_write_due_tells_what_matters_now_from_what_can_wait():
    def fields(**over: Any) -> dict[str, Any]:
        cond = {"type": "ScalingActive", "status": "True", "reason": "MetricsAvailable",
                "message": over.pop("message", "holding 1")}
        return {"desiredReplicas": 1, "queueDepth": 0.0, "autoscaler": {"t": 1},
                "conditions": [cond], **over}

    live = fields()
    assert not status_write_due(live, fields(), 0.0)
    assert status_write_due(live, fields(desiredReplicas=2), 0.0)
    assert status_write_due(live, fields(conditions=[{"type": "ScalingActive",
                                                      "status": "False", "reason": "X"}]), 0.0)
    assert not status_write_due(live, fields(queueDepth=3.0), 9.0)
    assert status_write_due(live, fields(queueDepth=3.0), 10.0)
    assert not status_write_due(live, fields(message="holding 1: other numbers"), 9.0)
    assert not status_write_due(live, fields(autoscaler={"t": 2}), 29.0)
    assert status_write_due(live, fields(autoscaler={"t": 2}), 30.0)
    assert status_write_due(live, fields(autoscaler={"t": 2}), None)  # nothing written yet


# --- another scaler on the same Deployment ------------------------------------------------------

async def scale_as(api: ApiServer, manager: str, replicas: int) -> None:
    """What an HPA (or KEDA, or `kubectl scale deployment`) does: set the Deployment's
    replicas under its own field manager."""
    async with aiohttp.ClientSession() as session:
        async with session.patch(
                f"{api.url}{DEPLOYMENTS.path(NAMESPACE, 'chat')}",
                params={"fieldManager": manager}, json={"spec": {"replicas": replicas}},
                headers={"Content-Type": "application/merge-patch+json"}) as response:
            assert response.status == 200, await response.text()


def replicas_owner(deployment: dict[str, Any]) -> list[str]:
    return [w.manager for w in replicas_writers(deployment)]


def hpa(name: str = "chat-hpa", target: str = "chat") -> dict[str, Any]:
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": target},
                     "minReplicas": 1, "maxReplicas": 6,
                     "metrics": [{"type": "Resource", "resource": {
                         "name": "cpu", "target": {"type": "Utilization", "averageUtilization": 50}}}]}}


async def test_an_hpa_on_the_deployment_stops_replica_writes_until_it_is_deleted(
        api, service, make_autoscaler):
    kube, fakes = service
    await publish(kube, fakes[0])
    fakes[0].waiting = 20  # the policy wants maxReplicas (4) throughout
    clock = Clock(time.time())
    autoscaler = make_autoscaler(clock=clock)
    assert (await tick(autoscaler, kube)).replicas == 4
    await kube.create(HORIZONTAL_POD_AUTOSCALERS, hpa("other", target="not-chat"))  # not ours
    await kube.create(HORIZONTAL_POD_AUTOSCALERS, hpa())

    for count in (3, 2):  # the HPA writes, and writes again 15 s later
        await scale_as(api, "kube-controller-manager", count)
        for _ in range(4):
            clock.now += 2
            result = await tick(autoscaler, kube)
            assert result.foreign == ScalerObject("HorizontalPodAutoscaler", "chat-hpa")
            assert await replicas(kube) == count  # not written back
        clock.now += 1000  # no quiet timer: however long it holds still, the HPA is there
    cond = scaling_condition(await status_of(kube))
    assert (cond["status"], cond["reason"]) == ("False", "ForeignScaler")
    assert "HorizontalPodAutoscaler chat-hpa scales Deployment chat" in cond["message"]
    [warning] = events(api, "ForeignScaler")
    assert warning["type"] == "Warning" and "chat-hpa" in warning["message"]
    assert [e["message"][:14] for e in events(api, "Scaled")] == ["replicas 1 → 4"]

    # The reconcile loop does not pull the other scaler's count into [min, max] either.
    await scale_as(api, "kube-controller-manager", 6)
    await reconcile(kube, NAMESPACE, "chat")
    assert await replicas(kube) == 6

    await kube.delete(HORIZONTAL_POD_AUTOSCALERS, NAMESPACE, "chat-hpa")
    clock.now += 2
    result = await tick(autoscaler, kube)  # the first tick after the delete takes over
    assert result.foreign is None and result.replicas == 4
    assert scaling_condition(await status_of(kube))["reason"] == "MetricsAvailable"
    [resumed] = events(api, "ScalingResumed")
    assert resumed["type"] == "Normal" and "from 6" in resumed["message"]
    assert len(events(api, "ForeignScaler")) == 1 and not events(api, "ReplicasOverridden")


async def test_a_restarted_operator_keeps_standing_back(api, service, make_autoscaler):
    kube, fakes = service
    await publish(kube, fakes[0])
    clock = Clock(time.time())
    await tick(make_autoscaler(clock=clock), kube)
    await kube.create(HORIZONTAL_POD_AUTOSCALERS, hpa())
    await scale_as(api, "kube-controller-manager", 3)
    clock.now += 2
    await tick(make_autoscaler(clock=clock), kube)  # a new process, from the status alone
    clock.now += 2
    result = await tick(make_autoscaler(clock=clock), kube)  # and another
    assert result.foreign.name == "chat-hpa" and await replicas(kube) == 3
    assert len(events(api, "ForeignScaler")) == 1
    await kube.delete(HORIZONTAL_POD_AUTOSCALERS, NAMESPACE, "chat-hpa")
    clock.now += 2
    assert (await tick(make_autoscaler(clock=clock), kube)).foreign is None
    assert len(events(api, "ScalingResumed")) == 1


async def test_kubectl_scale_of_the_deployment_is_warned_about_once_and_set_back(
        api, service, make_autoscaler):
    kube, fakes = service
    await publish(kube, fakes[0])
    fakes[0].waiting = 20  # the policy wants maxReplicas (4)
    clock = Clock(time.time())
    autoscaler = make_autoscaler(clock=clock)
    assert (await tick(autoscaler, kube)).replicas == 4
    await scale_as(api, "kubectl", 2)
    for _ in range(3):
        clock.now += 2
        result = await tick(autoscaler, kube)
        assert result.foreign is None and result.replicas == 4  # set back on the same tick
    [warning] = events(api, "ReplicasOverridden")
    assert warning["type"] == "Warning"
    assert warning["message"].startswith("kubectl set spec.replicas of Deployment chat to 2; "
                                         "the autoscaler keeps control")
    cond = scaling_condition(await status_of(kube))
    assert cond["status"] == "True" and "kubectl set spec.replicas" in cond["message"]


def test_scalers_of_finds_hpas_and_scaled_objects_that_target_the_workload():
    keda = {"metadata": {"name": "so"}, "spec": {"scaleTargetRef": {"name": "chat"}}}  # KEDA's defaults
    gone = {**hpa("old"), "metadata": {"name": "old", "deletionTimestamp": "2026-12-01T00:00:00Z"}}
    found = scalers_of([hpa("x", "other"), hpa(), gone], [keda], "Deployment", "apps/v1", "chat")
    assert found == [ScalerObject("HorizontalPodAutoscaler", "chat-hpa"), ScalerObject("ScaledObject", "so")]
    lws = {"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet", "name": "chat"}
    assert targets(lws, "LeaderWorkerSet", "leaderworkerset.x-k8s.io/v1", "chat")
    assert not targets(lws, "Deployment", "apps/v1", "chat")
    assert not targets({"kind": "StatefulSet", "name": "chat"}, "Deployment", "apps/v1", "chat")
    assert not targets(None, "Deployment", "apps/v1", "chat")


def test_foreign_writer_needs_another_manager_and_a_count_the_operator_did_not_set():
    def deployment(replicas: int, *owners: tuple[str, str | None]) -> dict[str, Any]:
        return {"spec": {"replicas": replicas}, "metadata": {"managedFields": [
            {"manager": m, "operation": "Update", "time": "2026-12-01T00:00:00Z",
             "fieldsV1": {"f:spec": {"f:replicas": {}}}, **({"subresource": sub} if sub else {})}
            for m, sub in owners]}}

    assert foreign_writer(deployment(3, (FIELD_MANAGER, None)), 3) is None
    assert foreign_writer(deployment(3, (FIELD_MANAGER, None)), 2) is None  # ours: the reconcile
    scaled = foreign_writer(deployment(5, ("kubectl", "scale")), 3)
    assert scaled.describe() == "kubectl through the scale subresource"
    assert foreign_writer(deployment(3, ("Python", None)), 3) is None  # same count: no fight
    assert foreign_writer(deployment(5, ("kubectl", None)), None) is None  # nothing known yet
    assert foreign_writer({"spec": {"replicas": 5}, "metadata": {}}, 3).manager == \
        "an unknown writer"


# --- scale to zero and from zero ----------------------------------------------------------------

class FakeGateway:
    """A gateway pod's /metrics: requests it holds and requests it has on each pod."""

    def __init__(self) -> None:
        self.waiting = 0
        self.in_flight: dict[str, int] = {}

    async def metrics(self, _: web.Request) -> web.Response:
        lines = [f"slipstream:gateway_requests_waiting {self.waiting}",
                 "# TYPE slipstream:gateway_endpoint_in_flight gauge"]
        lines += [f'slipstream:gateway_endpoint_in_flight{{endpoint="{e}"}} {n}'
                  for e, n in self.in_flight.items()]
        return web.Response(text="\n".join(lines) + "\n")


@pytest.fixture
async def gateway() -> AsyncIterator[tuple[int, FakeGateway]]:
    """A fake gateway pod on 127.0.0.6 (its port: the autoscaler's ``gateway_port``)."""
    fake = FakeGateway()
    app = web.Application()
    app.router.add_get("/metrics", fake.metrics)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.6", 0)
    await site.start()
    try:
        yield runner.addresses[0][1], fake
    finally:
        await runner.cleanup()


async def publish_gateway(kube: Kube, name: str = "chat-gateway-0", ip: str = "127.0.0.6") -> None:
    await kube.create(PODS, {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": gateway_labels("chat")},
        "spec": {"containers": [{"name": "gateway", "image": "slipstream"}]},
        "status": {"phase": "Running", "podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}})


async def test_from_zero_on_the_gateways_demand_and_back_to_zero_after_the_idle_delay(
        kube, pods, gateway, make_autoscaler):
    port, fakes = pods
    gateway_port, fake_gateway = gateway
    await kube.create(INFERENCESERVICES, inference_service(port, minReplicas=0, scaleToZeroAfterSeconds=10))
    await reconcile(kube, NAMESPACE, "chat")
    assert await replicas(kube) == 0  # created at minReplicas
    await publish_gateway(kube)
    clock = Clock()
    autoscaler = make_autoscaler(clock=clock, gateway_port=gateway_port)

    result = await tick(autoscaler, kube)  # nothing waits: the count holds at zero
    assert result.decision.desired_replicas == 0 and result.gateway.waiting == 0
    status = await status_of(kube)
    assert status["desiredReplicas"] == 0
    assert scaling_condition(status)["reason"] == "ScaledToZero"
    assert "scaled to zero after 10s idle" in scaling_condition(status)["message"]

    fake_gateway.waiting = 2  # the first requests arrive (one pod's worth): one pod at the next tick
    clock.now += 2
    result = await tick(autoscaler, kube)
    assert result.replicas == 1 and await replicas(kube) == 1
    status = await status_of(kube)
    assert status["desiredReplicas"] == 1 and status["queueDepth"] == 2
    assert scaling_condition(status)["reason"] == "MetricsAvailable"
    assert scaling_condition(status)["message"].startswith(
        "scaling from zero: 2 requests waiting in the gateway; 0 -> 1")

    await publish(kube, fakes[0])  # the pod is ready and takes the requests
    fake_gateway.waiting, fakes[0].running = 0, 3
    fake_gateway.in_flight = {f"http://{fakes[0].ip}:{port}": 3}
    clock.now += 2
    await tick(autoscaler, kube)
    last_request = clock.now
    fakes[0].running, fake_gateway.in_flight = 0, {f"http://{fakes[0].ip}:{port}": 0}
    while clock.now < last_request + 8:
        clock.now += 2
        assert (await tick(autoscaler, kube)).decision.desired_replicas == 1
    clock.now += 2  # 10 s without a request
    result = await tick(autoscaler, kube)
    assert result.replicas == 0 and await replicas(kube) == 0
    status = await status_of(kube)
    assert status["desiredReplicas"] == 0
    assert (scaling_condition(status)["reason"], scaling_condition(status)["message"]) == (
        "ScaledToZero", "scaled to zero after 10s idle (no request ran or waited in the pods or the "
                        "gateway); 1 -> 0")
    assert [(e["fromReplicas"], e["toReplicas"]) for e in status["scalingHistory"]] == [(0, 1), (1, 0)]


async def test_at_zero_a_silent_gateway_is_named_and_the_count_holds(kube, pods, make_autoscaler):
    port, _ = pods
    await kube.create(INFERENCESERVICES, inference_service(port, minReplicas=0))
    await reconcile(kube, NAMESPACE, "chat")
    await publish_gateway(kube, ip="127.0.0.7")  # nothing listens there
    with socket.socket() as probe:
        probe.bind(("127.0.0.7", 0))
        closed = probe.getsockname()[1]
    result = await tick(make_autoscaler(clock=Clock(), gateway_port=closed), kube)
    assert result.decision.desired_replicas == 0 and result.gateway is None
    condition = scaling_condition(await status_of(kube))
    assert (condition["status"], condition["reason"]) == ("False", "GatewayUnavailable")
    assert "chat-gateway-0" in condition["message"]


async def test_min_replicas_zero_without_the_gateway_keeps_one_replica_and_says_why(
        kube, pods, make_autoscaler):
    port, fakes = pods
    body = inference_service(port, minReplicas=0, scaleToZeroAfterSeconds=0)
    body["spec"]["routing"] = {"enabled": False}
    await kube.create(INFERENCESERVICES, body)
    await reconcile(kube, NAMESPACE, "chat")
    clock = Clock()
    autoscaler = make_autoscaler(clock=clock)
    result = await tick(autoscaler, kube)  # no pod yet at 0 replicas: one comes
    assert result.replicas == 1
    await publish(kube, fakes[0])
    for _ in range(5):
        clock.now += 2
        assert (await tick(autoscaler, kube)).replicas == 1
    assert "minReplicas 0 needs spec.routing.enabled" in scaling_condition(await status_of(kube))["message"]


# --- the capacity policy (the default) in the loop ---------------------------------------------

def counters(finished: float, prompt_tokens: float, fast: float, slow: float) -> str:
    """A pod's request and token counters and a TTFT histogram (``fast`` within 1 s)."""
    m = 'model_name="chat"'
    return (f'slipstream:request_success_total{{{m},finished_reason="length"}} {finished}\n'
            f"slipstream:prompt_tokens_total{{{m}}} {prompt_tokens}\n"
            f"slipstream:generation_tokens_total{{{m}}} 0\n"
            f'slipstream:time_to_first_token_seconds_bucket{{{m},le="1.0"}} {fast}\n'
            f'slipstream:time_to_first_token_seconds_bucket{{{m},le="+Inf"}} {fast + slow}\n'
            f"slipstream:time_to_first_token_seconds_count{{{m}}} {fast + slow}\n"
            f"slipstream:time_to_first_token_seconds_sum{{{m}}} 0\n")


async def test_the_default_policy_sizes_from_the_pods_counters_and_reports_its_numbers(kube, pods,
                                                                                     make_autoscaler):
    port, fakes = pods
    body = inference_service(port, objectives={"ttftP90Seconds": 1})
    for key in ("policy", "stableWindowSeconds", "panicWindowSeconds", "scaleDownDelaySeconds"):
        del body["spec"]["autoscaling"][key]  # the default policy, capacity, with its own windows
    await kube.create(INFERENCESERVICES, body)
    await reconcile(kube, NAMESPACE, "chat")
    await publish(kube, fakes[0])
    fakes[0].extra = counters(0, 0, 0, 0)
    clock = Clock()
    autoscaler = make_autoscaler(clock=clock)
    first = await tick(autoscaler, kube)
    assert first.decision.details["policy"] == "capacity" and first.replicas == 1
    # 20 s later: 400 requests of 1,000 prompt tokens finished, 360 within the objective:
    # 20 req/s x 1,000 tokens, a minute's worth done within 61 s (the 1 s objective): x 60 / 61,
    # x 1.3 headroom / 8,000 tokens/s per pod (the default prior) -> 4
    clock.now += 20
    fakes[0].extra = counters(400, 400_000, 360, 40)
    result = await tick(autoscaler, kube)
    assert result.replicas == 4 and await replicas(kube) == 4
    status = await status_of(kube)
    assert status["lastDecision"]["demandRequestsPerSecond"] == 20.0
    assert status["lastDecision"]["capacityTokensPerSecond"] == 8000.0
    assert status["lastDecision"]["desiredReplicas"] == 4
    assert status["objectiveAttainment"] == 0.9
    assert status["autoscaler"]["policy"] == "capacity"


def test_a_sim_model_gets_its_cost_models_prior_divided_by_its_time_scale():
    from slipstream.operator.autoscaling_loop import spec_prior
    from slipstream.operator.capacity_policy import CapacityPrior
    from slipstream.operator.spec import parse_spec
    from slipstream.server.sim.cost_model import PROFILES
    from slipstream.server.sim.scalers import profile_prior

    engine = {"maxNumSeqs": 4, "maxNumBatchedTokens": 512}
    slow = spec_prior(parse_spec({"model": {"source": "sim", "profile": "tiny,time_scale=6"},
                                  "engine": engine}, name="x"))
    raw = profile_prior(PROFILES["tiny"], 4, 512)
    assert slow.tokens_per_second == pytest.approx(raw.tokens_per_second / 6)
    assert slow.drain_rate == pytest.approx(raw.drain_rate / 6)
    assert slow.generation_weight == raw.generation_weight
    assert spec_prior(parse_spec({"model": {"source": "builtin"}}, name="x")) == CapacityPrior()
