"""The metric names a model server and a gateway export and the gateway, the operator and the
simulator read, written once, and the one reader of Prometheus text exposition.

A model server's (``slipstream serve``, ``GET /metrics``; all with label ``model_name``): the
gauges :data:`NUM_REQUESTS_WAITING`, :data:`NUM_REQUESTS_RUNNING`, :data:`KV_CACHE_USAGE_PERC`
(also under vLLM's names, :data:`VLLM_GAUGES`, when asked), counters, latency histograms and two
info gauges (value 1, settings as labels). A gateway's (``slipstream gateway``): ``GATEWAY_*``.
Counter names are given without the ``_total`` the exposition adds to their samples.

The parser is built on ``prometheus_client.parser``, imported inside :func:`parse_exposition`, so
importing this package needs pydantic alone; calling the readers needs ``prometheus_client``
(every slipstream install has it).
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

from .load import GatewayLoad, PodLoad

PREFIX = "slipstream:"
MODEL_NAME = "model_name"  # the label on every model-server series

# Gauges, read from the engine at scrape time.
NUM_REQUESTS_WAITING = PREFIX + "num_requests_waiting"
NUM_REQUESTS_RUNNING = PREFIX + "num_requests_running"
KV_CACHE_USAGE_PERC = PREFIX + "kv_cache_usage_perc"
# The same gauges under vLLM's names, for routers and KEDA recipes written for vLLM.
VLLM_GAUGES: Mapping[str, str] = MappingProxyType({
    NUM_REQUESTS_WAITING: "vllm:num_requests_waiting",
    NUM_REQUESTS_RUNNING: "vllm:num_requests_running",
    KV_CACHE_USAGE_PERC: "vllm:kv_cache_usage_perc",
})
# Per tenant (label tenant: the TOP_TENANTS most served by name, the rest summed as "other").
TENANT_SERVED_TOKENS = PREFIX + "tenant_served_tokens"
TENANT_REQUESTS_WAITING = PREFIX + "tenant_requests_waiting"
TENANT_REQUESTS_RUNNING = PREFIX + "tenant_requests_running"
TENANT_REJECTIONS = PREFIX + "tenant_rejections"  # a gauge (folding moves counts between series)
# Counters (samples end in _total).
NUM_PREEMPTIONS = PREFIX + "num_preemptions"
PREFIX_CACHE_QUERIES = PREFIX + "prefix_cache_queries"
PREFIX_CACHE_HITS = PREFIX + "prefix_cache_hits"
PROMPT_TOKENS = PREFIX + "prompt_tokens"
GENERATION_TOKENS = PREFIX + "generation_tokens"
REQUEST_SUCCESS = PREFIX + "request_success"  # label finished_reason
# Histograms.
TIME_TO_FIRST_TOKEN_SECONDS = PREFIX + "time_to_first_token_seconds"
INTER_TOKEN_LATENCY_SECONDS = PREFIX + "inter_token_latency_seconds"
E2E_REQUEST_LATENCY_SECONDS = PREFIX + "e2e_request_latency_seconds"
REQUEST_QUEUE_TIME_SECONDS = PREFIX + "request_queue_time_seconds"
ITERATION_TOKENS = PREFIX + "iteration_tokens"
# Info gauges (value 1).
ENGINE_CONFIG_INFO = PREFIX + "engine_config_info"
ENGINE_CONFIG_LABELS = ("block_size", "max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching",
                        "long_prefill_token_threshold")
# The server's own limit beside them (``--max-waiting``): a gateway sends a pod no more than it queues.
SERVER_CONFIG_LABELS = ("max_waiting",)
CPU_KERNEL_INFO = PREFIX + "cpu_kernel_info"  # label isa

# The gateway's.
GATEWAY_PREFIX = PREFIX + "gateway_"
GATEWAY_REQUESTS_WAITING = GATEWAY_PREFIX + "requests_waiting"
GATEWAY_ENDPOINT_IN_FLIGHT = GATEWAY_PREFIX + "endpoint_in_flight"  # label endpoint
GATEWAY_ENDPOINT_ROUTABLE = GATEWAY_PREFIX + "endpoint_routable"  # label endpoint
GATEWAY_ENDPOINTS = GATEWAY_PREFIX + "endpoints"
GATEWAY_REQUESTS = GATEWAY_PREFIX + "requests"  # counter, label code
# Demand counters for the autoscaler: tokens of the requests the gateway answered (from their usage).
GATEWAY_PROMPT_TOKENS = GATEWAY_PREFIX + "prompt_tokens"  # counter
GATEWAY_GENERATION_TOKENS = GATEWAY_PREFIX + "generation_tokens"  # counter
GATEWAY_ROUTING_DECISIONS = GATEWAY_PREFIX + "routing_decisions"  # counter, labels policy, reason
GATEWAY_PREFIX_BLOCKS_REQUESTED = GATEWAY_PREFIX + "prefix_blocks_requested"  # counter
GATEWAY_PREFIX_BLOCKS_MATCHED = GATEWAY_PREFIX + "prefix_blocks_matched"  # counter
GATEWAY_RETRIES = GATEWAY_PREFIX + "retries"  # counter, label reason
GATEWAY_REJECTIONS = GATEWAY_PREFIX + "rejections"  # counter, label reason
GATEWAY_TENANT_REQUESTS_WAITING = GATEWAY_PREFIX + "tenant_requests_waiting"  # label tenant (top 20 + other)
GATEWAY_TENANT_SERVED_TOKENS = GATEWAY_PREFIX + "tenant_served_tokens"  # label tenant (top 20 + other)
GATEWAY_TENANT_REQUESTS_IN_FLIGHT = GATEWAY_PREFIX + "tenant_requests_in_flight"  # label tenant (top 20 + other)
GATEWAY_TENANT_REJECTIONS = GATEWAY_PREFIX + "tenant_rejections"  # gauge, label tenant (top 20 + other)
GATEWAY_UPSTREAM_ERRORS_AFTER_FIRST_BYTE = GATEWAY_PREFIX + "upstream_errors_after_first_byte"  # counter
GATEWAY_QUEUE_TIME_SECONDS = GATEWAY_PREFIX + "queue_time_seconds"
GATEWAY_TIME_TO_FIRST_TOKEN_SECONDS = GATEWAY_PREFIX + "time_to_first_token_seconds"
GATEWAY_E2E_REQUEST_LATENCY_SECONDS = GATEWAY_PREFIX + "e2e_request_latency_seconds"

Samples = dict[str, list[tuple[dict[str, str], float]]]


def parse_exposition(text: str) -> Samples:
    """Every sample of Prometheus text exposition: sample name → [(labels, value)]. A family
    exported without samples appears under its name with []. Raises ValueError when the text
    does not parse."""
    from prometheus_client.parser import text_string_to_metric_families  # see the module docstring

    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        samples.setdefault(family.name, [])
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, float(sample.value)))
    return samples


def read_pod_load(text: str, *, pod: str = "", time: float = 0.0, model_name: str | None = None) -> PodLoad:
    """A model server's :class:`PodLoad` from its exposition ``text``, stamped ``pod`` and ``time``.

    Request counts are summed over series and the largest KV-cache use is taken; ``model_name``
    keeps only that label's series. ``engine_config_info``'s ``block_size``, ``max_num_seqs`` and
    ``max_waiting`` are read when present and positive (``max_waiting`` also when 0); the token and request counters and the TTFT histogram's
    buckets when exported (summed over series). Raises ValueError when the text does not parse or a load
    gauge is missing (named).
    """
    samples = parse_exposition(text)

    def values(name: str) -> list[float]:
        return [v for labels, v in samples.get(name, ()) if model_name is None or labels.get(MODEL_NAME) == model_name]

    found = {name: values(name) for name in (NUM_REQUESTS_WAITING, NUM_REQUESTS_RUNNING, KV_CACHE_USAGE_PERC)}
    missing = [name for name, got in found.items() if not got]
    if missing:
        raise ValueError(f"metrics missing: {', '.join(missing)}")
    block_size = max_num_seqs = max_waiting = None
    for labels, _ in samples.get(ENGINE_CONFIG_INFO, ()):
        if model_name is None or labels.get(MODEL_NAME) == model_name:
            block_size = _positive_int(labels.get("block_size")) or block_size
            max_num_seqs = _positive_int(labels.get("max_num_seqs")) or max_num_seqs
            waiting = _positive_int(labels.get("max_waiting"), zero=True)
            max_waiting = max_waiting if waiting is None else waiting

    def total(name: str) -> float | None:
        got = values(name + "_total")
        return sum(got) if got else None

    buckets: dict[float, float] = {}
    for labels, value in samples.get(TIME_TO_FIRST_TOKEN_SECONDS + "_bucket", ()):
        if model_name is None or labels.get(MODEL_NAME) == model_name:
            le = float(labels.get("le", "inf"))
            buckets[le] = buckets.get(le, 0.0) + value
    return PodLoad(pod, time, sum(found[NUM_REQUESTS_WAITING]), sum(found[NUM_REQUESTS_RUNNING]),
                   max(found[KV_CACHE_USAGE_PERC]), block_size, max_num_seqs,
                   total(PROMPT_TOKENS), total(GENERATION_TOKENS), total(REQUEST_SUCCESS),
                   tuple(sorted(buckets.items())), max_waiting)


def read_gateway_load(text: str) -> GatewayLoad:
    """A gateway pod's :class:`GatewayLoad` from its exposition ``text``: requests it holds for
    want of a pod, and requests it has on pods summed over its endpoints (0 with no endpoint,
    None when the family is not exported at all); its demand counters (requests over every
    code, those answered below 400, prompt and generation tokens; None each when not exported).
    Raises ValueError when the text does not parse or the waiting gauge is missing."""
    samples = parse_exposition(text)
    waiting = [v for _, v in samples.get(GATEWAY_REQUESTS_WAITING, ())]
    if not waiting:
        raise ValueError(f"metrics missing: {GATEWAY_REQUESTS_WAITING}")
    in_flight = samples.get(GATEWAY_ENDPOINT_IN_FLIGHT)

    def total(name: str) -> float | None:
        got = samples.get(name + "_total")
        return None if got is None else sum(v for _, v in got)

    def answered() -> float | None:  # the codes whose usage the token counters add
        got = samples.get(GATEWAY_REQUESTS + "_total")
        return None if got is None else sum(
            v for labels, v in got if (_positive_int(labels.get("code")) or 999) < 400)  # odd code: not answered

    return GatewayLoad(sum(waiting), None if in_flight is None else sum(v for _, v in in_flight),
                       requests_total=total(GATEWAY_REQUESTS),
                       prompt_tokens_total=total(GATEWAY_PROMPT_TOKENS),
                       generation_tokens_total=total(GATEWAY_GENERATION_TOKENS),
                       answered_total=answered())


def _positive_int(text: str | None, zero: bool = False) -> int | None:
    """``text`` as an int > 0 (``zero``: ≥ 0), else None."""
    try:
        value = int(text) if text is not None else None
    except ValueError:
        return None
    return value if value is not None and (value > 0 or zero and value == 0) else None
