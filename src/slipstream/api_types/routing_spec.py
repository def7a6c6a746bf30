"""``spec.routing``: the inference gateway of an InferenceService as the CRD declares it, built
from the routing contract (:mod:`slipstream.api_types.routing`): the policy names, and one
weight per scorer, keyed by the scorer's camelCase name (a new scorer there is a new key here)."""
from __future__ import annotations

from typing import Any, Literal, Mapping

from pydantic import create_model, model_validator

from .routing import DEFAULT_POLICY, DEFAULT_WEIGHTS, POLICIES, check_weights, crd_key
from .schema import CelRule, SpecModel, spec_field

# What each scorer's weight weighs, for the CRD's descriptions.
WEIGHT_DESCRIPTIONS = {
    "prefix": "Weight of the fraction of the prompt's blocks an endpoint already holds.",
    "queue": "Weight of a short queue (waiting and running requests).",
    "kv_cache": "Weight of free KV cache.",
    "affinity": "Weight of the endpoint the same session (X-Session-Id, prompt_cache_key or user) used before.",
}


class _Weights(SpecModel):
    """Base of :class:`RoutingWeights`: the check that not every weight is 0."""

    @model_validator(mode="after")
    def _some_weight(self) -> _Weights:
        check_weights({name: getattr(self, name) for name in DEFAULT_WEIGHTS}, "spec.routing.weights")
        return self


def _sum_rule() -> CelRule:
    # has(): the API server also checks this against the default {} as written.
    keys = [crd_key(name) for name in DEFAULT_WEIGHTS]
    every = " && ".join(f"has(self.{key})" for key in keys)
    total = " + ".join(f"double(self.{key})" for key in keys)
    return CelRule(f"!({every}) || {total} > 0.0",
                   "at least one weight must be > 0, or every endpoint scores the same")


# ``spec.routing.weights``: the gateway's score weights (``slipstream gateway --weight-*``),
# numbers ≥ 0, at least one > 0; one field per scorer of DEFAULT_WEIGHTS.
RoutingWeights = create_model(
    "RoutingWeights", __base__=_Weights, __module__=__name__,
    **{name: (float, spec_field(default, alias=crd_key(name), ge=0,
                                description=WEIGHT_DESCRIPTIONS.get(name, f"Weight of the {name} scorer.")))
       for name, default in DEFAULT_WEIGHTS.items()})
RoutingWeights.cel_rules = (_sum_rule(),)


class RoutingSpec(SpecModel):
    """``spec.routing``: the inference gateway in front of the model pods (issue 12).

    enabled: the Service ``<name>`` selects ``slipstream gateway`` pods (else the model pods).
    policy: one of :data:`~slipstream.api_types.routing.POLICIES` (``slipstream gateway --help``).
    queue_size: requests the gateway holds while no pod can take them (one more gets 429).
    queue_timeout_seconds: how long a held request waits before a 503 with Retry-After. For
        scale from zero it should be at least the pods' startup time (``startupTimeoutSeconds``
        is its upper bound); 300 s covers a model that loads in a few minutes.
    replicas: gateway pods (2: one can go while the other routes).
    """

    enabled: bool = spec_field(
        True, description="Route through the gateway; false makes the Service NAME select the model "
                          "pods directly (random spreading by kube-proxy).")
    policy: Literal[POLICIES] = spec_field(  # type: ignore[valid-type]
        DEFAULT_POLICY,
        description="round-robin; least-loaded (fewest waiting and running requests); prefix (the "
                    "gateway's own table of where it sent each prompt block, per gateway replica); "
                    "kv-events (the pods' KV-cache events: what each pod really holds, the same view "
                    "in every gateway replica).")
    weights: RoutingWeights = spec_field(  # type: ignore[valid-type]
        default_factory=RoutingWeights,
        description="Weights of the terms the gateway adds up to score an endpoint (round-robin "
                    "ignores them); each ≥ 0, at least one > 0.")
    queue_size: int = spec_field(
        1000, ge=1, description="Requests the gateway holds while no model pod can take them (none "
                                "ready, or all full); one more gets 429.")
    queue_timeout_seconds: int = spec_field(
        300, ge=1, description="How long a held request waits for a model pod before a 503 with "
                               "Retry-After. For scale from zero make it at least the time a pod "
                               "takes to start and load its model (startupTimeoutSeconds bounds that).")
    replicas: int = spec_field(
        2, ge=1, description="Gateway pods, spread over nodes (2 by default, so one can go while the "
                             "other routes).")

    @classmethod
    def from_dict(cls, routing: Mapping[str, Any] | None) -> RoutingSpec:
        """Parse the CRD's camelCase ``spec.routing``; None (or a key set to null) means the
        default. Raises SpecValueError (a ValueError) naming the CRD field."""
        return cls.parse(routing, "spec.routing")
