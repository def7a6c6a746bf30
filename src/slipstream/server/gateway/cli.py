"""``slipstream gateway``: the OpenAI-compatible routing proxy in front of a service's pods."""
from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path

from slipstream.api_types.tenancy import SCHEDULING_POLICIES

from ..cli import HelpFormatter, byte_size, configure_logging
from ..cli_types import int_at_least, non_negative_float, positive_float, tenant_token_limits, tenant_weights

from .config import GatewayConfig
from .routing import DEFAULT_POLICY, POLICIES
from .routing.weights import add_weight_flags, weights_from_args

SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def gateway_parser() -> argparse.ArgumentParser:
    d = GatewayConfig()
    p = argparse.ArgumentParser(
        prog="slipstream gateway",
        description="Route OpenAI-compatible requests to model servers (slipstream serve pods): prefix-cache- "
                    "and load-aware, holding requests while no server can take them (scale from zero). "
                    "Serves /health, /ready and /metrics itself and proxies every other path.",
        formatter_class=HelpFormatter)
    e = p.add_argument_group("endpoints")
    e.add_argument("--endpoint", dest="endpoints", action="append", default=[], metavar="URL",
                   help="base URL of a model server, e.g. http://10.0.0.7:8000; repeat for each "
                        "(by default none: requests "
                        "wait until one is added)")
    e.add_argument("--service", default=None, metavar="NAME",
                   help="in a cluster: route to the ready endpoints of this Service's EndpointSlices (watched; "
                        "the gateway's service account needs get/list/watch on endpointslices)")
    e.add_argument("--namespace", default=None,
                   help="the Service's namespace (default: the gateway pod's own, else 'default')")
    e.add_argument("--target-port-name", default=None, metavar="NAME",
                   help="the EndpointSlice port to use, by name (default: the slice's only port)")
    e.add_argument("--target-port", type=int, default=None, metavar="PORT",
                   help="the port to use on every endpoint address, overriding the slices' ports")
    r = p.add_argument_group("routing")
    r.add_argument("--routing", default=DEFAULT_POLICY, choices=POLICIES,
                   help="round-robin; least-loaded; prefix (the gateway's own table of where it sent each prompt "
                        "block); kv-events (the pods' KV-cache events: what each pod really holds)")
    add_weight_flags(r)
    q = p.add_argument_group("queue and limits")
    q.add_argument("--max-queue", type=int_at_least(0), default=d.max_queue,
                   help="most requests held while no endpoint can take them; one more gets 429")
    q.add_argument("--queue-timeout", type=positive_float, default=d.queue_timeout,
                   help="seconds a request may wait for an endpoint before a 503 with Retry-After "
                        "(at least the pods' startup time, for scale from zero)")
    q.add_argument("--max-in-flight", type=int_at_least(1), default=None,
                   help="requests in flight per endpoint before it is full (default: the pod's max_num_seqs "
                        "plus --queue-headroom, when the pod reports it; else no limit)")
    q.add_argument("--queue-headroom", type=int_at_least(0), default=None,
                   help="requests queued on a pod beyond its max_num_seqs before it is full (default: max_num_seqs)")
    q.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default=d.scheduling_policy,
                   help="the order of the requests held while every model server is busy: 'fair' between tenants "
                        "(the x-gateway-inference-fairness-id header), else first-come; as the pods' policy")
    q.add_argument("--tenant-weights", type=tenant_weights, default=None, metavar="NAME=W,...",
                   help="tenants' shares (the x-gateway-inference-fairness-id header) when requests wait for a "
                        "model server, e.g. 'team-a=3,team-b=1' (a tenant not named weighs 1); give the pods the same")
    q.add_argument("--tenant-token-limits", type=tenant_token_limits, default=None, metavar="NAME=TPM,...",
                   help="tokens a minute (prompt and generated) a tenant may use through this gateway, e.g. "
                        "'team-a=100000,batch=20000'; past it the tenant's requests get 429 with Retry-After "
                        "(a token bucket of a minute's worth; a tenant not named is not limited)")
    q.add_argument("--max-tries", type=int_at_least(1), default=d.max_tries,
                   help="most endpoints one request is sent to (a connection error or 503 before the first "
                        "byte moves it on; never after)")
    q.add_argument("--retry-after", type=int_at_least(0), default=d.retry_after,
                   help="seconds in the Retry-After of the gateway's own 429 and 503")
    q.add_argument("--max-request-bytes", type=byte_size, default=d.max_request_bytes,
                   help="largest request body accepted; larger ones get 413")
    q.add_argument("--max-prompt-blocks", type=int_at_least(1), default=d.max_prompt_blocks,
                   help="most leading prompt blocks hashed for prefix routing")
    q.add_argument("--prefix-capacity", type=int_at_least(1), default=d.prefix_capacity,
                   help="block hashes the prefix policy's table keeps (LRU)")
    q.add_argument("--block-index-capacity", type=int_at_least(1), default=d.block_index_capacity,
                   help="(block, endpoint) entries the kv-events index keeps")
    l = p.add_argument_group("load and timeouts")
    l.add_argument("--scrape-interval", type=positive_float, default=d.scrape_interval,
                   help="seconds between reads of each endpoint's /metrics")
    l.add_argument("--scrape-timeout", type=positive_float, default=d.scrape_timeout,
                   help="seconds one /metrics read may take")
    l.add_argument("--load-timeout", type=positive_float, default=d.load_timeout,
                   help="seconds without a good /metrics read after which an endpoint gets no new requests")
    l.add_argument("--connect-timeout", type=positive_float, default=d.connect_timeout,
                   help="seconds to connect to an endpoint before trying another")
    h = p.add_argument_group("HTTP server")
    h.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 in a pod)")
    h.add_argument("--port", type=int, default=8080, help="port to listen on")
    h.add_argument("--shutdown-timeout", type=non_negative_float, default=d.shutdown_timeout,
                   help="seconds a stopping gateway (SIGTERM) gives in-flight requests")
    h.add_argument("--api-key", default=os.environ.get("SLIPSTREAM_API_KEY"),
                   help="the pods' --api-key, sent with the gateway's own requests to them (tokenizer files, KV "
                        "events); clients' requests keep their own Authorization header. "
                        "By default $SLIPSTREAM_API_KEY; unset means none")
    h.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def own_namespace() -> str:
    """The namespace of the pod this runs in (its service account's), else ``default``."""
    try:
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip() or "default"
    except OSError:
        return "default"


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    """The :class:`GatewayConfig` of parsed :func:`gateway_parser` options. Raises ValueError."""
    weights = weights_from_args(args)
    return GatewayConfig(
        endpoints=tuple(args.endpoints), service=args.service, namespace=args.namespace or own_namespace(),
        target_port=args.target_port, target_port_name=args.target_port_name, policy=args.routing, weights=weights, max_queue=args.max_queue,
        queue_timeout=args.queue_timeout, max_in_flight=args.max_in_flight, queue_headroom=args.queue_headroom,
        scrape_interval=args.scrape_interval, scrape_timeout=args.scrape_timeout, load_timeout=args.load_timeout,
        connect_timeout=args.connect_timeout, max_tries=args.max_tries,
        retry_after=args.retry_after,
        max_request_bytes=args.max_request_bytes, prefix_capacity=args.prefix_capacity,
        block_index_capacity=args.block_index_capacity, max_prompt_blocks=args.max_prompt_blocks,
        shutdown_timeout=args.shutdown_timeout, api_key=args.api_key or None, tenant_weights=args.tenant_weights,
        scheduling_policy=args.scheduling_policy, tenant_token_limits=args.tenant_token_limits)


def main(argv: list[str]) -> int:
    parser = gateway_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    configure_logging(args.log_level)
    from .app import serve
    return asyncio.run(serve(config, args.host, args.port))
