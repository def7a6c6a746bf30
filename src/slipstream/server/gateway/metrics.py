"""The gateway's own Prometheus metrics (``slipstream:gateway_*``, named in
:mod:`slipstream.api_types.metrics`), on the app's own registry.

``slipstream:gateway_requests_waiting`` is the demand signal the autoscaler reads when a service
has no pod to scrape (scale from zero).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from slipstream.api_types import metrics as names

from ..metrics import CONTENT_TYPE, REQUEST_BUCKETS, TTFT_BUCKETS
from .endpoints import EndpointSet
from .wait_queue import WaitQueue

__all__ = ["CONTENT_TYPE", "GatewayMetrics"]

TOP_TENANTS = 20  # tenants named in the per-tenant metrics; the rest are "other"
OTHER_TENANT = "other"


class _EndpointCollector:
    """Gauges read from the endpoint set and the wait queue at scrape time, so removed endpoints
    disappear."""

    def __init__(self, endpoints: EndpointSet, queue: WaitQueue):
        self.endpoints = endpoints
        self.queue = queue

    def describe(self) -> list:
        return []

    def collect(self):
        waiting = GaugeMetricFamily(names.GATEWAY_REQUESTS_WAITING,
                                    "Requests held in the gateway waiting for an endpoint")
        waiting.add_metric([], self.queue.waiting)
        yield waiting
        in_flight = GaugeMetricFamily(names.GATEWAY_ENDPOINT_IN_FLIGHT,
                                      "Requests the gateway has in flight on each endpoint", labels=["endpoint"])
        up = GaugeMetricFamily(names.GATEWAY_ENDPOINT_ROUTABLE,
                               "1 when the endpoint takes new requests (fresh load, no failed connection)",
                               labels=["endpoint"])
        now = self.endpoints.clock()
        for name in self.endpoints.names():
            endpoint = self.endpoints.get(name)
            in_flight.add_metric([name], endpoint.in_flight)
            up.add_metric([name], 1.0 if self.endpoints.routable(endpoint, now) else 0.0)
        yield in_flight
        yield up
        count = GaugeMetricFamily(names.GATEWAY_ENDPOINTS, "Endpoints known to the gateway")
        count.add_metric([], len(self.endpoints))
        yield count
        yield from self._tenants()

    def _tenants(self):
        """Per tenant, bounded: the :data:`TOP_TENANTS` most served (or waiting) by name, the rest
        summed as ``other``."""
        waiting = self.queue.waiting_by_tenant()
        served = self.queue.service.counters
        ranked = sorted(set(served) | set(waiting), key=lambda t: (-served.get(t, 0.0), t))
        named = set(ranked[:TOP_TENANTS])
        rows: dict[str, list[float]] = {}
        for tenant in ranked:
            row = rows.setdefault(tenant if tenant in named else OTHER_TENANT, [0.0, 0.0])
            row[0] += waiting.get(tenant, 0)
            row[1] += served.get(tenant, 0.0)
        waiting_family = GaugeMetricFamily(names.GATEWAY_TENANT_REQUESTS_WAITING,
                                           "Requests held in the gateway, by tenant", labels=["tenant"])
        served_family = GaugeMetricFamily(names.GATEWAY_TENANT_SERVED_TOKENS,
                                          "Weighted tokens served per tenant (the fairness counter: prompt "
                                          "tokens + 2 × output tokens, divided by the tenant's weight)",
                                          labels=["tenant"])
        for tenant, (w, s) in sorted(rows.items()):
            waiting_family.add_metric([tenant], w)
            served_family.add_metric([tenant], s)
        yield waiting_family
        yield served_family


class GatewayMetrics:
    def __init__(self, endpoints: EndpointSet, queue: WaitQueue):
        self.registry = r = CollectorRegistry(auto_describe=True)
        r.register(_EndpointCollector(endpoints, queue))
        self.requests = Counter(names.GATEWAY_REQUESTS, "Requests answered by the gateway, by HTTP status",
                                ["code"], registry=r)
        self.prompt_tokens = Counter(names.GATEWAY_PROMPT_TOKENS,
                                     "Prompt tokens of the answered requests (their usage), the autoscaler's "
                                     "demand", registry=r)
        self.generation_tokens = Counter(names.GATEWAY_GENERATION_TOKENS,
                                         "Generated tokens of the answered requests (their usage)", registry=r)
        self.decisions = Counter(names.GATEWAY_ROUTING_DECISIONS, "Routing decisions by policy and reason",
                                 ["policy", "reason"], registry=r)
        self.prefix_blocks_requested = Counter(
            names.GATEWAY_PREFIX_BLOCKS_REQUESTED, "Full prompt blocks of routed requests", registry=r)
        self.prefix_blocks_matched = Counter(
            names.GATEWAY_PREFIX_BLOCKS_MATCHED, "Prompt blocks the chosen endpoint held, as the gateway's index saw it",
            registry=r)
        self.retries = Counter(names.GATEWAY_RETRIES, "Requests sent again to another endpoint before the first byte",
                               ["reason"], registry=r)
        self.rejections = Counter(names.GATEWAY_REJECTIONS, "Requests the gateway answered itself with an error",
                                  ["reason"], registry=r)
        self.stream_errors = Counter(names.GATEWAY_UPSTREAM_ERRORS_AFTER_FIRST_BYTE,
                                     "Responses cut short because the endpoint failed mid-response", registry=r)
        self.queue_time = Histogram(names.GATEWAY_QUEUE_TIME_SECONDS, "Time a request waited for an endpoint",
                                    buckets=TTFT_BUCKETS, registry=r)
        self.ttft = Histogram(names.GATEWAY_TIME_TO_FIRST_TOKEN_SECONDS,
                              "Arrival at the gateway to the first response byte sent to the client",
                              buckets=TTFT_BUCKETS, registry=r)
        self.e2e = Histogram(names.GATEWAY_E2E_REQUEST_LATENCY_SECONDS,
                             "Arrival at the gateway to the last response byte", buckets=REQUEST_BUCKETS, registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
