"""The ``InferenceService`` spec (group ``slipstream.dev``, version ``v1alpha1``) as pydantic models:
the one parser of ``.spec``, and the source of the CRD's schema (``make crds``,
:mod:`slipstream.api_types.crd`). Times in seconds.

Each object's defaults, ranges and CEL rules are declared beside its fields, in
:mod:`~slipstream.api_types.model`, :mod:`~slipstream.api_types.autoscaling`,
:mod:`~slipstream.api_types.routing_spec`, :mod:`~slipstream.api_types.engine` and here. Rules the
schema cannot state (quantities compared, the model URI grammar's messages) are the operator's
(``slipstream.operator.spec``).
"""
from __future__ import annotations

from typing import Any, Literal, Mapping

from pydantic import model_validator

from .autoscaling import AutoscalingSpec
from .engine import EngineSpec
from .model import ModelSpec
from .parallelism import GPUS_EQUAL_TENSOR_MESSAGE, GPUS_EQUAL_TENSOR_RULE, ParallelismSpec
from .routing_spec import RoutingSpec
from .schema import QUANTITY_PATTERN, QUANTITY_RULE, CelRule, Quantity, SpecModel, spec_field
from .tenancy import TOKEN_LIMITS_NEED_GATEWAY_MESSAGE, TOKEN_LIMITS_NEED_GATEWAY_RULE, FairnessSpec

GROUP = "slipstream.dev"
VERSION = "v1alpha1"
KIND = "InferenceService"
PLURAL = "inferenceservices"
DEFAULT_IMAGE = "ghcr.io/slipstream-dev/slipstream:0.1.0"
# A Service name is an RFC 1035 label; the InferenceService's name becomes one, and so does
# ``<name>-pods`` (the headless Service of the model pods), at most 63 characters.
DNS1035_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
MAX_NAME_LENGTH = 63 - len("-pods")
NAME_RULE = CelRule(
    f"self.metadata.name.size() <= {MAX_NAME_LENGTH} && self.metadata.name.matches('{DNS1035_LABEL}')",
    f"metadata.name names the Services NAME and NAME-pods, so it must be a DNS-1035 label: lowercase "
    f"letters, digits and '-', starting with a letter, at most {MAX_NAME_LENGTH} characters")


class ResourcesSpec(SpecModel):
    """``spec.resources``, per pod: ``cpu`` (requested) and ``memory`` (requested and the limit)
    quantities, ``gpus`` → the ``nvidia.com/gpu`` limit."""

    cpu: Quantity = spec_field("2", rule=QUANTITY_RULE, schema={"pattern": QUANTITY_PATTERN})
    memory: Quantity = spec_field("4Gi", rule=QUANTITY_RULE, schema={"pattern": QUANTITY_PATTERN})
    gpus: int = spec_field(
        0, ge=0, description="GPUs per pod (the nvidia.com/gpu limit), one per tensor-parallel rank: "
                             "equal to spec.parallelism.tensor when both are set; gpus: N alone means "
                             "tensor N.")


class Toleration(SpecModel):
    """One of ``spec.tolerations``, as a pod's toleration."""

    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None

    def manifest(self) -> dict[str, Any]:
        """The pod spec's form (camelCase, unset keys left out)."""
        return self.to_dict()


class EnvVar(SpecModel):
    """One of ``spec.env``: an environment variable of the server container."""

    cel_rules = (CelRule("!(has(self.value) && has(self.valueFrom))", "set value or valueFrom, not both"),)

    name: str = spec_field(min_length=1)
    value: str | None = None
    # A container's valueFrom (secretKeyRef, configMapKeyRef, fieldRef, …), passed on as written.
    value_from: Mapping[str, Any] | None = None

    @model_validator(mode="after")
    def _one_source(self) -> EnvVar:
        if self.value is not None and self.value_from is not None:
            # {where}: this variable's path (spec.env[i]), filled in by SpecModel.parse.
            raise ValueError(f"{{where}} ({self.name}) sets value and valueFrom; set one")
        return self

    def manifest(self) -> dict[str, Any]:
        """The container's form (camelCase, unset keys left out)."""
        return self.to_dict()


class InferenceServiceSpec(SpecModel):
    """The whole ``spec`` with defaults filled in."""

    cel_rules = (GPUS_EQUAL_TENSOR_RULE, TOKEN_LIMITS_NEED_GATEWAY_RULE)

    model: ModelSpec = spec_field(
        default_factory=ModelSpec,
        description="Which weights to serve: uri (hf://, s3://, pvc://, builtin, sim:), or source "
                    "with path, claimName or profile.")
    image: str = spec_field(DEFAULT_IMAGE, min_length=1, description="Container image with the slipstream CLI.")
    replicas: int = spec_field(1, ge=0, description="Pods to run while autoscaling is off (kubectl scale sets it).")
    autoscaling: AutoscalingSpec = spec_field(
        default_factory=AutoscalingSpec,
        description="Replicas from load: by default (policy capacity) demand in requests and tokens "
                    "per second over one pod's learned capacity at a TTFT objective, queue depth and "
                    "KV-cache use as guards; or (policy queue) from queue depth and KV-cache use per "
                    "pod (stable and panic windows, as Knative's KPA) and the gateway's waiting "
                    "requests. minReplicas 0 scales to zero after "
                    "scaleToZeroAfterSeconds without a request and back from zero on the first "
                    "request, which waits in the gateway (spec.routing.enabled).")
    routing: RoutingSpec = spec_field(
        default_factory=RoutingSpec,
        description="The inference gateway (`slipstream gateway`) in front of the model pods: the "
                    "Service NAME selects its pods, which route each request to a model pod (listed "
                    "by the headless Service NAME-pods) by prefix-cache overlap and load, and hold "
                    "requests while no pod can take one.")
    engine: EngineSpec = spec_field(default_factory=EngineSpec, description="Settings passed to `slipstream serve`.")
    resources: ResourcesSpec = spec_field(
        default_factory=ResourcesSpec,
        description="Per pod. cpu is requested; memory is requested and the limit; gpus become the "
                    "nvidia.com/gpu limit.")
    fairness: FairnessSpec = spec_field(
        default_factory=FairnessSpec,
        description="Sharing between tenants (the x-gateway-inference-fairness-id header): the pods' "
                    "scheduling policy and the tenants' weights, applied by the pods' engines and by "
                    "the gateway to the requests it holds.")
    parallelism: ParallelismSpec = spec_field(
        default_factory=ParallelismSpec,
        description="How one replica is split: tensor ranks per pod (one GPU each) and pipeline "
                    "stages, one pod each (above 1, a LeaderWorkerSet group per replica).")
    node_selector: Mapping[str, str] = spec_field(default_factory=dict)
    tolerations: tuple[Toleration, ...] = spec_field((), strict=False)  # a list in the CRD
    env: tuple[EnvVar, ...] = spec_field((), strict=False, description="Extra environment variables of the server container.")
    port: int = spec_field(8000, ge=1, le=65535, description="The server's container port (the Service listens on 80).")
    shutdown_timeout_seconds: int = spec_field(
        30, ge=0, le=3600, description="How long a stopping pod lets in-flight requests finish.")
    startup_timeout_seconds: int = spec_field(
        600, ge=10, le=7200,
        description="How long a pod may take to load and warm its model before it is restarted.")

    @model_validator(mode="after")
    def _gpus_equal_tensor(self) -> InferenceServiceSpec:
        tensor = self.parallelism.tensor
        if tensor is not None and self.resources.gpus and self.resources.gpus != tensor:
            raise ValueError(GPUS_EQUAL_TENSOR_MESSAGE)
        return self

    @model_validator(mode="after")
    def _token_limits_need_gateway(self) -> InferenceServiceSpec:
        if self.fairness.token_limited and not self.routing.enabled:
            raise ValueError(TOKEN_LIMITS_NEED_GATEWAY_MESSAGE)
        return self

    @property
    def tensor_parallel_size(self) -> int:
        """Tensor-parallel ranks per pod: ``parallelism.tensor``, else ``resources.gpus``, else 1."""
        return self.parallelism.tensor or max(self.resources.gpus, 1)

    @property
    def pipeline_parallel_size(self) -> int:
        """Pods per replica (pipeline stages): ``parallelism.pipeline``."""
        return self.parallelism.pipeline

    @classmethod
    def from_dict(cls, spec: Mapping[str, Any] | None) -> InferenceServiceSpec:
        """Parse an InferenceService's camelCase ``.spec`` (None or a key set to null: the
        defaults). Raises SpecValueError (a ValueError) naming the CRD field."""
        return cls.parse(spec, "spec")
