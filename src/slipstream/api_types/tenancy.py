"""Tenants and priorities that the gateway and the pods read the same way: the headers that carry
them (tenant, criticality), the default tenant, the scheduling policies ``slipstream serve`` offers and the weights of
the Virtual Token Counter (VTC, Sheng et al., "Fairness in Serving Large Language Models",
OSDI '24), which charges a tenant for the prompt and output tokens it was served."""
from __future__ import annotations

from typing import Literal

from pydantic import model_validator

from .schema import SpecModel, spec_field

# llm-d's name for the header that says whose request it is; the gateway forwards it to the pods.
FAIRNESS_ID_HEADER = "x-gateway-inference-fairness-id"
# A request without the header belongs to this tenant (with one tenant, fair is first-come).
DEFAULT_TENANT = "default"

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


def parse_tenant_weights(text: str) -> dict[str, float]:
    """``"team-a=3,team-b=1"`` → ``{"team-a": 3.0, "team-b": 1.0}``; ``""`` → ``{}`` (every
    tenant weight 1). A tenant with weight 3 is served three times the tokens of a weight-1
    tenant when both are backlogged.

    Raises:
        ValueError: an item that is not ``NAME=WEIGHT`` with a non-empty name and a finite
            weight > 0, or a name given twice.
    """
    weights: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        name = name.strip()
        try:
            weight = float(value)
        except ValueError:
            weight = float("nan")
        if not sep or not name or not 0 < weight < float("inf"):
            raise ValueError(f"tenant weights are NAME=WEIGHT items with a weight > 0, separated by commas; "
                             f"got {item!r}")
        if name in weights:
            raise ValueError(f"tenant {name!r} is given a weight twice")
        weights[name] = weight
    return weights


class TenantSpec(SpecModel):
    """One of ``spec.fairness.tenants``: a tenant (the value of its requests' fairness-id
    header) and its weight."""

    name: str = spec_field(..., min_length=1, max_length=253, pattern=r"^[^,=]+$", rule="a name without ',' or '='",
                           description=f"The tenant: the {FAIRNESS_ID_HEADER} header of its requests.")
    weight: float = spec_field(1.0, gt=0, description="Its share of the tokens served when tenants "
                                                      "compete (a tenant not listed weighs 1).")


class FairnessSpec(SpecModel):
    """``spec.fairness``: how the pods' engines and the gateway share capacity between tenants."""

    policy: Literal[SCHEDULING_POLICIES] = spec_field(  # type: ignore[valid-type]
        DEFAULT_SCHEDULING_POLICY,
        description="fair (the tokens served are shared between tenants by weight; first-come with "
                    "one tenant), priority (requests' priority field, lower sooner) or fcfs.")
    tenants: tuple[TenantSpec, ...] = spec_field(
        (), strict=False, description="Tenants' weights (a tenant not listed weighs 1).",
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
        return ",".join(f"{t.name}={t.weight:g}" for t in self.tenants) or None
