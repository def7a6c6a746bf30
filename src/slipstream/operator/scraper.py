"""Scraper: read the autoscaling gauges from each ready pod's ``/metrics``, all pods at once:
the model pods' queue and KV cache (:func:`scrape_pods`), and the gateway pods' waiting and
in-flight requests (:func:`scrape_gateways`, the demand signal at zero replicas).

A pod that is slow, down or answers nonsense is left out of the tick and named in
:attr:`ScrapeResult.failures`; it never holds up the other pods or the caller past ``timeout``.
"""
from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, fields, replace
from typing import Any, Awaitable, Callable, Iterable, Mapping, Sequence, TypeVar

import aiohttp

from slipstream.api_types.metrics import read_gateway_load, read_pod_load
from slipstream.api_types.load import GatewayLoad, PodLoad

__all__ = ["GatewayScrape", "PodTarget", "ScrapeFailure", "ScrapeResult",
           "parse_gateway_metrics", "parse_metrics", "pod_targets", "scrape_gateways", "scrape_pods"]

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
    samples: tuple[PodLoad, ...]
    failures: tuple[ScrapeFailure, ...]

    @property
    def failed_pods(self) -> list[str]:
        return [f.pod for f in self.failures]


@dataclass(frozen=True, slots=True)
class GatewayScrape:
    """One tick of the gateway pods: their gauges summed (None when none answered) and why each
    other pod did not answer. time: when the tick started, seconds on the scraper's clock."""

    time: float
    sample: GatewayLoad | None
    failures: tuple[ScrapeFailure, ...]


# The contract's readers (slipstream.api_types.metrics), under the names the operator has used.
parse_metrics = read_pod_load
parse_gateway_metrics = read_gateway_load


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


async def _fetch(session: aiohttp.ClientSession, target: PodTarget) -> str:
    async with session.get(target.url) as response:
        if response.status != 200:
            raise ValueError(f"HTTP {response.status}")
        body = await response.content.read(MAX_BYTES + 1)
    if len(body) > MAX_BYTES:
        raise ValueError(f"response larger than {MAX_BYTES} bytes")
    return body.decode("utf-8")


T = TypeVar("T")


def _finite(load: T) -> T:
    """``load`` (a :class:`PodLoad` or :class:`GatewayLoad`) when every number in it is finite
    (a histogram's +Inf bound aside). Raises ValueError naming the field: a NaN or infinite
    reading is a failed scrape, as the policies' arithmetic and the status's JSON take neither."""
    for f in fields(load):
        value = getattr(load, f.name)
        numbers = [count for _, count in value] if f.name == "ttft_buckets" else [value]
        if any(isinstance(v, float) and not math.isfinite(v) for v in numbers):
            raise ValueError(f"{f.name} is not a finite number: {value!r}")
    return load


async def _read_all(targets: Sequence[PodTarget], timeout: float, session: aiohttp.ClientSession | None,
                    read: Callable[[str], T]) -> list[tuple[PodTarget, T | ScrapeFailure]]:
    """``read(text)`` of every target's /metrics, concurrently, each within ``timeout`` seconds;
    a target that fails becomes a :class:`ScrapeFailure`."""

    async def one(s: aiohttp.ClientSession, target: PodTarget) -> T | ScrapeFailure:
        try:
            return read(await asyncio.wait_for(_fetch(s, target), timeout))
        except asyncio.TimeoutError:
            return ScrapeFailure(target.name, f"no answer within {timeout:g}s")
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            return ScrapeFailure(target.name, f"{type(exc).__name__}: {exc}"[:200])

    async def every(s: aiohttp.ClientSession) -> list[T | ScrapeFailure]:
        reads: list[Awaitable[T | ScrapeFailure]] = [one(s, t) for t in targets]
        return list(await asyncio.gather(*reads))

    if session is None:
        # limit=0: every pod at once; the default pool of 100 would queue the rest past the timeout.
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as own:
            return list(zip(targets, await every(own)))
    return list(zip(targets, await every(session)))


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
    results = [r if isinstance(r, ScrapeFailure) else replace(r, pod=target.name, time=clock())
               for target, r in await _read_all(targets, timeout, session,
                                                lambda text: _finite(read_pod_load(text, model_name=model_name)))]
    return ScrapeResult(
        time=started,
        samples=tuple(r for r in results if isinstance(r, PodLoad)),
        failures=tuple(r for r in results if isinstance(r, ScrapeFailure)),
    )


async def scrape_gateways(
    targets: Sequence[PodTarget],
    timeout: float = DEFAULT_TIMEOUT,
    *,
    session: aiohttp.ClientSession | None = None,
    clock: Callable[[], float] = time.time,
) -> GatewayScrape:
    """Read every gateway pod's ``/metrics`` concurrently (as :func:`scrape_pods`) and sum what
    they hold: ``sample`` is None when none answered, its ``in_flight`` and each demand counter
    None unless every pod that answered exports it, and ``complete`` False when a pod did not
    answer.
    """
    started = clock()
    results = [r for _, r in await _read_all(targets, timeout, session,
                                             lambda text: _finite(read_gateway_load(text)))]
    read = [r for r in results if not isinstance(r, ScrapeFailure)]
    failures = tuple(r for r in results if isinstance(r, ScrapeFailure))
    sample = None

    def total(values: Sequence[float | None]) -> float | None:
        return None if any(v is None for v in values) else sum(values)

    if read:
        sample = GatewayLoad(
            waiting=sum(r.waiting for r in read),
            in_flight=total([r.in_flight for r in read]),
            complete=not failures,
            requests_total=total([r.requests_total for r in read]),
            prompt_tokens_total=total([r.prompt_tokens_total for r in read]),
            generation_tokens_total=total([r.generation_tokens_total for r in read]),
            answered_total=total([r.answered_total for r in read]))
    return GatewayScrape(started, sample, failures)
