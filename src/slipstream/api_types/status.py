"""The ``InferenceService`` status as the CRD declares it. The operator writes it as dicts
(``slipstream.operator.status``); these models are the schema's source, field for field."""
from __future__ import annotations

from typing import Any, Literal, Mapping

from .schema import SpecModel, spec_field

DATE_TIME = {"format": "date-time"}


class Condition(SpecModel):
    """One of ``status.conditions`` (Kubernetes' condition shape; keyed by ``type``)."""

    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str | None = None
    message: str | None = None
    last_transition_time: str | None = spec_field(None, schema=DATE_TIME)
    observed_generation: int | None = None


class GatewayStatus(SpecModel):
    url: str | None = spec_field(
        None, description="Where clients send requests (the Service NAME, which selects the gateway pods).")
    replicas: int | None = None
    ready_replicas: int | None = None


class ModelStatus(SpecModel):
    uri: str | None = None
    revision: str | None = spec_field(None, description="The commit (Hub) or content hash (S3) the uri resolved to.")
    bytes: int | None = spec_field(None, description="Size of the downloaded files.")
    download_seconds: float | None = spec_field(
        None, description="Time the download step took (0 when the cache held the revision).")


class ScalingEvent(SpecModel):
    """One replica change of the autoscaler."""

    time: str | None = spec_field(None, schema=DATE_TIME)
    from_replicas: int | None = None
    to_replicas: int | None = None
    reason: str | None = None


class AutoscalerDecisionStatus(SpecModel):
    """The numbers of the autoscaler's last tick (``status.lastDecision``): what the capacity
    policy sized from, so a reader can redo the division."""

    policy: str | None = spec_field(None, description="capacity or queue.")
    demand_requests_per_second: float | None = spec_field(None, description="Arrival rate the policy sized for.")
    demand_prompt_tokens_per_second: float | None = None
    demand_generation_tokens_per_second: float | None = None
    capacity_tokens_per_second: float | None = spec_field(
        None, description="One pod's throughput at the objective (prompt-equivalent tokens/s), as learned.")
    start_seconds: float | None = spec_field(None, description="Expected pod start (created to Ready), as measured.")
    pods_starting: int | None = None
    desired_replicas: int | None = None
    reason: str | None = None


class InferenceServiceStatus(SpecModel):
    """``status``: conditions, replica counts, where to send requests, the weights served and
    the autoscaler's last decision in numbers."""

    conditions: tuple[Condition, ...] | None = spec_field(
        None, schema={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]})
    replicas: int | None = None
    ready_replicas: int | None = None
    desired_replicas: int | None = None
    url: str | None = None
    gateway: GatewayStatus | None = spec_field(None, description="The inference gateway (while spec.routing.enabled).")
    model: ModelStatus | None = spec_field(
        None, description="The weights the pods run, as the download step reported them (hf:// and s3:// uris).")
    observed_generation: int | None = None
    selector: str | None = None
    queue_depth: float | None = None
    kv_cache_utilization: float | None = None
    kv_cache_percent: int | None = None
    last_scale_time: str | None = spec_field(None, schema=DATE_TIME)
    scaling_history: tuple[ScalingEvent, ...] | None = spec_field(
        None, description="The autoscaler's latest replica changes, oldest first.", schema={"maxItems": 50})
    scrape_failures: int | None = spec_field(
        None, description="Ready pods whose /metrics did not answer at the autoscaler's last tick.")
    objective_attainment: float | None = spec_field(
        None, description="Share of the requests of the autoscaler's window whose time to first token "
                          "met spec.autoscaling.objectives.ttftP90Seconds (0..1; the objective holds at ≥ 0.9).")
    last_decision: AutoscalerDecisionStatus | None = spec_field(
        None, description="The autoscaler's last tick in numbers: demand, capacity per pod, pods starting, "
                          "desired replicas and the reason.")
    autoscaler: Mapping[str, Any] | None = spec_field(
        None, description="What the autoscaler remembers between ticks (recent observations); opaque to users.")
