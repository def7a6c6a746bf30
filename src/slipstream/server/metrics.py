"""Prometheus metrics of one serving process (``GET /metrics``), all ``slipstream:``-prefixed.

Gauges are read from the engine at scrape time (``AsyncLLM.stats()``), so they are exact at that
moment. Token counters count what was served to clients: prompt tokens once per engine request,
generation tokens as they are delivered. Preemption and prefix-cache counters are the engine's
own totals. Latency histograms come from each request's engine timestamps; ``iteration_tokens``
from the engine's per-step listener. ``engine_config_info`` (value 1, as vLLM's
``vllm:cache_config_info``) carries the engine's settings as labels — ``block_size``,
``max_num_seqs``, ``max_num_batched_tokens``, ``enable_prefix_caching`` (``true``/``false``) —
and the server's ``max_waiting``, so a gateway learns how to hash prompts for this pod and how
many requests it queues; it appears once the engine is loaded.
Per tenant (the fairness header's id): requests waiting and running in the engine, its fairness
counter and the 429s the server answered it, for the :data:`~slipstream.api_types.tenancy.TOP_TENANTS`
most served by name and the rest summed as ``other`` (bounded cardinality: ids come from a header).
``cpu_kernel_info{isa=...}`` (value 1) names the CPU kernel path in use (``avx512``, ``avx2``,
``neon``, ``generic``; ``none`` when quantized weights are served dequantized to fp32) once the
process has resolved it, i.e. on CPU.
"""
from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from slipstream.api_types import metrics as names
from slipstream.api_types.tenancy import fold_tenants
from slipstream.server.virtual_token_counter import count_for_tenant

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LABELS = [names.MODEL_NAME]

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               10.0, 20.0, 80.0)
REQUEST_BUCKETS = (0.01, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class _EngineCollector:
    """Gauges and engine-side counters, read from ``stats()`` whenever Prometheus scrapes."""

    def __init__(self, model_name: Callable[[], str], stats: Callable[[], Any], vllm_compatible: bool,
                 rejected: Callable[[], dict[str, int]] = dict, max_waiting: int | None = None) -> None:
        self._model_name, self._stats, self._vllm = model_name, stats, vllm_compatible
        self._rejected = rejected
        self._max_waiting = max_waiting

    def describe(self) -> list:
        return []  # collected lazily: the engine may not be loaded when the registry is built

    def collect(self):
        stats = self._stats()
        name = self._model_name()

        def family(kind, metric: str, doc: str, value: float):
            fam = kind(metric, doc, labels=_LABELS)
            fam.add_metric([name], value)
            return fam

        gauges = {
            names.NUM_REQUESTS_WAITING: ("Requests waiting to be scheduled.", stats.num_waiting if stats else 0),
            names.NUM_REQUESTS_RUNNING: ("Requests in the running batch.", stats.num_running if stats else 0),
            names.KV_CACHE_USAGE_PERC: ("Fraction of KV-cache blocks in use (0..1).",
                                        stats.kv_cache_usage if stats else 0.0),
        }
        for metric, (doc, value) in gauges.items():
            yield family(GaugeMetricFamily, metric, doc, value)
            if self._vllm:
                yield family(GaugeMetricFamily, names.VLLM_GAUGES[metric], doc + " (vLLM-compatible name)", value)
        counters = {
            names.NUM_PREEMPTIONS: ("Requests preempted (blocks freed, recomputed later).", "num_preemptions_total"),
            names.PREFIX_CACHE_QUERIES: ("Prompt tokens looked up in the prefix cache.",
                                         "prefix_cache_queries_total"),
            names.PREFIX_CACHE_HITS: ("Prompt tokens found in the prefix cache.", "prefix_cache_hits_total"),
        }
        for metric, (doc, attr) in counters.items():
            yield family(CounterMetricFamily, metric, doc, getattr(stats, attr, 0) if stats else 0)
        # read only where the engine imported the kernels: this module must not import torch
        kernels_module = sys.modules.get("slipstream.kernels.cpu_native")
        isa = kernels_module.loaded_isa() if kernels_module else None
        if isa is not None:
            kernels = GaugeMetricFamily(names.CPU_KERNEL_INFO, "The CPU kernel path in use, as a label (value "
                                        "1; none: quantized weights served dequantized to fp32).",
                                        labels=_LABELS + ["isa"])
            kernels.add_metric([name, isa], 1)
            yield kernels
        yield from self._tenants(name, stats)
        if stats is not None:
            server = names.SERVER_CONFIG_LABELS if self._max_waiting is not None else ()
            info = GaugeMetricFamily(names.ENGINE_CONFIG_INFO, "The engine's settings and the server's queue "
                                     "limit (--max-waiting), as labels (value 1).",
                                     labels=_LABELS + list(_CONFIG_LABELS) + list(server))
            info.add_metric([name] + [_label_value(getattr(stats, attr)) for attr in _CONFIG_LABELS]
                            + [str(self._max_waiting)] * len(server), 1)
            yield info


    def _tenants(self, name: str, stats: Any):
        running = stats.tenant_running if stats else {}
        waiting = {t: n - running.get(t, 0) for t, n in (stats.tenant_requests if stats else {}).items()}
        rows = fold_tenants([stats.tenant_served if stats else {}, waiting, running, self._rejected()])
        labels = _LABELS + ["tenant"]
        families = [
            GaugeMetricFamily(names.TENANT_SERVED_TOKENS, "Weighted tokens served per tenant (the fair policy's "
                              "counter: prompt tokens + 2 × output tokens, divided by the tenant's weight).",
                              labels=labels),
            GaugeMetricFamily(names.TENANT_REQUESTS_WAITING, "Requests waiting to be scheduled, by tenant.",
                              labels=labels),
            GaugeMetricFamily(names.TENANT_REQUESTS_RUNNING, "Requests in the running batch, by tenant.",
                              labels=labels),
            # a gauge, not a counter: a tenant's count moves to or from "other" as the ranking changes
            GaugeMetricFamily(names.TENANT_REJECTIONS, "Requests refused with 429 (queue full), by tenant, "
                              "since start.", labels=labels),
        ]
        for tenant, values in sorted(rows.items()):
            for family, value in zip(families, values):
                family.add_metric([name, tenant], value)
        yield from families


_CONFIG_LABELS = names.ENGINE_CONFIG_LABELS


def _label_value(value: Any) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


class ServerMetrics:
    """The registry of one app (not the global one, so several apps can live in one process)."""

    def __init__(self, model_name: Callable[[], str], stats: Callable[[], Any], vllm_compatible: bool = False,
                 max_waiting: int | None = None):
        self.registry = CollectorRegistry(auto_describe=False)
        self._model_name = model_name
        r = self.registry

        def counter(metric: str, doc: str, labels: list[str] = _LABELS) -> Counter:
            return Counter(metric, doc, labels, registry=r)

        def histogram(metric: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(metric, doc, _LABELS, buckets=buckets, registry=r)

        self.prompt_tokens = counter(names.PROMPT_TOKENS, "Prompt tokens of requests served.")
        self.generation_tokens = counter(names.GENERATION_TOKENS, "Tokens generated and delivered.")
        self.request_success = counter(names.REQUEST_SUCCESS, "Finished choices, by finish reason (error: the "
                                       "engine failed it, as a failed step or logits that are not finite).",
                                       _LABELS + ["finished_reason"])
        self.ttft = histogram(names.TIME_TO_FIRST_TOKEN_SECONDS, "Arrival to first generated token.", TTFT_BUCKETS)
        self.itl = histogram(names.INTER_TOKEN_LATENCY_SECONDS, "Time between two generated tokens.", ITL_BUCKETS)
        self.e2e = histogram(names.E2E_REQUEST_LATENCY_SECONDS, "Arrival to finish.", REQUEST_BUCKETS)
        self.queue_time = histogram(names.REQUEST_QUEUE_TIME_SECONDS, "Arrival to first scheduled.", REQUEST_BUCKETS)
        self.iteration_tokens = histogram(names.ITERATION_TOKENS, "Tokens (prefill + decode) per engine step.",
                                          ITERATION_BUCKETS)
        self._rejected: dict[str, int] = {}  # tenant → 429s (bounded: count_for_tenant)
        r.register(_EngineCollector(model_name, stats, vllm_compatible, lambda: dict(self._rejected), max_waiting))

    def start(self) -> None:
        """Export every series at zero from the start (once the model name is known), so rates work."""
        for metric in (self.prompt_tokens, self.generation_tokens, self.ttft, self.itl, self.e2e, self.queue_time,
                       self.iteration_tokens):
            self.label(metric)
        for reason in ("stop", "length", "abort", "error"):
            self.label(self.request_success, reason)

    def reject(self, tenant: str) -> None:
        """Count a 429 answered to ``tenant`` (the event loop's thread)."""
        count_for_tenant(self._rejected, tenant)

    def label(self, metric: Any, *extra: str) -> Any:
        return metric.labels(self._model_name(), *extra)

    def on_step(self, record: Any) -> None:
        """Engine step listener (runs in the engine thread; prometheus-client is thread-safe)."""
        tokens = record.num_prefill_tokens + record.num_decode_tokens
        if tokens:
            self.label(self.iteration_tokens).observe(tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)


@dataclass
class RequestRecord:
    """One API call's numbers, fed increment by increment; also the source of its log line."""

    metrics: ServerMetrics
    request_id: str
    start: float = field(default_factory=time.monotonic)
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None
    finish_reasons: list[str] = field(default_factory=list)
    client_gone: bool = False
    _seen: set = field(default_factory=set)
    _first_token: set = field(default_factory=set)
    _last_token_time: dict = field(default_factory=dict)

    def observe(self, prompt_index: int, out: Any) -> None:
        m = self.metrics
        now = time.monotonic()
        metrics = out.metrics
        if prompt_index not in self._seen:
            self._seen.add(prompt_index)
            self.prompt_tokens += len(out.prompt_token_ids)
            m.label(m.prompt_tokens).inc(len(out.prompt_token_ids))
        token_time = metrics.last_token_time if metrics and metrics.last_token_time else now
        for co in out.outputs:
            if not co.token_ids:
                continue
            self.output_tokens += len(co.token_ids)
            m.label(m.generation_tokens).inc(len(co.token_ids))
            if prompt_index not in self._first_token:  # time to the request's first token
                self._first_token.add(prompt_index)
                arrival = metrics.arrival_time if metrics else self.start
                first = metrics.first_token_time if metrics and metrics.first_token_time else token_time
                ttft = max(0.0, first - arrival)
                m.label(m.ttft).observe(ttft)
                self.ttft = ttft if self.ttft is None else min(self.ttft, ttft)
            key = (prompt_index, co.index)
            previous = self._last_token_time.get(key)
            gaps = len(co.token_ids) if previous is not None else len(co.token_ids) - 1
            for _ in range(gaps):  # one gap per token after each choice's first
                m.label(m.itl).observe(max(0.0, token_time - (previous or token_time)) / max(gaps, 1))
            self._last_token_time[key] = token_time
        for co in out.outputs:
            if co.finish_reason is not None:
                # the engine aborts what it fails; the error says it failed (vLLM v1 counts it as "error")
                reason = "error" if out.error else getattr(co.finish_reason, "value", co.finish_reason)
                self.finish_reasons.append(str(reason))
                m.label(m.request_success, str(reason)).inc()
        if out.finished and metrics is not None:
            end = metrics.finished_time or now
            m.label(m.e2e).observe(max(0.0, end - metrics.arrival_time))
            if metrics.first_scheduled_time is not None:
                m.label(m.queue_time).observe(max(0.0, metrics.first_scheduled_time - metrics.arrival_time))

    def log_line(self) -> str:
        total = time.monotonic() - self.start
        ttft = f"{self.ttft:.3f}s" if self.ttft is not None else "-"
        reasons = "client_gone" if self.client_gone else (",".join(sorted(set(self.finish_reasons))) or "-")
        return (f"{self.request_id}: prompt_tokens={self.prompt_tokens} output_tokens={self.output_tokens} "
                f"ttft={ttft} total={total:.3f}s finish={reasons}")
