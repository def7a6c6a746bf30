"""Scraper: read the autoscaling gauges from each ready pod's ``/metrics``, all pods at once.

A pod that is slow, down or answers nonsense is left out of the tick and named in
:attr:`ScrapeResult.failures`; it never holds up the other pods or the caller past ``timeout``.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from slipstream.operator.autoscaler import PodSample

__all__ = ["PodSample", "PodTarget", "ScrapeFailure", "ScrapeResult", "parse_metrics", "pod_targets",
           "scrape_pods"]

WAITING = "slipstream:num_requests_waiting"
RUNNING = "slipstream:num_requests_running"
KV_CACHE = "slipstream:kv_cache_usage_perc"
DEFAULT_TIMEOUT = 1.0
# A slipstream pod's exposition is tens of KiB; anything far larger is not one.
MAX_BYTES = 4 << 20


@dataclass(frozen=True, slots=True)
class PodTarget:
    """Where to read one pod: its name, pod IP and the server's port."""

    name: str
    ip: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.ip}]" if ":" in self.ip else self.ip
        return f"http://{host}:{self.port}/metrics"


@dataclass(frozen=True, slots=True)
class ScrapeFailure:
    pod: str
    error: str


@dataclass(frozen=True, slots=True)
class ScrapeResult:
    """One tick: samples of the pods that answered, and why each other pod did not.

    time: when the tick started, seconds on the scraper's clock.
    """

    time: float
    samples: tuple[PodSample, ...]
    failures: tuple[ScrapeFailure, ...]

    @property
    def failed_pods(self) -> list[str]:
        return [f.pod for f in self.failures]


def parse_metrics(text: str, model_name: str | None = None) -> tuple[float, float, float]:
    """(waiting, running, kv_cache_usage_perc) from Prometheus text exposition.

    Series of several ``model_name`` labels are summed for the request counts and the largest
    KV-cache utilization is taken; ``model_name`` keeps only that label's series.
    Raises ValueError when the text does not parse or a gauge is missing.
    """
    values: dict[str, list[float]] = {WAITING: [], RUNNING: [], KV_CACHE: []}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in values and (model_name is None or sample.labels.get("model_name") == model_name):
                values[sample.name].append(float(sample.value))
    missing = [name for name, found in values.items() if not found]
    if missing:
        raise ValueError(f"metrics missing: {', '.join(missing)}")
    return sum(values[WAITING]), sum(values[RUNNING]), max(values[KV_CACHE])


def pod_targets(pods: Iterable[Mapping[str, Any]], port: int) -> tuple[list[PodTarget], int]:
    """Ready pods to scrape, and how many pods are starting (exist, not ready, not deleting).

    pods: Kubernetes Pod objects as dicts (``metadata``, ``status.conditions``, ``status.podIP``).
    A ready pod without an IP yet counts as starting. Pods being deleted count as neither.
    """
    targets: list[PodTarget] = []
    starting = 0
    for pod in pods:
        metadata, status = pod.get("metadata") or {}, pod.get("status") or {}
        if metadata.get("deletionTimestamp") or status.get("phase") in ("Succeeded", "Failed"):
            continue
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or ())
        if ready and status.get("podIP"):
            targets.append(PodTarget(metadata.get("name", ""), status["podIP"], port))
        else:
            starting += 1
    return targets, starting


async def _scrape_one(session: aiohttp.ClientSession, target: PodTarget, model_name: str | None,
                      clock: Callable[[], float]) -> PodSample:
    async with session.get(target.url) as response:
        if response.status != 200:
            raise ValueError(f"HTTP {response.status}")
        body = await response.content.read(MAX_BYTES + 1)
    if len(body) > MAX_BYTES:
        raise ValueError(f"response larger than {MAX_BYTES} bytes")
    waiting, running, kv = parse_metrics(body.decode("utf-8"), model_name)
    return PodSample(target.name, clock(), waiting, running, kv)


async def scrape_pods(
    targets: Sequence[PodTarget],
    timeout: float = DEFAULT_TIMEOUT,
    *,
    model_name: str | None = None,
    session: aiohttp.ClientSession | None = None,
    clock: Callable[[], float] = time.time,
) -> ScrapeResult:
    """Read every target's ``/metrics`` concurrently; each has ``timeout`` seconds in all.

    Returns within about ``timeout`` seconds whatever the pods do. A pod that times out, refuses,
    answers non-200, or sends text without the three gauges becomes a :class:`ScrapeFailure`.
    session: reuse one across ticks (the operator's); None opens one for this call.
    clock: stamps the result and the samples (seconds; wall clock by default).
    """
    started = clock()

    async def one(s: aiohttp.ClientSession, target: PodTarget) -> PodSample | ScrapeFailure:
        try:
            return await asyncio.wait_for(_scrape_one(s, target, model_name, clock), timeout)
        except asyncio.TimeoutError:
            return ScrapeFailure(target.name, f"no answer within {timeout:g}s")
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            return ScrapeFailure(target.name, f"{type(exc).__name__}: {exc}"[:200])

    if session is None:
        # limit=0: every pod at once; the default pool of 100 would queue the rest past the timeout.
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as own:
            results = await asyncio.gather(*(one(own, t) for t in targets))
    else:
        results = await asyncio.gather(*(one(session, t) for t in targets))
    return ScrapeResult(
        time=started,
        samples=tuple(r for r in results if isinstance(r, PodSample)),
        failures=tuple(r for r in results if isinstance(r, ScrapeFailure)),
    )
