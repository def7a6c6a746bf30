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
import tempfile
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

import aiohttp
import pytest

from emulated_pods import NAMESPACE, PodController, emulated_api, operator_on
from loadgen import LoadGenerator, free_port
from slipstream.operator.kube import INFERENCESERVICES, PODS, Kube
from slipstream.operator.scraper import PodTarget, scrape_pods

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240),
              # kmock 0.8 loads its bundled resource list with a deprecated importlib call.
              pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning")]

NAME = "chat"
ADDRESSES = [f"127.0.0.{i}" for i in range(2, 12)]
OUTPUT_TOKENS = 10
KV_BLOCKS = 12
SCALING = {"enabled": True, "policy": "queue", "minReplicas": 1, "maxReplicas": 3, "targetQueueDepth": 3,
           "targetKVCacheUtilization": 0.58, "stableWindowSeconds": 10, "panicWindowSeconds": 3,
           "scaleDownDelaySeconds": 20}
TICK = 1.0
PRESTOP = 2.0  # seconds between a Pod's deletion and SIGTERM (a preStop sleep)
# (requests/s, seconds)
BASELINE, OVERLOAD, AFTER = (1.0, 8.0), (10.0, 45.0), (1.0, 45.0)


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
    async with emulated_api() as (url, kube):
        logs = pathlib.Path(tempfile.mkdtemp(prefix="closed-loop-"))  # the servers' output, shown on failure
        controller = PodController(
            kube, NAME, port, logs, ADDRESSES, prestop=PRESTOP, serve_args=[
                "--model", "sim:tiny,time_scale=6", "--max-num-seqs", "4",
                "--kv-cache-memory-bytes", str(KV_BLOCKS * 16 * 8192), "--max-waiting", "100000",
                "--shutdown-timeout", "60", "--log-interval", "0"])
        loop = ClosedLoop(kube, port, controller, EmulatedLoad(NAME, port, OUTPUT_TOKENS, kube=kube))
        loop.background = [asyncio.create_task(c) for c in (
            loop.controller.run(), loop.load.watch_endpoints(), loop.watch_queue(), loop.watch_status())]
        try:
            async with operator_on(url, TICK):
                yield loop
        finally:
            for task in loop.background:
                task.cancel()
            await loop.controller.shutdown()


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
        return (f"phases {[(k, round(a - zero, 1)) for k, (a, _) in spans.items()]}\n"
                f"queue {[(round(t - zero, 1), q) for t, q in queue]}\n"
                f"status.queueDepth {[(round(t - zero, 1), q) for t, q in closed_loop.status_queue]}\n"
                + controller.report(zero))

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
