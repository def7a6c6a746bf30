"""Closed loop, no cluster: the real operator scales real ``slipstream serve --model sim:tiny``
processes under a load that rises past one replica's capacity and falls again.

Stand-ins: the operator tests' Kubernetes API emulator (kmock); a pod controller that polls the
Deployment and starts or stops server processes on 127.0.0.2, 127.0.0.3, … (Linux routes all of
127/8 to lo) to match ``spec.replicas``, publishing a Pod object (``podIP``, Ready once ``/ready``
answers) for each, and, scaling down, deleting the Pod first and stopping the process two seconds
later (a preStop hook's job: the router stops sending before the server drains); a seeded
open-loop load generator that routes each request to the ready pod with the fewest outstanding
requests and measures TTFT on the stream.

One replica: 4 seats, ~81 ms steps (``time_scale=6``), 10 output tokens → ~5 requests/s. The
load goes 1 → 10 → 1 requests/s. The KV pool is 12 blocks and a request holds 2, so
``kv_cache_usage_perc`` follows the running batch: its target (0.58, about 3.5 running requests
a pod) keeps three replicas while ~8 requests run, and one while ~1 does; the queue-depth target
drives the scale-up.
"""
from __future__ import annotations

import asyncio
import pathlib
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import aiohttp
import kmock
import kopf
import pytest
import yaml

from kube_emulator import ApiServer
from loadgen import LoadGenerator, free_port
from operator_helpers import CRD_PATH, running_operator
from slipstream.operator.handlers import OperatorConfig, register
from slipstream.operator.kube import DEPLOYMENTS, INFERENCESERVICES, PODS, Kube
from slipstream.operator.resources import labels
from slipstream.operator.scraper import PodTarget, scrape_pods

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240),
              # kmock 0.8 loads its bundled resource list with a deprecated importlib call.
              pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning")]

NAMESPACE = "default"
NAME = "chat"
ADDRESSES = [f"127.0.0.{i}" for i in range(2, 12)]
OUTPUT_TOKENS = 10
KV_BLOCKS = 12
SCALING = {"enabled": True, "minReplicas": 1, "maxReplicas": 3, "targetQueueDepth": 3,
           "targetKVCacheUtilization": 0.58, "stableWindowSeconds": 10, "panicWindowSeconds": 3,
           "scaleDownDelaySeconds": 20}
TICK = 1.0
PRESTOP = 2.0  # seconds between a Pod's deletion and SIGTERM (a preStop sleep)
# (requests/s, seconds)
BASELINE, OVERLOAD, AFTER = (1.0, 8.0), (10.0, 45.0), (1.0, 45.0)


class ForgetfulApiServer(ApiServer):
    """The operator tests' emulator, keeping only kmock's newest requests.

    kmock logs every request (for assertions) and matches each new one against that whole log, so
    a request costs time linear in the number before it; this test makes thousands and asserts on
    none, and without the trim the emulator alone would take a CPU core by the end.
    """

    async def __call__(self, raw: Any) -> Any:
        if len(self._requests) > 200:
            del self._requests[:-100]  # the newest stay: one may still be being matched
        return await super().__call__(raw)


@dataclass
class Pod:
    name: str
    ip: str
    process: asyncio.subprocess.Process
    log: pathlib.Path
    ready: bool = False
    deleted_at: float | None = None
    signalled: bool = False


class PodController:
    """Stands in for the Deployment controller and the kubelet (polls every 0.5 s)."""

    def __init__(self, kube: Kube, port: int, logs: pathlib.Path):
        self.kube, self.port, self.logs = kube, port, logs
        self.pods: dict[str, Pod] = {}
        self.replica_changes: list[tuple[float, int]] = []  # (time, spec.replicas) as seen
        self._serial = 0

    def _free_ip(self) -> str:
        used = {p.ip for p in self.pods.values()}
        return next(a for a in ADDRESSES if a not in used)

    async def _start(self) -> None:
        self._serial += 1
        name, ip = f"{NAME}-{self._serial}", self._free_ip()
        log = self.logs / f"{name}.log"
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "slipstream.server", "serve", "--model", "sim:tiny,time_scale=6",
            "--served-model-name", NAME, "--host", ip, "--port", str(self.port), "--max-num-seqs", "4",
            "--kv-cache-memory-bytes", str(KV_BLOCKS * 16 * 8192), "--max-waiting", "100000",
            "--shutdown-timeout", "60", "--log-interval", "0",
            stdout=log.open("wb"), stderr=asyncio.subprocess.STDOUT)
        self.pods[name] = Pod(name, ip, process, log)
        await self.kube.create(PODS, {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NAMESPACE, "labels": labels(NAME)},
            "spec": {"containers": [{"name": "server", "image": "slipstream"}]},
            "status": {"phase": "Running", "podIP": ip, "conditions": [{"type": "Ready", "status": "False"}]}})

    async def _stop(self, pod: Pod) -> None:
        pod.deleted_at = time.monotonic()
        await self.kube.request("DELETE", PODS.path(NAMESPACE, pod.name))

    async def _check_ready(self, session: aiohttp.ClientSession, pod: Pod) -> None:
        try:
            async with session.get(f"http://{pod.ip}:{self.port}/ready") as response:
                ready = response.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):  # still starting, or busy warming up
            return
        if ready:
            pod.ready = True
            await self.kube.merge_patch(PODS, NAMESPACE, pod.name, {"status": {"conditions": [
                {"type": "Ready", "status": "True"}]}})

    async def run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=1.0)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                await self._sync(session)
                await asyncio.sleep(0.5)  # every API call costs the emulator milliseconds of CPU

    async def _sync(self, session: aiohttp.ClientSession) -> None:
        dep = await self.kube.get(DEPLOYMENTS, NAMESPACE, NAME)
        if dep is None:
            return
        want = dep["spec"]["replicas"]
        if not self.replica_changes or self.replica_changes[-1][1] != want:
            self.replica_changes.append((time.monotonic(), want))
        live = [p for p in self.pods.values() if p.deleted_at is None]
        for _ in range(want - len(live)):
            await self._start()
        # Like a ReplicaSet: not-ready pods go first, then the newest.
        for pod in sorted(live, key=lambda p: (p.ready, p.name))[:max(0, len(live) - want)]:
            await self._stop(pod)
        for pod in list(self.pods.values()):
            if pod.deleted_at is None and not pod.ready:
                await self._check_ready(session, pod)
            elif pod.deleted_at is not None and time.monotonic() - pod.deleted_at > PRESTOP \
                    and pod.process.returncode is None and not pod.signalled:
                pod.signalled = True  # preStop done: the server drains what it holds, then exits
                pod.process.send_signal(signal.SIGTERM)
            if pod.process.returncode is not None and pod.deleted_at is not None:
                del self.pods[pod.name]
        ready = sum(1 for p in self.pods.values() if p.ready and p.deleted_at is None)
        total = sum(1 for p in self.pods.values() if p.deleted_at is None)
        status = {"observedGeneration": dep["metadata"]["generation"], "replicas": total,
                  "updatedReplicas": total, "readyReplicas": ready, "availableReplicas": ready}
        if any(dep.get("status", {}).get(k) != v for k, v in status.items()):
            await self.kube.merge_patch(DEPLOYMENTS, NAMESPACE, NAME, {"status": status}, subresource="status")

    async def shutdown(self) -> None:
        for pod in self.pods.values():
            if pod.process.returncode is None:
                pod.process.kill()
        for pod in self.pods.values():
            await pod.process.wait()


@dataclass
class EmulatedLoad(LoadGenerator):
    """The shared load generator, its endpoints the emulator's ready, not deleted Pods."""

    kube: Kube | None = None

    async def watch_endpoints(self) -> None:
        while True:
            pods = await self.kube.list(PODS, NAMESPACE)
            self.endpoints = [p["status"]["podIP"] for p in pods
                              if not p["metadata"].get("deletionTimestamp")
                              and any(c["type"] == "Ready" and c["status"] == "True"
                                      for c in p["status"].get("conditions", ()))]
            await asyncio.sleep(0.5)  # well inside the preStop pause


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


@dataclass
class ClosedLoop:
    """What the test drives and reads: the API, the stand-ins, the pods' queues and status.queueDepth over time."""

    kube: Kube
    port: int
    controller: PodController
    load: EmulatedLoad
    queue: list[tuple[float, float]] = field(default_factory=list)  # (time, requests waiting in all pods)
    status_queue: list[tuple[float, float]] = field(default_factory=list)  # (time, status.queueDepth)
    background: list[asyncio.Task] = field(default_factory=list)

    async def watch_queue(self) -> None:
        """Sample the pods' own queues twice a second. status.queueDepth is only written every
        TELEMETRY_SECONDS (10 s), so one snapshot of a Poisson burst would stand for a whole window."""
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            while True:
                targets = [PodTarget(p.name, p.ip, self.port) for p in list(self.controller.pods.values())
                           if p.ready and p.deleted_at is None]
                if targets:
                    scrape = await scrape_pods(targets, 0.4, session=session, clock=time.monotonic)
                    if scrape.samples:
                        self.queue.append((scrape.time, sum(s.num_requests_waiting for s in scrape.samples)))
                await asyncio.sleep(0.5)

    async def watch_status(self) -> None:
        while True:
            status = ((await self.kube.get(INFERENCESERVICES, NAMESPACE, NAME)) or {}).get("status") or {}
            if "queueDepth" in status:
                self.status_queue.append((time.monotonic(), status["queueDepth"]))
            await asyncio.sleep(1.0)

    def check_stand_ins(self) -> None:
        """A stand-in that died would make every later assertion misleading."""
        for task in self.background:
            if task.done():
                raise AssertionError("a stand-in of the closed loop stopped") from task.exception()


@pytest.fixture
async def closed_loop() -> AsyncIterator[ClosedLoop]:
    """The emulator, the real operator (1-second autoscaler tick), the pod controller, the load
    generator's endpoint watch and a status watch; server processes are killed afterwards."""
    port = free_port(ADDRESSES)
    async with ForgetfulApiServer() as api, kmock.Server(api):
        api.add_crd(yaml.safe_load(CRD_PATH.read_text()))
        url = str(api.url)
        kube = Kube(url)
        registry = kopf.OperatorRegistry()
        register(registry, OperatorConfig(resync_seconds=10.0, autoscale_seconds=TICK,
                                          login=lambda **_: kopf.ConnectionInfo(server=url, insecure=True),
                                          kube=lambda: Kube(url)))
        settings = kopf.OperatorSettings()
        settings.watching.server_timeout = 10
        logs = pathlib.Path(tempfile.mkdtemp(prefix="closed-loop-"))  # the servers' output, shown on failure
        loop = ClosedLoop(kube, port, PodController(kube, port, logs),
                         EmulatedLoad(NAME, port, OUTPUT_TOKENS, kube=kube))
        loop.background = [asyncio.create_task(c) for c in (
            loop.controller.run(), loop.load.watch_endpoints(), loop.watch_queue(), loop.watch_status())]
        try:
            async with running_operator(registry=registry, settings=settings, clusterwide=True, standalone=True):
                yield loop
        finally:
            for task in loop.background:
                task.cancel()
            await loop.controller.shutdown()
            await kube.close()


async def test_operator_scales_sim_servers_up_under_load_and_down_after_the_delay(closed_loop: ClosedLoop):
    kube, controller, load, queue = closed_loop.kube, closed_loop.controller, closed_loop.load, closed_loop.queue
    await kube.create(INFERENCESERVICES, {
        "apiVersion": "slipstream.dev/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": NAME, "namespace": NAMESPACE},
        "spec": {"model": {"source": "builtin"}, "port": closed_loop.port, "autoscaling": SCALING}})
    deadline = time.monotonic() + 60
    while not load.endpoints:
        assert time.monotonic() < deadline, "the first server never became ready"
        closed_loop.check_stand_ins()
        await asyncio.sleep(0.2)
    spans = await load.play([("baseline", *BASELINE), ("overload", *OVERLOAD), ("after", *AFTER)])
    closed_loop.check_stand_ins()

    zero = spans["baseline"][0]

    def report() -> str:
        tails = "\n".join(f"--- {p.name}\n" + p.read_text()[-1500:] for p in sorted(controller.logs.glob("*.log")))
        return (f"phases {[(k, round(a - zero, 1)) for k, (a, _) in spans.items()]}\n"
                f"replicas {[(round(t - zero, 1), n) for t, n in controller.replica_changes]}\n"
                f"queue {[(round(t - zero, 1), q) for t, q in queue]}\n"
                f"status.queueDepth {[(round(t - zero, 1), q) for t, q in closed_loop.status_queue]}\n{tails}")

    ttft = {phase: [r.ttft for r in load.results if r.phase == phase] for phase in spans}
    print(f"requests {len(load.results)}; replicas {[(round(t - zero, 1), n) for t, n in controller.replica_changes]}; "
          f"phases {[(k, round(a - zero, 1)) for k, (a, _) in spans.items()]}; queue max {max(q for _, q in queue)}; "
          f"p99 TTFT baseline {p99(ttft['baseline']):.3f} s, overload {p99(ttft['overload']):.3f} s")
    failed = load.failed()
    assert not failed, f"{len(failed)} requests failed, e.g. {failed[:3]}\n{report()}"

    t0_over, t1_over = spans["overload"]
    t0_after, _ = spans["after"]
    ups = [t for t, n in controller.replica_changes if n > 1]
    assert ups, report()
    # Scale-up: within the panic window (3 s) of the overload's start, plus a tick and a scrape.
    assert t0_over < ups[0] <= t0_over + SCALING["panicWindowSeconds"] + 2 * TICK, report()
    assert max(n for _, n in controller.replica_changes) == SCALING["maxReplicas"], report()

    # The queue built up while the new pods started, then drained before the overload ended
    # (what is left are the short queues of Poisson bursts at ~70% utilization).
    peak = max(q for t, q in queue if t0_over <= t < t1_over)
    tail = [q for t, q in queue if t1_over - 8 <= t < t1_over]
    assert peak > 10, report()
    print(f"queue peak {peak}, tail mean {sum(tail) / len(tail):.2f} max {max(tail)} over {len(tail)} samples")
    assert sum(tail) / len(tail) <= SCALING["targetQueueDepth"] and max(tail) <= peak / 4, report()
    # The status the autoscaler writes (throttled to one write per 10 s) saw the overload too.
    assert max(q for t, q in closed_loop.status_queue if t0_over <= t < t1_over) > SCALING["targetQueueDepth"], report()

    # p99 TTFT: high while one replica carried the overload, back near the baseline's at its end.
    baseline = p99(ttft["baseline"])
    worst = p99(ttft["overload"])
    recovered = p99([r.ttft for r in load.results if r.phase == "overload" and r.sent >= t1_over - 8])
    print(f"p99 TTFT over the overload's last 8 s: {recovered:.3f} s")
    assert worst > max(1.0, 4 * recovered) and recovered < max(1.5, 4 * baseline), \
        f"baseline {baseline:.3f} worst {worst:.3f} recovered {recovered:.3f}\n{report()}"

    # Scale-down: only after the delay once the load dropped, and back to minReplicas.
    downs = [(t, n) for (t, n), (_, previous) in zip(controller.replica_changes[1:], controller.replica_changes)
             if n < previous]
    assert downs, report()
    assert downs[0][0] >= t0_after + SCALING["scaleDownDelaySeconds"], report()
    assert controller.replica_changes[-1][1] == SCALING["minReplicas"], report()
