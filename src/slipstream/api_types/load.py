"""One pod's load and the gateway's, as read from their ``/metrics``: the samples the gateway
routes by, the operator's autoscaler decides on and the simulator produces.

:class:`PodLoad` is the one type for a pod's scraped load (the gateway, the operator's scraper and
the simulator's virtual replicas all make it). The gateway's router keeps its own view,
``slipstream.server.gateway.routing.EndpointLoad``, beside it rather than in it: the router adds
what no scrape holds (its own in-flight count, fresher than any scrape, and the capacity its
settings give the pod) and the simulator builds it with no scrape at all.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PodLoad:
    """One pod's gauges read at one scrape (:func:`~slipstream.api_types.metrics.read_pod_load`).

    pod: the pod's name (the gateway uses the endpoint's base URL).
    time: when it was read, seconds on the reader's clock.
    num_requests_waiting / num_requests_running: requests (``slipstream:num_requests_*``, summed
        over ``model_name`` series).
    kv_cache_usage_perc: KV-cache utilization, 0..1 (``slipstream:kv_cache_usage_perc``, the
        largest over series).
    block_size / max_num_seqs: the engine's settings from ``slipstream:engine_config_info``;
        None when the pod does not export it (older pods, or not loaded yet).
    prompt_tokens_total / generation_tokens_total / requests_total: the pod's counters since it
        started (tokens prefilled and generated, requests finished); None when not exported.
    ttft_buckets: the time-to-first-token histogram, cumulative: ((le seconds, count), ...)
        ascending, ending with +inf; () when not exported.
    max_waiting: requests the server queues beyond ``max_num_seqs`` before it answers 429 (its
        ``--max-waiting``, from ``engine_config_info``); None when not exported.
    """

    pod: str
    time: float
    num_requests_waiting: float
    num_requests_running: float
    kv_cache_usage_perc: float
    block_size: int | None = None
    max_num_seqs: int | None = None
    prompt_tokens_total: float | None = None
    generation_tokens_total: float | None = None
    requests_total: float | None = None
    ttft_buckets: tuple[tuple[float, float], ...] = ()
    max_waiting: int | None = None


@dataclass(frozen=True, slots=True)
class GatewayLoad:
    """The gateway's gauges (:func:`~slipstream.api_types.metrics.read_gateway_load`), of one
    gateway pod or summed over those that answered one tick.

    waiting: requests held in the gateway for want of a ready pod
        (``slipstream:gateway_requests_waiting``): the demand signal at zero replicas.
    in_flight: requests the gateway has sent to pods and not finished
        (``slipstream:gateway_endpoint_in_flight``, all endpoints); None when not exported.
    complete: every ready gateway pod answered; a silent one may hold requests, so the
        autoscaler never scales to zero on an incomplete reading.
    requests_total / prompt_tokens_total / generation_tokens_total: the demand counters
        (``slipstream:gateway_requests_total`` over all codes, ``..._prompt_tokens_total``,
        ``..._generation_tokens_total``) since the gateway pods started, summed; None when
        not exported (the autoscaler then reads demand from the model pods' counters).
    answered_total: ``slipstream:gateway_requests_total`` of the codes below 400, the answers
        whose usage the token counters add (a 429 or a client that left counts as an arrival
        but adds no tokens); None when not exported.
    """

    waiting: float
    in_flight: float | None = None
    complete: bool = True
    requests_total: float | None = None
    prompt_tokens_total: float | None = None
    generation_tokens_total: float | None = None
    answered_total: float | None = None
