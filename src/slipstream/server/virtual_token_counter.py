"""The Virtual Token Counter's per-tenant counters (VTC; Sheng et al., "Fairness in Serving Large
Language Models", OSDI '24, Algorithm 2), shared by the engine's scheduling policy
(:mod:`slipstream.server.engine.fairness`) and the gateway's flow control
(:mod:`slipstream.server.gateway.wait_queue`): whoever has been served least goes next. Pure; it
imports nothing but the contract, so the gateway stays free of the engine."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from slipstream.api_types.tenancy import OUTPUT_TOKEN_WEIGHT, PROMPT_TOKEN_WEIGHT, check_tenant_weights

# Counters kept for idle tenants before the oldest are forgotten (tenant ids come from a header:
# memory must not grow with every id ever sent).
MAX_TENANTS = 10_000


def count_for_tenant(counts: dict[str, int], tenant: str, bound: int = MAX_TENANTS) -> None:
    """Add one to ``counts[tenant]`` (e.g. requests refused), keeping the ``bound`` tenants counted
    most recently: the others' counts are forgotten, oldest first."""
    counts[tenant] = counts.pop(tenant, 0) + 1  # re-inserted: the newest
    if len(counts) > bound:
        del counts[next(iter(counts))]


class TokenCounters:
    """VTC's per-tenant counters: the weighted tokens each tenant has been served.

    Args:
        tenant_weights: tenant → weight (> 0); a tenant not named weighs 1.
        prompt_token_weight, output_token_weight: the charge per prompt and per output token.
        max_tenants: counters kept; past it, :meth:`lift` and :meth:`charge` forget idle tenants,
            first those a return would lift anyway (at or below the least backlogged counter),
            then the oldest.
        active: the tenants with requests now (waiting or running), never forgotten; None: the
            ones :meth:`lift` is told of only.

    Raises:
        ValueError: a weight ≤ 0.
    """

    def __init__(self, tenant_weights: Mapping[str, float] | None = None,
                 prompt_token_weight: float = PROMPT_TOKEN_WEIGHT, output_token_weight: float = OUTPUT_TOKEN_WEIGHT,
                 max_tenants: int = MAX_TENANTS, active: Callable[[], Iterable[str]] | None = None):
        check_tenant_weights(tenant_weights, "tenant weights")
        self.tenant_weights = dict(tenant_weights or {})
        self.prompt_token_weight, self.output_token_weight = prompt_token_weight, output_token_weight
        self.counters: dict[str, float] = {}
        self.max_tenants = max_tenants
        self.active = active

    def weight(self, tenant: str) -> float:
        return self.tenant_weights.get(tenant, 1.0)

    def shares(self, slots: float, tenants: Iterable[str]) -> dict[str, float]:
        """Each of ``tenants``' share of ``slots`` (running seats, in-flight requests) split by
        weight: ``slots × weight ÷ the tenants' weights' sum``; a float, not rounded."""
        tenants = set(tenants)
        total = sum(self.weight(t) for t in tenants)
        return {t: slots * self.weight(t) / total for t in tenants}

    def served(self, tenant: str) -> float:
        """``tenant``'s counter: weighted tokens served, divided by its weight."""
        return self.counters.get(tenant, 0.0)

    def charge(self, tenant: str, prompt_tokens: int, output_tokens: int) -> None:
        """Count ``prompt_tokens`` and ``output_tokens`` served to ``tenant``."""
        cost = prompt_tokens * self.prompt_token_weight + output_tokens * self.output_token_weight
        self.counters[tenant] = self.served(tenant) + cost / self.weight(tenant)
        if len(self.counters) > self.max_tenants:
            active = set(self.active()) if self.active is not None else set()
            self._forget_idle(active | {tenant}, None)

    def lift(self, tenant: str, backlogged: Iterable[str]) -> None:
        """``tenant`` becomes backlogged: its counter rises to the least of the ``backlogged``
        tenants' (none: unchanged), so time it spent idle is no credit."""
        backlogged = set(backlogged)
        floor = min((self.served(t) for t in backlogged if t != tenant), default=None)
        if floor is not None and floor > self.served(tenant):
            self.counters[tenant] = floor
        if len(self.counters) > self.max_tenants:
            self._forget_idle(backlogged | {tenant}, floor)

    def _forget_idle(self, active: set[str], floor: float | None) -> None:
        idle = [t for t in self.counters if t not in active]
        for t in idle:  # these would be lifted to the floor on return: nothing is lost
            if floor is not None and self.counters[t] <= floor:
                del self.counters[t]
        left = [t for t in idle if t in self.counters]  # in insertion order: the oldest first
        for t in left[:max(0, len(self.counters) - self.max_tenants)]:
            del self.counters[t]
