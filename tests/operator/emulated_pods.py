"""Stand-ins for the closed-loop test without a cluster
(test_scale_from_zero.py): the operator tests' Kubernetes API emulator with the real operator on
it, and a pod controller that runs real ``slipstream serve`` processes on 127.0.0.x as the
Deployment's pods."""
from __future__ import annotations

import asyncio
import contextlib
import pathlib
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Sequence

import aiohttp
import kmock
import kopf
import yaml

from kube_emulator import ApiServer
from operator_helpers import CRD_PATH, running_operator
from slipstream.operator.handlers import OperatorConfig, register
from slipstream.operator.kube import DEPLOYMENTS, PODS, Kube
from slipstream.operator.resources import labels

NAMESPACE = "default"


class ForgetfulApiServer(ApiServer):
    """The operator tests' emulator, keeping only kmock's newest requests.

    kmock logs every request (for assertions) and matches each new one against that whole log, so
    a request costs time linear in the number before it; these tests make thousands and assert on
    none, and without the trim the emulator alone would take a CPU core by the end.
    """

    async def __call__(self, raw: Any) -> Any:
        if len(self._requests) > 200:
            del self._requests[:-100]  # the newest stay: one may still be being matched
        return await super().__call__(raw)


@contextlib.asynccontextmanager
async def emulated_api() -> AsyncIterator[tuple[str, Kube]]:
    """The emulator with the CRD installed; yields (its URL, a client)."""
    async with ForgetfulApiServer() as api, kmock.Server(api):
        api.add_crd(yaml.safe_load(CRD_PATH.read_text()))
        url = str(api.url)
        kube = Kube(url)
        try:
            yield url, kube
        finally:
            await kube.close()


def operator_on(url: str, tick: float) -> contextlib.AbstractAsyncContextManager:
    """The real operator against the emulator at ``url``, its autoscaler ticking every ``tick`` s."""
    registry = kopf.OperatorRegistry()
    register(registry, OperatorConfig(resync_seconds=10.0, autoscale_seconds=tick,
                                      login=lambda **_: kopf.ConnectionInfo(server=url, insecure=True),
                                      kube=lambda: Kube(url)))
    settings = kopf.OperatorSettings()
    settings.watching.server_timeout = 10
    return running_operator(registry=registry, settings=settings, clusterwide=True, standalone=True)


@dataclass
class Pod:
    name: str
    ip: str
    process: asyncio.subprocess.Process
    log: pathlib.Path
    ready: bool = False
    ready_at: float | None = None
    deleted_at: float | None = None
    signalled: bool = False


@dataclass
class PodController:
    """Stands in for the Deployment controller and the kubelet of Deployment ``name``: polls it
    every ``poll`` s and starts or stops ``slipstream serve --served-model-name NAME
    --host IP --port PORT *serve_args`` processes on ``addresses`` to match ``spec.replicas``,
    publishing a Pod object for each (``podIP``; Ready once ``/ready`` answers). Scaling down, like
    a ReplicaSet, it deletes not-ready Pods first, then the newest, and sends SIGTERM ``prestop``
    seconds after the deletion (a preStop hook's job: the router stops sending before the server
    drains). ``on_endpoints``, if given, gets the ready, not deleted pods' URLs after every poll
    (an EndpointSlice watch's view)."""

    kube: Kube
    name: str
    port: int
    logs: pathlib.Path
    addresses: Sequence[str]
    serve_args: Sequence[str]
    prestop: float
    poll: float = 0.5
    on_endpoints: Callable[[list[str]], Any] | None = None
    pods: dict[str, Pod] = field(default_factory=dict)
    replica_changes: list[tuple[float, int]] = field(default_factory=list)  # (time, spec.replicas) as seen
    started: list[Pod] = field(default_factory=list)
    _serial: int = 0

    async def _start(self) -> None:
        self._serial += 1
        used = {p.ip for p in self.pods.values()}
        name, ip = f"{self.name}-{self._serial}", next(a for a in self.addresses if a not in used)
        log = self.logs / f"{name}.log"
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "slipstream.server", "serve", "--served-model-name", self.name,
            "--host", ip, "--port", str(self.port), *self.serve_args,
            stdout=log.open("wb"), stderr=asyncio.subprocess.STDOUT)
        self.pods[name] = pod = Pod(name, ip, process, log)
        self.started.append(pod)
        await self.kube.create(PODS, {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NAMESPACE, "labels": labels(self.name)},
            "spec": {"containers": [{"name": "server", "image": "slipstream"}]},
            "status": {"phase": "Running", "podIP": ip, "conditions": [{"type": "Ready", "status": "False"}]}})

    async def _check_ready(self, session: aiohttp.ClientSession, pod: Pod) -> None:
        try:
            async with session.get(f"http://{pod.ip}:{self.port}/ready") as response:
                if response.status != 200:
                    return
        except (aiohttp.ClientError, asyncio.TimeoutError):  # still starting, or busy warming up
            return
        pod.ready, pod.ready_at = True, time.monotonic()
        await self.kube.merge_patch(PODS, NAMESPACE, pod.name, {"status": {"conditions": [
            {"type": "Ready", "status": "True"}]}})

    async def run(self) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1.0)) as session:
            while True:
                await self._sync(session)
                await asyncio.sleep(self.poll)  # every API call costs the emulator milliseconds of CPU

    async def _sync(self, session: aiohttp.ClientSession) -> None:
        dep = await self.kube.get(DEPLOYMENTS, NAMESPACE, self.name)
        if dep is None:
            return
        want = dep["spec"]["replicas"]
        if not self.replica_changes or self.replica_changes[-1][1] != want:
            self.replica_changes.append((time.monotonic(), want))
        live = [p for p in self.pods.values() if p.deleted_at is None]
        for _ in range(want - len(live)):
            await self._start()
        for pod in sorted(live, key=lambda p: (p.ready, p.name))[:max(0, len(live) - want)]:
            pod.deleted_at = time.monotonic()
            await self.kube.request("DELETE", PODS.path(NAMESPACE, pod.name))
        for pod in list(self.pods.values()):
            if pod.deleted_at is None and not pod.ready:
                await self._check_ready(session, pod)
            elif pod.deleted_at is not None and time.monotonic() - pod.deleted_at > self.prestop \
                    and pod.process.returncode is None and not pod.signalled:
                pod.signalled = True  # preStop done: the server drains what it holds, then exits
                pod.process.send_signal(signal.SIGTERM)
            if pod.process.returncode is not None and pod.deleted_at is not None:
                del self.pods[pod.name]
        if self.on_endpoints is not None:
            self.on_endpoints([f"http://{p.ip}:{self.port}" for p in self.pods.values()
                               if p.ready and p.deleted_at is None])
        ready = sum(1 for p in self.pods.values() if p.ready and p.deleted_at is None)
        total = sum(1 for p in self.pods.values() if p.deleted_at is None)
        status = {"observedGeneration": dep["metadata"]["generation"], "replicas": total,
                  "updatedReplicas": total, "readyReplicas": ready, "availableReplicas": ready}
        if any(dep.get("status", {}).get(k) != v for k, v in status.items()):
            await self.kube.merge_patch(DEPLOYMENTS, NAMESPACE, self.name, {"status": status},
                                        subresource="status")

    async def shutdown(self) -> None:
        for pod in self.pods.values():
            if pod.process.returncode is None:
                pod.process.kill()
        for pod in self.pods.values():
            await pod.process.wait()

    def report(self, zero: float) -> str:
        """The replica counts seen (seconds after ``zero``) and the tail of every server's log."""
        tails = "\n".join(f"--- {p.name}\n" + p.read_text()[-1500:] for p in sorted(self.logs.glob("*.log")))
        return f"replicas {[(round(t - zero, 1), n) for t, n in self.replica_changes]}\n{tails}"
