"""Per-tenant token rate limits of the gateway (``--tenant-token-limits``): a token bucket per
limited tenant (pure; the clock is passed in).

A tenant limited to ``L`` tokens per minute has a bucket that holds at most ``L`` tokens (a
minute's worth: a tenant idle for a minute may spend it at once) and refills at ``L / 60``
tokens per second. A request is admitted while its tenant's bucket is not in debt (below zero); it
is charged its estimated prompt tokens when admitted and, when its response ends, the prompt
tokens the pod counted instead of the estimate plus the tokens it generated. So one long answer
can take the bucket below zero, and the tenant's next requests are refused (429, ``Retry-After``:
the seconds until the debt is paid) — the tenant gets ``L`` tokens a minute on average,
whatever the size of its requests. A request the gateway does not get served (queue full,
deadline, no pod answered) is given its estimate back. Tenants not listed are not limited.

Each gateway replica keeps its own buckets (the operator gives each replica an equal part of a
tenant's ``tokensPerMinute``).
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from slipstream.api_types.tenancy import check_tenant_token_limits

SECONDS_PER_MINUTE = 60.0


@dataclass(slots=True)
class _Bucket:
    tokens: float  # may be negative: charges past the limit, paid back by the refill
    at: float  # when ``tokens`` was last brought up to date (seconds, the caller's clock)


class TokenLimits:
    """Token buckets of the tenants in ``limits`` (tenant → tokens per minute, each ≥ 1).

    Raises:
        ValueError: a limit below 1 (:func:`~slipstream.api_types.tenancy.check_tenant_token_limits`).
    """

    def __init__(self, limits: Mapping[str, int] | None):
        check_tenant_token_limits(limits)
        self.limits = dict(limits or {})
        self._buckets: dict[str, _Bucket] = {}

    def __bool__(self) -> bool:
        return bool(self.limits)

    def _bucket(self, tenant: str, now: float) -> _Bucket | None:
        limit = self.limits.get(tenant)
        if limit is None:
            return None
        bucket = self._buckets.get(tenant)
        if bucket is None:
            bucket = self._buckets[tenant] = _Bucket(float(limit), now)
        elif now > bucket.at:
            bucket.tokens = min(float(limit), bucket.tokens + (now - bucket.at) * limit / SECONDS_PER_MINUTE)
            bucket.at = now
        return bucket

    def retry_after(self, tenant: str, now: float) -> int | None:
        """None when ``tenant`` may send a request at ``now`` (seconds); else the whole seconds
        (≥ 1) until its bucket's debt is paid."""
        bucket = self._bucket(tenant, now)
        if bucket is None or bucket.tokens >= 0:
            return None
        return max(1, math.ceil(-bucket.tokens / (self.limits[tenant] / SECONDS_PER_MINUTE)))

    def charge(self, tenant: str, tokens: float, now: float) -> None:
        """Take ``tokens`` from ``tenant``'s bucket (negative: give them back, up to the limit);
        nothing for a tenant without a limit."""
        bucket = self._bucket(tenant, now)
        if bucket is not None:
            bucket.tokens = min(float(self.limits[tenant]), bucket.tokens - tokens)

    def remaining(self, tenant: str, now: float) -> float | None:
        """Tokens left in ``tenant``'s bucket at ``now`` (negative: owed); None without a limit."""
        bucket = self._bucket(tenant, now)
        return None if bucket is None else bucket.tokens
