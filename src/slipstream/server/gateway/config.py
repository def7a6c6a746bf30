"""The gateway's settings: one dataclass with defaults, checked once at construction."""
from __future__ import annotations

from dataclasses import dataclass, field

from slipstream.api_types.tenancy import (DEFAULT_SCHEDULING_POLICY, SCHEDULING_POLICIES, check_tenant_token_limits,
                                          check_tenant_weights)

from .routing import DEFAULT_POLICY, POLICIES, Weights


def normalize_url(url: str) -> str:
    """An endpoint's name: its base URL without a trailing slash (``http://10.0.0.7:8000``).
    Raises ValueError for anything but an http(s) URL."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")) or len(url.split("://", 1)[1]) == 0:
        raise ValueError(f"endpoint must be an http(s) base URL such as http://127.0.0.1:8000, got {url!r}")
    return url


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """What ``slipstream gateway`` runs with (``slipstream gateway --help`` has each flag).

    endpoints: base URLs of the pods (static ``--endpoint`` flags), or
    service / namespace: the headless Service whose EndpointSlices list the pods (in a cluster;
        exclusive with ``endpoints``), with ``target_port`` or the port named ``target_port_name``.
    policy / weights: the routing policy and its score weights by scorer name (:mod:`.routing`;
        a mapping is made :class:`~.routing.Weights`).
    max_queue: most requests held in the gateway while no endpoint can take them; one more gets 429.
    queue_timeout: seconds a request may wait there (its deadline, from arrival); then 503.
    max_in_flight: requests in flight per endpoint before it counts as full; None: the pod's
        ``max_num_seqs`` plus ``queue_headroom`` when the pod reports it, else no limit.
    queue_headroom: requests queued on a pod beyond its ``max_num_seqs``; None: ``max_num_seqs``.
    scrape_interval / scrape_timeout: seconds between reads of each pod's /metrics, and the most
        one read may take.
    load_timeout: seconds without a good scrape after which an endpoint gets no new requests.
    connect_timeout: seconds to open a connection to a pod (a failure is retried elsewhere).
    max_tries: most endpoints one request is sent to (connection errors and 503 before the first
        byte move it to another).
    retry_after: seconds in the ``Retry-After`` of a 429 or 503 the gateway itself answers.
    max_request_bytes: largest request body accepted (413 past it).
    prefix_capacity / block_index_capacity / sessions / max_prompt_blocks: bounds of the routing
        state (prefix table entries, KV-event index entries, session keys, blocks hashed per prompt).
    shutdown_timeout: seconds a stopping gateway gives in-flight requests.
    tenant_weights: tenant → share of the dispatch from the gateway's queue (default 1 each), as
        the pods' ``--tenant-weights``.
    tenant_token_limits: tenant → tokens per minute (prompt and generated) it may use through this
        gateway (:mod:`.token_limits`); a tenant not named is not limited.
    scheduling_policy: ``fair`` (between tenants) or first-come (``fcfs``, and ``priority``,
        whose order the pods apply) for the requests the gateway holds, as the pods' policy.
    api_key: the pods' ``--api-key``, for the gateway's own requests to them (tokenizer files,
        KV events); clients' requests are forwarded with their own ``Authorization``.
    """

    endpoints: tuple[str, ...] = ()
    service: str | None = None
    namespace: str = "default"
    target_port: int | None = None
    target_port_name: str | None = None
    policy: str = DEFAULT_POLICY
    weights: Weights = field(default_factory=Weights)
    max_queue: int = 1000
    queue_timeout: float = 300.0
    max_in_flight: int | None = None
    queue_headroom: int | None = None
    scrape_interval: float = 0.25
    scrape_timeout: float = 1.0
    load_timeout: float = 2.0
    connect_timeout: float = 3.0
    max_tries: int = 3
    retry_after: int = 5
    max_request_bytes: int = 8 << 20
    prefix_capacity: int = 200_000
    block_index_capacity: int = 2_000_000
    sessions: int = 100_000
    max_prompt_blocks: int = 512
    shutdown_timeout: float = 30.0
    api_key: str | None = field(default=None, repr=False)
    tenant_weights: dict[str, float] | None = None
    scheduling_policy: str = DEFAULT_SCHEDULING_POLICY
    tenant_token_limits: dict[str, int] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "endpoints", tuple(dict.fromkeys(normalize_url(u) for u in self.endpoints)))
        if self.service is not None and self.endpoints:
            raise ValueError("give either endpoints (--endpoint) or a Service (--service), not both")
        if self.target_port is not None and not 0 < self.target_port < 65536:
            raise ValueError(f"target_port must be a TCP port, got {self.target_port}")
        if not isinstance(self.weights, Weights):
            object.__setattr__(self, "weights", Weights(self.weights))
        if self.policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        for name in ("max_queue", "max_prompt_blocks", "sessions", "prefix_capacity", "block_index_capacity"):
            if getattr(self, name) < 0 or (name != "max_queue" and getattr(self, name) < 1):
                raise ValueError(f"{name} must be >= {0 if name == 'max_queue' else 1}, got {getattr(self, name)}")
        if self.max_tries < 1:
            raise ValueError(f"max_tries must be >= 1, got {self.max_tries}")
        if self.max_in_flight is not None and self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1 (or unset for the pod's own limit), got {self.max_in_flight}")
        if self.queue_headroom is not None and self.queue_headroom < 0:
            raise ValueError(f"queue_headroom must be >= 0, got {self.queue_headroom}")
        for name in ("queue_timeout", "scrape_interval", "scrape_timeout", "load_timeout", "connect_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        for name in ("shutdown_timeout", "retry_after"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 seconds, got {getattr(self, name)}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                             f"got {self.scheduling_policy!r}")
        check_tenant_weights(self.tenant_weights)
        check_tenant_token_limits(self.tenant_token_limits)
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {self.max_request_bytes}")

    @property
    def upstream_headers(self) -> dict[str, str]:
        """Headers of the gateway's own requests to the pods."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def capacity(self, max_num_seqs: int | None) -> int | None:
        """Requests in flight on one endpoint before it is full: ``max_in_flight`` when set, else
        the pod's ``max_num_seqs`` plus headroom (``max_num_seqs`` again by default), else None."""
        if self.max_in_flight is not None:
            return self.max_in_flight
        if max_num_seqs is None:
            return None
        return max_num_seqs + (self.queue_headroom if self.queue_headroom is not None else max_num_seqs)
