"""Tenants and priorities that the gateway and the pods read the same way: the headers that carry
them (tenant, criticality), the default tenant, the scheduling policies ``slipstream serve`` offers and the weights of
the Virtual Token Counter (VTC, Sheng et al., "Fairness in Serving Large Language Models",
OSDI '24), which charges a tenant for the prompt and output tokens it was served."""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Literal

from pydantic import model_validator

from .schema import CelRule, SpecModel, spec_field

# llm-d's name for the header that says whose request it is; the gateway forwards it to the pods.
FAIRNESS_ID_HEADER = "x-gateway-inference-fairness-id"
# A request without the header belongs to this tenant (with one tenant, fair is first-come).
DEFAULT_TENANT = "default"

# A tenant name in --tenant-weights and spec.fairness: no separator, no surrounding space (the
# parser strips it, so ' a' and 'a' would be one tenant).
TENANT_NAME_PATTERN = r"^[^,=\s]([^,=]*[^,=\s])?$"
# Weights within these bounds (a weight near 0 makes a counter overflow to inf).
MIN_TENANT_WEIGHT, MAX_TENANT_WEIGHT = 0.001, 1000.0

# A tenant's tokens-per-minute limit at most this (a billion a minute: no real limit is larger).
MAX_TOKENS_PER_MINUTE = 10**9

# Tenants listed in spec.fairness at most (bounds the cost of the CRD's CEL rules over them).
MAX_TENANTS = 1000

# Longest tenant id accepted (as a CRD tenant name): ids come from a header anyone can set.
MAX_TENANT_LENGTH = 253


def tenant_of(header: str | None) -> str:
    """The tenant a request's fairness-id header names: :data:`DEFAULT_TENANT` when absent or
    blank; bytes that are not UTF-8 (an HTTP server hands them over as surrogate escapes) become
    U+FFFD, so the id can be a metric label.

    Raises:
        ValueError: an id longer than :data:`MAX_TENANT_LENGTH` characters.
    """
    value = (header or "").strip()
    if not value:
        return DEFAULT_TENANT
    value = value.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    if len(value) > MAX_TENANT_LENGTH:
        raise ValueError(f"the {FAIRNESS_ID_HEADER} header must be at most {MAX_TENANT_LENGTH} characters, "
                         f"got {len(value)}")
    return value


# The usage of a response that is not streamed, as a header beside its body (JSON of the body's
# ``usage``): the gateway charges tenants and counts demand from it without reading the body, whose
# end may be fields the client echoes (the Responses API's metadata). Streams end with it instead.
USAGE_HEADER = "x-slipstream-usage"

# How much a request may be shed under overload (llm-d's criticality): sheddable ones are refused
# (429) as soon as no model server can take them, critical ones are dispatched before the others
# and never refused while a standard one waits. The gateway reads it; the pods ignore it.
CRITICALITY_HEADER = "x-slipstream-criticality"
CRITICALITIES = ("critical", "standard", "sheddable")  # dispatch order
DEFAULT_CRITICALITY = "standard"

# fcfs: arrival order; priority: the request's ``priority`` (lower runs sooner, vLLM's), then arrival;
# fair: VTC across tenants, priority then arrival within a tenant.
SCHEDULING_POLICIES = ("fcfs", "priority", "fair")
DEFAULT_SCHEDULING_POLICY = "fair"

# VTC's charge per token served: a prompt token (prefill) and an output token (decode), in the
# paper's default ratio (output tokens cost about twice as much compute per token in a batch).
PROMPT_TOKEN_WEIGHT = 1.0
OUTPUT_TOKEN_WEIGHT = 2.0


# Per-tenant metrics name this many tenants (the most served) and sum the rest under OTHER_TENANT:
# ids come from a header, and a label value per id would grow Prometheus without bound.
TOP_TENANTS = 20
OTHER_TENANT = "other"


def fold_tenants(columns: Sequence[Mapping[str, float]], top: int = TOP_TENANTS) -> dict[str, list[float]]:
    """Rows of per-tenant metrics with bounded cardinality: tenant → one value per column (a
    missing one 0). The ``top`` tenants ranked by the columns in order (the first, e.g. tokens
    served, decides; ties by the next, then by name) keep their names; the others are summed
    under :data:`OTHER_TENANT` (a tenant called that is summed with them)."""
    tenants = set().union(*columns)
    ranked = sorted(tenants, key=lambda t: (*(-c.get(t, 0.0) for c in columns), t))
    named = set(ranked[:top])
    rows: dict[str, list[float]] = {}
    for tenant in ranked:
        row = rows.setdefault(tenant if tenant in named else OTHER_TENANT, [0.0] * len(columns))
        for i, column in enumerate(columns):
            row[i] += column.get(tenant, 0.0)
    return rows


def check_tenant_weights(weights: Mapping[str, float] | None, name: str = "tenant_weights") -> None:
    """The one check of a weights mapping given in code (flags go through
    :func:`parse_tenant_weights`).

    Raises:
        ValueError: a weight that is not > 0, naming ``name``.
    """
    if any(not w > 0 for w in (weights or {}).values()):
        raise ValueError(f"{name} must be > 0, got {dict(weights)}")


def _parse_tenant_values(text: str, what: str, parse: Callable[[str], float | None], expected: str,
                         ) -> dict[str, float]:
    """``NAME=VALUE`` items separated by commas → {name: parse(value)}; ``parse`` gives None for a
    value out of range. Raises ValueError naming ``what`` and ``expected``, or a name given twice."""
    values: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, raw = item.partition("=")
        name = name.strip()
        value = parse(raw.strip()) if sep else None
        if not name or value is None:
            raise ValueError(f"tenant {what} are NAME={expected} items separated by commas; got {item!r}")
        if len(name) > MAX_TENANT_LENGTH:
            raise ValueError(f"a tenant name is at most {MAX_TENANT_LENGTH} characters (the longest "
                             f"{FAIRNESS_ID_HEADER} header accepted); got {len(name)}")
        if name in values:
            raise ValueError(f"tenant {name!r} is named twice in the {what}")
        values[name] = value
    return values


def _weight(text: str) -> float | None:
    try:
        weight = float(text)
    except ValueError:
        return None
    return weight if MIN_TENANT_WEIGHT <= weight <= MAX_TENANT_WEIGHT else None


def _tokens_per_minute(text: str) -> int | None:
    if not (text.isascii() and text.isdigit()) or len(text) > len(str(MAX_TOKENS_PER_MINUTE)):
        return None
    return int(text) if 1 <= int(text) <= MAX_TOKENS_PER_MINUTE else None


def parse_tenant_weights(text: str) -> dict[str, float]:
    """``"team-a=3,team-b=1"`` → ``{"team-a": 3.0, "team-b": 1.0}``; ``""`` → ``{}`` (every
    tenant weight 1). A tenant with weight 3 is served three times the tokens of a weight-1
    tenant when both are backlogged.

    Raises:
        ValueError: an item that is not ``NAME=WEIGHT`` with a non-empty name and a finite
            weight > 0, or a name given twice.
    """
    return _parse_tenant_values(text, "weights", _weight,
                                f"WEIGHT (from {MIN_TENANT_WEIGHT:g} to {MAX_TENANT_WEIGHT:g})")


def check_tenant_token_limits(limits: Mapping[str, int] | None, name: str = "tenant_token_limits") -> None:
    """The one check of a token-limits mapping given in code (flags go through
    :func:`parse_tenant_token_limits`).

    Raises:
        ValueError: a limit that is not an integer ≥ 1, naming ``name``.
    """
    if any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in (limits or {}).values()):
        raise ValueError(f"{name} must be integers >= 1 (tokens per minute), got {dict(limits)}")


def parse_tenant_token_limits(text: str) -> dict[str, int]:
    """``"team-a=100000,team-b=20000"`` → tenant → tokens per minute (prompt and generated
    tokens) the gateway lets it use; ``""`` → ``{}`` (no limits). Tenants not named are not limited.

    Raises:
        ValueError: an item that is not ``NAME=TOKENS`` with a non-empty name and a whole number
            from 1 to :data:`MAX_TOKENS_PER_MINUTE`, or a name given twice.
    """
    return _parse_tenant_values(text, "token limits", _tokens_per_minute,  # type: ignore[return-value]
                                f"TOKENS_PER_MINUTE (a whole number from 1 to {MAX_TOKENS_PER_MINUTE})")


# On the spec's node: token limits are the gateway's, so they need it (reads two siblings).
TOKEN_LIMITS_NEED_GATEWAY_MESSAGE = ("spec.fairness.tenants[].tokensPerMinute needs spec.routing.enabled: the gateway "
                                     "enforces it")
TOKEN_LIMITS_NEED_GATEWAY_RULE = CelRule(
    "!has(self.fairness) || !has(self.fairness.tenants) || "
    "!self.fairness.tenants.exists(t, has(t.tokensPerMinute)) || "
    "!has(self.routing) || !has(self.routing.enabled) || self.routing.enabled",
    TOKEN_LIMITS_NEED_GATEWAY_MESSAGE)


class TenantSpec(SpecModel):
    """One of ``spec.fairness.tenants``: a tenant (the value of its requests' fairness-id
    header), its weight and, optionally, the tokens per minute the gateway lets it use."""

    name: str = spec_field(..., min_length=1, max_length=MAX_TENANT_LENGTH, pattern=TENANT_NAME_PATTERN,
                           rule="a name without ',' or '=' that neither starts nor ends with a space",
                           description=f"The tenant: the {FAIRNESS_ID_HEADER} header of its requests.")
    weight: float = spec_field(1.0, ge=MIN_TENANT_WEIGHT, le=MAX_TENANT_WEIGHT,
                               description="Its share of the tokens served when tenants compete (a "
                                           "tenant not listed weighs 1).")
    tokens_per_minute: int | None = spec_field(
        None, ge=1, le=MAX_TOKENS_PER_MINUTE,
        description="Prompt and generated tokens a minute the gateway lets it use (a token bucket of a "
                    "minute's worth, split evenly between the gateway replicas); past it its requests "
                    "get 429 with Retry-After. Unset: no limit. Needs spec.routing.enabled.")


class FairnessSpec(SpecModel):
    """``spec.fairness``: how the pods' engines and the gateway share capacity between tenants."""

    policy: Literal[SCHEDULING_POLICIES] = spec_field(  # type: ignore[valid-type]
        DEFAULT_SCHEDULING_POLICY,
        description="fair (the tokens served are shared between tenants by weight; first-come with "
                    "one tenant), priority (requests' priority field, lower sooner) or fcfs.")
    tenants: tuple[TenantSpec, ...] = spec_field(
        (), strict=False, max_length=MAX_TENANTS,
        description="Tenants' weights and token limits (a tenant not listed weighs 1, unlimited).",
        schema={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]})

    @model_validator(mode="after")
    def _unique_names(self) -> "FairnessSpec":
        names = [t.name for t in self.tenants]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"tenants must be listed once each; repeated: {', '.join(repeated)}")
        return self

    def weights_argument(self) -> str | None:
        """``--tenant-weights``' value (``a=3,b=1``), or None with no tenant listed."""
        return ",".join(f"{t.name}={t.weight!r}".removesuffix(".0") for t in self.tenants) or None

    def token_limits_argument(self, gateway_replicas: int) -> str | None:
        """The gateway's ``--tenant-token-limits`` value, each tenant's ``tokensPerMinute`` split
        evenly between ``gateway_replicas`` (rounded up, so the replicas together allow the spec's
        limit plus less than one token a replica); None when no tenant is limited."""
        return ",".join(f"{t.name}={-(-t.tokens_per_minute // gateway_replicas)}"
                        for t in self.tenants if t.tokens_per_minute is not None) or None

    @property
    def token_limited(self) -> bool:
        return any(t.tokens_per_minute is not None for t in self.tenants)
