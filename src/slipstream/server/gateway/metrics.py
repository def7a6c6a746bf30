"""The gateway's own Prometheus metrics (``slipstream:gateway_*``, named in
:mod:`slipstream.api_types.metrics`), on the app's own registry.

``slipstream:gateway_requests_waiting`` is the demand signal the autoscaler reads when a service
has no pod to scrape (scale from zero).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from slipstream.api_types import metrics as names
from slipstream.api_types.tenancy import fold_tenants

from ..metrics import CONTENT_TYPE, REQUEST_BUCKETS, TTFT_BUCKETS
from .endpoints import EndpointSet
from .wait_queue import WaitQueue

__all__ = ["CONTENT_TYPE", "GatewayMetrics"]

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
        """Per tenant, bounded (:func:`~slipstream.api_types.tenancy.fold_tenants`): the most served
        by name, the rest summed as ``other``."""
        rows = fold_tenants([self.queue.service.counters, self.queue.waiting_by_tenant(),
                             self.queue.in_flight_by_tenant(), self.queue.rejected_by_tenant()])
        families = [
            GaugeMetricFamily(names.GATEWAY_TENANT_SERVED_TOKENS,
                              "Weighted tokens served per tenant (the fairness counter: prompt tokens + 2 × "
                              "output tokens, divided by the tenant's weight)", labels=["tenant"]),
            GaugeMetricFamily(names.GATEWAY_TENANT_REQUESTS_WAITING, "Requests held in the gateway, by tenant",
                              labels=["tenant"]),
            GaugeMetricFamily(names.GATEWAY_TENANT_REQUESTS_IN_FLIGHT,
                              "Requests the gateway has in flight on the pods, by tenant", labels=["tenant"]),
            # a gauge, not a counter: a tenant's count moves to or from "other" as the ranking changes
            GaugeMetricFamily(names.GATEWAY_TENANT_REJECTIONS,
                              "Requests the gateway refused with 429 (shed, queue full, past a token limit), "
                              "by tenant, since start", labels=["tenant"]),
        ]
        for tenant, values in sorted(rows.items()):
            for family, value in zip(families, values):
                family.add_metric([tenant], value)
        yield from families


class GatewayMetrics:
    def __init__(self, endpoints: EndpointSet, queue: WaitQueue):
        self.registry = r = CollectorRegistry(auto_describe=True)
        r.register(_EndpointCollector(endpoints, queue))
        self.requests = Counter(names.GATEWAY_REQUESTS, "Requests answered by the gateway, by HTTP status (499: the client left first)",
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
