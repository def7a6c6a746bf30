"""Scale from zero, closed loop, no cluster: a service at zero replicas gets 50 requests; the
gateway holds them, the real operator reads them waiting in the gateway's ``/metrics`` and scales
to one pod; all 50 are answered once that pod is ready; after ``scaleToZeroAfterSeconds``
without a request the operator scales back to zero.

Stand-ins (emulated_pods.py): the operator tests' Kubernetes API
emulator (kmock); a pod controller that starts or stops ``slipstream serve --model sim:tiny`` processes on 127.0.0.2, …
to match the Deployment's ``spec.replicas``, publishing a Pod object (Ready once ``/ready``
answers) for each. In front, the real gateway (``slipstream gateway``'s app) runs in this process
on 127.0.0.30:8000 (the port the operator reads gateway pods on), published as a Ready gateway
Pod; the pod controller gives it the ready pods as its endpoints, as its EndpointSlice watch would
(a Pod being deleted leaves them at once, as a terminating endpoint does).
"""
from __future__ import annotations

import asyncio
import pathlib
import tempfile
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from emulated_pods import NAMESPACE, PodController, emulated_api, operator_on
from loadgen import free_port
from slipstream.operator.gateway_resources import GATEWAY_PORT, gateway_labels
from slipstream.operator.kube import INFERENCESERVICES, PODS, Kube
from slipstream.server.gateway.app import GATEWAY, build_app
from slipstream.server.gateway.config import GatewayConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120),
              # kmock 0.8 loads its bundled resource list with a deprecated importlib call.
              pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning")]

NAME = "chat"
ADDRESSES = [f"127.0.0.{i}" for i in range(2, 8)]
GATEWAY_IP = "127.0.0.30"
REQUESTS = 50
OUTPUT_TOKENS = 8
IDLE = 5  # scaleToZeroAfterSeconds
SCALING = {"enabled": True, "minReplicas": 0, "maxReplicas": 1, "targetQueueDepth": 5,
           "stableWindowSeconds": 10, "panicWindowSeconds": 2, "scaleDownDelaySeconds": 5,
           "scaleToZeroAfterSeconds": IDLE}
TICK = 1.0
PRESTOP = 1.0  # seconds between a Pod's deletion and SIGTERM (a preStop sleep)


@dataclass
class Loop:
    kube: Kube
    controller: PodController
    background: list[asyncio.Task]

    def check_stand_ins(self) -> None:
        for task in self.background:
            if task.done():
                raise AssertionError("a stand-in stopped") from task.exception()


@pytest.fixture
async def loop() -> AsyncIterator[Loop]:
    """The emulator, the real operator (1-second autoscaler tick), the gateway on
    127.0.0.30:8000 published as a Ready gateway Pod, and the pod controller."""
    port = free_port(ADDRESSES)
    app = build_app(GatewayConfig(policy="least-loaded", queue_timeout=90.0, scrape_interval=0.2))
    runner = web.AppRunner(app, shutdown_timeout=1.0)
    await runner.setup()
    try:
        await web.TCPSite(runner, GATEWAY_IP, GATEWAY_PORT).start()
    except OSError as exc:
        await runner.cleanup()
        pytest.skip(f"the gateway cannot listen on {GATEWAY_IP}:{GATEWAY_PORT}: {exc}")
    async with emulated_api() as (url, kube):
        await kube.create(PODS, {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"{NAME}-gateway-0", "namespace": NAMESPACE, "labels": gateway_labels(NAME)},
            "spec": {"containers": [{"name": "gateway", "image": "slipstream"}]},
            "status": {"phase": "Running", "podIP": GATEWAY_IP,
                       "conditions": [{"type": "Ready", "status": "True"}]}})
        logs = pathlib.Path(tempfile.mkdtemp(prefix="scale-from-zero-"))
        # The gateway's endpoints: the ready pods not being deleted (its EndpointSlice watch's view).
        controller = PodController(
            kube, NAME, port, logs, ADDRESSES, prestop=PRESTOP, poll=0.3,
            on_endpoints=app[GATEWAY].endpoints.set_endpoints,
            serve_args=["--model", "sim:tiny", "--max-num-seqs", "16", "--shutdown-timeout", "30",
                        "--log-interval", "0"])
        loop = Loop(kube, controller, [asyncio.create_task(controller.run())])
        try:
            async with operator_on(url, TICK):
                yield loop
        finally:
            for task in loop.background:
                task.cancel()
            await controller.shutdown()
            await runner.cleanup()


async def scaling_condition(kube: Kube) -> dict[str, Any]:
    status = ((await kube.get(INFERENCESERVICES, NAMESPACE, NAME)) or {}).get("status") or {}
    return next((c for c in status.get("conditions") or () if c["type"] == "ScalingActive"), {})


async def wait_for(what: str, check, timeout: float, loop: Loop, report) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        loop.check_stand_ins()
        result = await check()
        if result:
            return result
        assert time.monotonic() < deadline, f"timed out after {timeout:g}s waiting for {what}\n{report()}"
        await asyncio.sleep(0.2)


async def complete(session: aiohttp.ClientSession, i: int) -> tuple[int, str, float]:
    """(HTTP status, finish reason or error text, monotonic time the answer ended)."""
    async with session.post(f"http://{GATEWAY_IP}:{GATEWAY_PORT}/v1/completions", json={
            "model": NAME, "prompt": [1 + i % 50] * 12, "max_tokens": OUTPUT_TOKENS, "temperature": 0}) as response:
        body = await response.json(content_type=None)
        done = time.monotonic()
        if response.status != 200:
            return response.status, str(body)[:200], done
        return 200, body["choices"][0]["finish_reason"], done


async def test_fifty_requests_at_zero_replicas_all_succeed_and_the_service_returns_to_zero(loop: Loop):
    kube, controller = loop.kube, loop.controller
    zero = time.monotonic()

    def report() -> str:
        return controller.report(zero)

    await kube.create(INFERENCESERVICES, {
        "apiVersion": "slipstream.dev/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": NAME, "namespace": NAMESPACE},
        "spec": {"model": {"source": "builtin"}, "port": controller.port, "autoscaling": SCALING}})

    async def at_zero() -> bool:
        return (await scaling_condition(kube)).get("reason") == "ScaledToZero"

    async def seen_at_zero() -> bool:  # the pod controller polls: it may see the Deployment after the condition
        return await at_zero() and bool(controller.replica_changes)

    # Created at minReplicas 0; the autoscaler reads the (empty) gateway and holds zero.
    await wait_for("the autoscaler to hold zero replicas", seen_at_zero, 30, loop, report)
    assert [n for _, n in controller.replica_changes] == [0] and not controller.pods

    timeout = aiohttp.ClientTimeout(total=100)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        sent = time.monotonic()
        answers = await asyncio.gather(*(complete(session, i) for i in range(REQUESTS)), return_exceptions=True)
    failed = [a for a in answers if isinstance(a, BaseException) or a[0] != 200 or a[1] not in ("length", "stop")]
    assert not failed, f"{len(failed)} of {REQUESTS} failed, e.g. {failed[:3]}\n{report()}"
    last_answer = max(a[2] for a in answers)
    ups = [t for t, n in controller.replica_changes if n == 1]
    assert ups and sent < ups[0], report()
    ready_at = controller.started[0].ready_at
    print(f"0 -> 1 {ups[0] - sent:.1f} s after the requests were sent, pod ready after {ready_at - sent:.1f} s, "
          f"all {REQUESTS} answered after {last_answer - sent:.1f} s")

    # Idle: back to zero once nothing ran or waited for scaleToZeroAfterSeconds.
    async def scaled_to_zero() -> bool:
        return controller.replica_changes[-1][1] == 0 and not controller.pods

    await wait_for("the scale to zero", scaled_to_zero, IDLE + 25, loop, report)
    down = controller.replica_changes[-1][0]
    assert down - last_answer >= IDLE - 2 * TICK, report()  # generous: ticks and scrapes in between
    assert [n for _, n in controller.replica_changes] == [0, 1, 0], report()
    condition = await scaling_condition(kube)
    assert f"scaled to zero after {IDLE}s idle" in condition.get("message", ""), condition
    status = (await kube.get(INFERENCESERVICES, NAMESPACE, NAME))["status"]
    assert status["desiredReplicas"] == 0 and [(e["fromReplicas"], e["toReplicas"])
                                               for e in status["scalingHistory"]] == [(0, 1), (1, 0)]
