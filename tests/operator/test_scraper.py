"""The scraper against small aiohttp servers on 127.0.0.1 standing in for pods."""
from __future__ import annotations

import asyncio
import socket
import time

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from slipstream.api_types.load import GatewayLoad
from slipstream.operator.scraper import PodTarget, ScrapeResult, parse_gateway_metrics, parse_metrics, pod_targets, \
    scrape_gateways, scrape_pods
from slipstream.server.gateway.config import GatewayConfig
from slipstream.server.gateway.endpoints import EndpointSet
from slipstream.server.gateway.metrics import GatewayMetrics
from slipstream.server.gateway.wait_queue import WaitQueue


def exposition(waiting: float, running: float, kv: float, model: str = "smollm2") -> bytes:
    """What a slipstream pod serves: the three gauges among counters and histograms."""
    registry = CollectorRegistry()
    Gauge("slipstream:num_requests_waiting", "", ["model_name"], registry=registry).labels(model).set(waiting)
    Gauge("slipstream:num_requests_running", "", ["model_name"], registry=registry).labels(model).set(running)
    Gauge("slipstream:kv_cache_usage_perc", "", ["model_name"], registry=registry).labels(model).set(kv)
    Counter("slipstream:prompt_tokens", "", ["model_name"], registry=registry).labels(model).inc(123)
    ttft = Histogram("slipstream:time_to_first_token_seconds", "", ["model_name"], registry=registry)
    ttft.labels(model).observe(0.2)
    return generate_latest(registry)


@pytest.fixture
async def pods():
    """start(name, handler) -> PodTarget of a server on 127.0.0.1; `release` frees hung handlers."""
    release = asyncio.Event()
    runners: list[web.AppRunner] = []

    async def start(name: str, handler) -> PodTarget:
        app = web.Application()
        app.router.add_get("/metrics", handler)
        runner = web.AppRunner(app, shutdown_timeout=0.5)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        return PodTarget(name, "127.0.0.1", runner.addresses[0][1])

    start.release = release
    yield start
    release.set()
    for runner in runners:
        await runner.cleanup()


def serving(body: bytes, status: int = 200):
    async def handler(request: web.Request) -> web.Response:
        return web.Response(body=body, status=status, content_type="text/plain")
    return handler


def hanging(release: asyncio.Event):
    async def handler(request: web.Request) -> web.Response:
        await release.wait()
        return web.Response(body=exposition(0, 0, 0), content_type="text/plain")
    return handler


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_reads_the_three_gauges_of_every_pod(pods):
    a = await pods("pod-a", serving(exposition(3, 7, 0.25)))
    b = await pods("pod-b", serving(exposition(0, 2, 0.9)))

    result = await scrape_pods([a, b], timeout=2.0, clock=lambda: 1234.5)

    assert isinstance(result, ScrapeResult) and result.failures == () and result.time == 1234.5
    got = {s.pod: (s.num_requests_waiting, s.num_requests_running, s.kv_cache_usage_perc, s.time)
           for s in result.samples}
    assert got == {"pod-a": (3, 7, 0.25, 1234.5), "pod-b": (0, 2, 0.9, 1234.5)}


async def test_a_pod_that_hangs_is_left_out_without_holding_up_the_others(pods):
    good = await pods("good", serving(exposition(1, 1, 0.5)))
    slow = await pods("slow", hanging(pods.release))

    started = time.monotonic()
    result = await scrape_pods([slow, good], timeout=0.3)
    elapsed = time.monotonic() - started

    assert [s.pod for s in result.samples] == ["good"]
    assert result.failed_pods == ["slow"]
    assert "no answer within 0.3s" in result.failures[0].error
    assert elapsed < 1.5, f"a hung pod held the tick for {elapsed:.2f}s"


async def test_pods_are_read_concurrently(pods):
    slow = [await pods(f"slow-{i}", hanging(pods.release)) for i in range(4)]

    started = time.monotonic()
    result = await scrape_pods(slow, timeout=0.4)
    elapsed = time.monotonic() - started

    assert sorted(result.failed_pods) == [f"slow-{i}" for i in range(4)]
    assert elapsed < 1.2, f"4 pods with a 0.4 s timeout took {elapsed:.2f}s: read one after another"


async def test_errors_garbage_and_missing_gauges_are_counted_as_failures(pods):
    targets = [
        await pods("error", serving(b"boom", status=500)),
        await pods("garbage", serving(b"<html>not metrics</html>\n")),
        await pods("partial", serving(b'slipstream:num_requests_waiting{model_name="m"} 1\n')),
        PodTarget("refused", "127.0.0.1", closed_port()),
        await pods("fine", serving(exposition(2, 3, 0.4))),
    ]

    result = await scrape_pods(targets, timeout=2.0)

    assert [s.pod for s in result.samples] == ["fine"]
    errors = {f.pod: f.error for f in result.failures}
    assert set(errors) == {"error", "garbage", "partial", "refused"}
    assert "HTTP 500" in errors["error"]
    assert "metrics missing: slipstream:num_requests_running, slipstream:kv_cache_usage_perc" in errors["partial"]
    assert errors["garbage"].startswith("ValueError")


async def test_a_pod_or_gateway_reading_nan_or_infinity_is_a_failure_not_a_load(pods):
    """A NaN or infinite gauge or counter would crash the policy's arithmetic (and the status's
    JSON) every tick; such a reading is left out and counted like a garbled one."""
    targets = [await pods("nan-kv", serving(exposition(2, 3, float("nan")))),
               await pods("inf-waiting", serving(exposition(float("inf"), 3, 0.4))),
               await pods("fine", serving(exposition(2, 3, 0.4)))]
    result = await scrape_pods(targets, timeout=2.0)
    assert [s.pod for s in result.samples] == ["fine"]
    errors = {f.pod: f.error for f in result.failures}
    assert "kv_cache_usage_perc is not a finite number" in errors["nan-kv"]
    assert "num_requests_waiting is not a finite number" in errors["inf-waiting"]
    gateway = await pods("gateway", serving(gateway_exposition(float("nan"), {})))
    assert (await scrape_gateways([gateway])).sample is None


async def test_a_session_passed_in_is_used_and_left_open(pods):
    target = await pods("pod", serving(exposition(5, 1, 0.1)))
    async with aiohttp.ClientSession() as session:
        first = await scrape_pods([target], session=session)
        second = await scrape_pods([target], session=session)
        assert not session.closed
    assert [s.num_requests_waiting for s in first.samples + second.samples] == [5, 5]


async def test_no_targets_is_an_empty_tick():
    result = await scrape_pods([], clock=lambda: 7.0)
    assert result == ScrapeResult(7.0, (), ())


def test_parse_sums_requests_over_models_and_takes_the_fullest_kv_cache():
    text = (exposition(1, 2, 0.3, model="a") + exposition(4, 8, 0.6, model="b")).decode()
    gauges = lambda load: (load.pod, load.time, load.num_requests_waiting,  # noqa: E731
                           load.num_requests_running, load.kv_cache_usage_perc)
    assert gauges(parse_metrics(text)) == ("", 0.0, 5, 10, 0.6)
    assert gauges(parse_metrics(text, model_name="a", pod="p", time=3.0)) == ("p", 3.0, 1, 2, 0.3)


def test_parse_reads_the_token_counters_and_the_ttft_buckets_for_the_capacity_policy():
    text = (exposition(1, 2, 0.3, model="a") + exposition(4, 8, 0.6, model="b")).decode()
    load = parse_metrics(text)
    assert (load.prompt_tokens_total, load.generation_tokens_total, load.requests_total) == (246, None, None)
    buckets = dict(load.ttft_buckets)
    assert (buckets[0.1], buckets[0.25], buckets[float("inf")]) == (0, 2, 2)  # two 0.2 s observations
    assert [le for le, _ in load.ttft_buckets] == sorted(buckets)
    only_a = parse_metrics(text, model_name="a")
    assert only_a.prompt_tokens_total == 123 and dict(only_a.ttft_buckets)[float("inf")] == 1
    with pytest.raises(ValueError, match="metrics missing"):
        parse_metrics(text, model_name="c")


def test_pod_targets_keeps_ready_pods_and_counts_starting_ones():
    def pod(name, ready, ip="10.0.0.1", **extra):
        status = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
        if ip:
            status["podIP"] = ip
        return {"metadata": {"name": name, **extra}, "status": status}

    pods = [
        pod("ready", True, ip="10.0.0.5"),
        pod("loading", False),
        pod("no-ip-yet", True, ip=None),
        pod("leaving", True, deletionTimestamp="2026-01-01T00:00:00Z"),
        {"metadata": {"name": "pending"}, "status": {"phase": "Pending"}},
        pod("v6", True, ip="fd00::7"),
    ]
    targets, starting = pod_targets(pods, port=8000)
    assert [(t.name, t.url) for t in targets] == [
        ("ready", "http://10.0.0.5:8000/metrics"),
        ("v6", "http://[fd00::7]:8000/metrics"),
    ]
    assert starting == 3


# --- the gateway's gauges --------------------------------------------------------------------

def gateway_exposition(waiting: float, in_flight: dict[str, float]) -> bytes:
    registry = CollectorRegistry()
    Gauge("slipstream:gateway_requests_waiting", "", registry=registry).set(waiting)
    gauge = Gauge("slipstream:gateway_endpoint_in_flight", "", ["endpoint"], registry=registry)
    for endpoint, n in in_flight.items():
        gauge.labels(endpoint).set(n)
    Counter("slipstream:gateway_requests", "", ["code"], registry=registry).labels("200").inc(9)
    return generate_latest(registry)


async def test_parse_gateway_reads_what_the_gateway_exports():
    """The real gateway's /metrics: requests held for want of a pod, and in flight per endpoint."""
    endpoints = EndpointSet(GatewayConfig())
    queue = WaitQueue(endpoints)
    metrics = GatewayMetrics(endpoints, queue)
    # no endpoint, none held; the token counters start at 0, requests_total has no sample until one is answered
    assert parse_gateway_metrics(metrics.render().decode()) == GatewayLoad(
        0.0, 0.0, prompt_tokens_total=0.0, generation_tokens_total=0.0)
    metrics.requests.labels("200").inc(5)
    metrics.prompt_tokens.inc(1200)
    assert parse_gateway_metrics(metrics.render().decode()).requests_total == 5
    assert parse_gateway_metrics(metrics.render().decode()).prompt_tokens_total == 1200

    held = [asyncio.create_task(queue.acquire(lambda loads: None, endpoints.clock() + 30))
            for _ in range(3)]
    await asyncio.sleep(0)
    endpoints.set_endpoints(["http://127.0.0.2:8000", "http://127.0.0.3:8000"])
    endpoints.get("http://127.0.0.2:8000").in_flight = 2
    endpoints.get("http://127.0.0.3:8000").in_flight = 1
    try:
        load = parse_gateway_metrics(metrics.render().decode())
        assert (load.waiting, load.in_flight) == (3.0, 3.0)
    finally:
        for task in held:
            task.cancel()
        await asyncio.gather(*held, return_exceptions=True)


def test_parse_gateway_without_in_flight_says_so_and_without_waiting_fails():
    registry = CollectorRegistry()
    Gauge("slipstream:gateway_requests_waiting", "", registry=registry).set(4)
    assert parse_gateway_metrics(generate_latest(registry).decode()) == GatewayLoad(4.0, None)
    with pytest.raises(ValueError, match="metrics missing: slipstream:gateway_requests_waiting"):
        parse_gateway_metrics(exposition(1, 2, 0.3).decode())


async def test_gateway_pods_are_summed_and_a_silent_one_makes_the_reading_incomplete(pods):
    a = await pods("gateway-a", serving(gateway_exposition(2, {"http://p1": 1, "http://p2": 3})))
    b = await pods("gateway-b", serving(gateway_exposition(1, {})))
    result = await scrape_gateways([a, b], clock=lambda: 5.0)
    # the demand counters too (the capacity policy's demand): summed, None where a pod has none
    assert result.sample == GatewayLoad(waiting=3.0, in_flight=4.0, complete=True, requests_total=18.0,
                                        answered_total=18.0)
    assert result.time == 5.0 and result.failures == ()

    down = PodTarget("gateway-c", "127.0.0.1", closed_port())
    result = await scrape_gateways([a, down])
    assert result.sample == GatewayLoad(waiting=2.0, in_flight=4.0, complete=False, requests_total=9.0,
                                        answered_total=9.0)
    assert [f.pod for f in result.failures] == ["gateway-c"]
    assert (await scrape_gateways([down])).sample is None
    assert (await scrape_gateways([])).sample is None
