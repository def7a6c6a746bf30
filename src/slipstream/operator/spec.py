"""The InferenceService spec as typed, defaulted, validated values.

The CRD (``crds/inferenceservice.yaml``) defaults and validates on the API server; this module
does the same again because the operator cannot count on it: an API server older than 1.25 runs
no CEL rules, an emulator runs no schema at all, and some rules (a memory limit that must exceed
the KV cache, a name that must also be a Service name) are not expressible in the schema.
The defaults here equal the CRD's ``default:`` values (a test keeps them equal).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from types import MappingProxyType
from decimal import Decimal
from typing import Any, Mapping

from kubernetes.utils.quantity import parse_quantity

from slipstream.api_types.routing import DEFAULT_POLICY, DEFAULT_WEIGHTS, POLICIES, check_weights, crd_key

from .autoscaler import AutoscalingSpec
from .model_spec import (MODEL_SOURCES, SIM_PROFILE, ModelCacheSpec, ModelSpec, OCISpec,  # noqa: F401
                         S3Spec, SecretRef, model_location, validate_model)
from .spec_error import SpecError

DEFAULT_IMAGE = "ghcr.io/slipstream-dev/slipstream:0.1.0"
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# A Service name is an RFC 1035 label; the InferenceService's name becomes one.
DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
# The KV pool ``slipstream serve`` takes on CPU when no --kv-cache-memory-bytes is given
# (server/engine/config.py CPU_KV_CACHE_BYTES; a test keeps the two equal).
CPU_KV_CACHE_BYTES = 1 << 30


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """Engine settings passed to ``slipstream serve``. ``kv_cache_memory`` is a quantity string
    (``"1Gi"``); None lets the engine size the KV pool (on a GPU from ``gpu_memory_utilization``,
    the fraction in (0, 1] of the GPU's memory it may use, engine default 0.9 when None; on CPU
    :data:`CPU_KV_CACHE_BYTES`). ``enforce_eager``: no CUDA graphs for decode. ``max_model_len``
    None leaves the model's own context length. ``quantization``: ``"auto"`` / ``"none"``
    (``slipstream serve --quantization``), None leaves the server's default (auto).
    ``max_waiting``: most requests a pod queues beyond its running batch before it answers 429
    (``--max-waiting``); None leaves the server's default (128)."""

    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    kv_cache_memory: str | None = None
    max_model_len: int | None = None
    block_size: int = 16
    gpu_memory_utilization: float | None = None
    enforce_eager: bool = False
    quantization: str | None = None
    max_waiting: int | None = None

    @property
    def kv_cache_memory_bytes(self) -> int | None:
        """``kv_cache_memory`` in bytes; None when unset (the engine sizes the pool)."""
        return None if self.kv_cache_memory is None else int(parse_quantity(self.kv_cache_memory))


@dataclass(frozen=True, slots=True)
class ResourcesSpec:
    """Per-pod compute: ``cpu`` and ``memory`` quantities, ``gpus`` → ``nvidia.com/gpu``."""

    cpu: str = "2"
    memory: str = "4Gi"
    gpus: int = 0


ROUTING_POLICIES = POLICIES
# camelCase key of ``spec.routing`` (and of ``spec.routing.weights``) → RoutingSpec attribute.
ROUTING_KEYS: Mapping[str, str] = MappingProxyType({
    "enabled": "enabled", "policy": "policy", "weights": "weights", "queueSize": "queue_size",
    "queueTimeoutSeconds": "queue_timeout_seconds", "replicas": "replicas"})
WEIGHT_KEYS: Mapping[str, str] = MappingProxyType({crd_key(name): name for name in DEFAULT_WEIGHTS})


def _unknown_keys(raw: Any, keys: Mapping[str, str], where: str) -> Mapping[str, Any]:
    """``raw`` as a mapping of known keys; ValueError naming ``where`` otherwise."""
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where} must be an object, got {raw!r}")
    unknown = sorted(str(key) for key in set(raw) - set(keys))
    if unknown:
        raise ValueError(f"{where} has unknown field(s) {', '.join(unknown)}; "
                         f"known: {', '.join(keys)}")
    return raw


@dataclass(frozen=True, slots=True)
class RoutingWeights:
    """``spec.routing.weights``: the gateway's score weights (``slipstream gateway
    --weight-*``): prompt blocks an endpoint already holds, a short queue, free KV cache, the
    endpoint a session used before. Numbers ≥ 0, at least one > 0."""

    prefix: float = DEFAULT_WEIGHTS["prefix"]
    queue: float = DEFAULT_WEIGHTS["queue"]
    kv_cache: float = DEFAULT_WEIGHTS["kv_cache"]
    affinity: float = DEFAULT_WEIGHTS["affinity"]

    def __post_init__(self) -> None:
        check_weights({name: getattr(self, name) for name in DEFAULT_WEIGHTS}, "spec.routing.weights")


@dataclass(frozen=True, slots=True)
class RoutingSpec:
    """``spec.routing``: the inference gateway in front of the model pods (issue 12).

    enabled: the Service ``<name>`` selects ``slipstream gateway`` pods (else the model pods).
    policy: round-robin | least-loaded | prefix | kv-events (see ``slipstream gateway --help``).
    queue_size: requests the gateway holds while no pod can take them (one more gets 429).
    queue_timeout_seconds: how long a held request waits before a 503 with Retry-After. For
        scale from zero it should be at least the pods' startup time (``startupTimeoutSeconds``
        is its upper bound); 300 s covers a model that loads in a few minutes.
    replicas: gateway pods (2: one can go while the other routes).

    Raises ValueError naming the CRD field when a value is out of range or of the wrong type.
    """

    enabled: bool = True
    policy: str = DEFAULT_POLICY
    weights: RoutingWeights = field(default_factory=RoutingWeights)
    queue_size: int = 1000
    queue_timeout_seconds: int = 300
    replicas: int = 2

    def __post_init__(self) -> None:
        def check(ok: bool, key: str, rule: str, value: Any) -> None:
            if not ok:
                raise ValueError(f"spec.routing.{key} must be {rule}, got {value!r}")

        def integer(value: Any) -> bool:
            return isinstance(value, int) and not isinstance(value, bool) and value >= 1

        check(isinstance(self.enabled, bool), "enabled", "true or false", self.enabled)
        check(self.policy in ROUTING_POLICIES, "policy", f"one of {', '.join(ROUTING_POLICIES)}",
              self.policy)
        check(isinstance(self.weights, RoutingWeights), "weights", "an object", self.weights)
        for key, name in (("queueSize", "queue_size"),
                          ("queueTimeoutSeconds", "queue_timeout_seconds"),
                          ("replicas", "replicas")):
            check(integer(getattr(self, name)), key, "an integer ≥ 1", getattr(self, name))

    @classmethod
    def from_dict(cls, routing: Mapping[str, Any] | None) -> RoutingSpec:
        """Parse the CRD's camelCase ``spec.routing``; None (or a key set to null) means the
        default. Keys: :data:`ROUTING_KEYS`, :data:`WEIGHT_KEYS` under ``weights``.
        Raises ValueError for an unknown key, a value that is not an object, or (from the
        constructors) a value out of range."""
        if routing is None:
            return cls()
        values = {ROUTING_KEYS[k]: v for k, v in
                  _unknown_keys(routing, ROUTING_KEYS, "spec.routing").items() if v is not None}
        if "weights" in values:
            weights = _unknown_keys(values["weights"], WEIGHT_KEYS, "spec.routing.weights")
            values["weights"] = RoutingWeights(**{WEIGHT_KEYS[k]: v for k, v in weights.items()
                                                  if v is not None})
        return cls(**values)


@dataclass(frozen=True, slots=True)
class InferenceServiceSpec:
    """The whole ``spec`` with defaults filled in. Times in seconds."""

    model: ModelSpec = field(default_factory=ModelSpec)
    image: str = DEFAULT_IMAGE
    replicas: int = 1
    autoscaling: AutoscalingSpec = field(default_factory=AutoscalingSpec)
    routing: RoutingSpec = field(default_factory=RoutingSpec)
    engine: EngineSpec = field(default_factory=EngineSpec)
    resources: ResourcesSpec = field(default_factory=ResourcesSpec)
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    env: tuple[Mapping[str, Any], ...] = ()
    port: int = 8000
    shutdown_timeout_seconds: int = 30
    startup_timeout_seconds: int = 600


# CRD field name → dataclass field name, per object. Anything not listed is an unknown field.
# spec.autoscaling and spec.routing have their own parsers (AutoscalingSpec.from_dict, shared
# with the simulator; RoutingSpec.from_dict).
_FIELDS: dict[type, dict[str, str]] = {
    ModelSpec: {"source": "source", "path": "path", "claimName": "claim_name",
                "profile": "profile", "servedModelName": "served_model_name", "uri": "uri",
                "secretRef": "secret_ref", "s3": "s3", "cache": "cache", "oci": "oci"},
    OCISpec: {"mount": "mount"},
    SecretRef: {"name": "name"},
    S3Spec: {"endpoint": "endpoint", "region": "region"},
    ModelCacheSpec: {"claimName": "claim_name", "hostPath": "host_path", "maxSize": "max_size"},
    EngineSpec: {"maxNumSeqs": "max_num_seqs", "maxNumBatchedTokens": "max_num_batched_tokens",
                 "kvCacheMemory": "kv_cache_memory", "maxModelLen": "max_model_len",
                 "blockSize": "block_size", "gpuMemoryUtilization": "gpu_memory_utilization",
                 "enforceEager": "enforce_eager", "quantization": "quantization",
                 "maxWaiting": "max_waiting"},
    ResourcesSpec: {"cpu": "cpu", "memory": "memory", "gpus": "gpus"},
    InferenceServiceSpec: {
        "model": "model", "image": "image", "replicas": "replicas", "autoscaling": "autoscaling",
        "routing": "routing",
        "engine": "engine", "resources": "resources", "nodeSelector": "node_selector",
        "tolerations": "tolerations", "env": "env", "port": "port",
        "shutdownTimeoutSeconds": "shutdown_timeout_seconds",
        "startupTimeoutSeconds": "startup_timeout_seconds",
    },
}
_NESTED = {"model": ModelSpec, "autoscaling": AutoscalingSpec, "routing": RoutingSpec,
           "engine": EngineSpec, "resources": ResourcesSpec}
# Objects inside spec.model.
_MODEL_NESTED = {"secretRef": SecretRef, "s3": S3Spec, "cache": ModelCacheSpec, "oci": OCISpec}


def _build(cls: type, raw: Mapping[str, Any] | None, where: str) -> Any:
    if cls in (AutoscalingSpec, RoutingSpec):
        try:
            return cls.from_dict(raw)
        except ValueError as exc:
            raise SpecError("InvalidSpec", str(exc)) from None
    if raw is None:
        return cls()
    if not isinstance(raw, Mapping):
        raise SpecError("InvalidSpec", f"{where} must be an object, got {raw!r}")
    names = _FIELDS[cls]
    unknown = sorted(set(raw) - set(names))
    if unknown:
        raise SpecError("InvalidSpec", f"{where} has unknown field(s) {', '.join(unknown)}; "
                                       f"known: {', '.join(names)}")
    kwargs: dict[str, Any] = {}
    for crd_name, value in raw.items():
        if value is None:
            continue
        if cls is InferenceServiceSpec and crd_name in _NESTED:
            value = _build(_NESTED[crd_name], value, f"{where}.{crd_name}")
        elif cls is ModelSpec and crd_name in _MODEL_NESTED:
            value = _build(_MODEL_NESTED[crd_name], value, f"{where}.{crd_name}")
        elif crd_name in ("tolerations", "env"):
            value = tuple(dict(item) for item in value)
        elif crd_name == "nodeSelector":
            value = dict(value)
        elif crd_name in ("kvCacheMemory", "cpu", "memory", "maxSize"):
            value = str(value)
        kwargs[names[crd_name]] = value
    return cls(**kwargs)


def _quantity(value: str, where: str) -> Decimal:
    try:
        return parse_quantity(value)
    except ValueError:
        raise SpecError("InvalidSpec", f"{where} must be a Kubernetes quantity such as "
                                       f"'512Mi' or '2', got {value!r}") from None


def _check_int(value: Any, where: str, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (
            high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f"≥ {low}"
        raise SpecError("InvalidSpec", f"{where} must be an integer {bound}, got {value!r}")


# The longest name: ``<name>-pods`` (the headless Service of the model pods) is a DNS-1035
# label too, at most 63 characters.
MAX_NAME_LENGTH = 63 - len("-pods")


def validate_name(name: str) -> None:
    """Raise SpecError unless ``name`` can name the Services (``<name>`` and ``<name>-pods``:
    RFC 1035 labels, so ``name`` is one of at most :data:`MAX_NAME_LENGTH` characters)."""
    if len(name) > MAX_NAME_LENGTH or not DNS1035_LABEL.match(name):
        raise SpecError(
            "InvalidName",
            f"metadata.name {name!r} must be a DNS-1035 label (lowercase letters, digits and "
            f"'-', starting with a letter, at most {MAX_NAME_LENGTH} characters) because it "
            f"names the Services {name} and {name}-pods; recreate the InferenceService under "
            f"such a name")


def parse_spec(raw: Mapping[str, Any] | None, *, name: str | None = None) -> InferenceServiceSpec:
    """Turn ``.spec`` of an InferenceService (a dict, possibly without defaults) into a
    defaulted :class:`InferenceServiceSpec`.

    Raises SpecError with ``reason`` InvalidSpec (or InvalidName for ``name``) on the first
    rule broken: the CRD schema's bounds and its CEL rules, plus the rules the schema cannot
    state (KV cache memory below the memory limit on CPU pods, set or the engine's 1 GiB).
    """
    if name is not None:
        validate_name(name)
    spec: InferenceServiceSpec = _build(InferenceServiceSpec, raw or {}, "spec")
    model, engine, res = spec.model, spec.engine, spec.resources  # autoscaling: checked when built

    validate_model(model)

    _check_int(spec.replicas, "spec.replicas", 0)
    _check_int(spec.port, "spec.port", 1, 65535)
    _check_int(spec.shutdown_timeout_seconds, "spec.shutdownTimeoutSeconds", 0, 3600)
    _check_int(spec.startup_timeout_seconds, "spec.startupTimeoutSeconds", 10, 7200)

    _check_int(engine.max_num_seqs, "spec.engine.maxNumSeqs", 1)
    _check_int(engine.max_num_batched_tokens, "spec.engine.maxNumBatchedTokens", 1)
    if engine.max_waiting is not None:
        _check_int(engine.max_waiting, "spec.engine.maxWaiting", 0)
    if engine.max_num_batched_tokens < engine.max_num_seqs:
        # Every running sequence needs one token of the step's budget (vLLM's rule too).
        raise SpecError("InvalidSpec", f"spec.engine.maxNumBatchedTokens "
                                       f"({engine.max_num_batched_tokens}) must be ≥ maxNumSeqs "
                                       f"({engine.max_num_seqs})")
    if engine.max_model_len is not None:
        _check_int(engine.max_model_len, "spec.engine.maxModelLen", 1)
    if engine.block_size not in BLOCK_SIZES:
        raise SpecError("InvalidSpec", f"spec.engine.blockSize must be a power of two from 1 to "
                                       f"256, got {engine.block_size!r}")
    if engine.kv_cache_memory is not None:
        kv_bytes = _quantity(engine.kv_cache_memory, "spec.engine.kvCacheMemory")
        if kv_bytes < 1 or kv_bytes != int(kv_bytes):
            raise SpecError("InvalidSpec", f"spec.engine.kvCacheMemory must be a whole number of "
                                           f"bytes ≥ 1, got {engine.kv_cache_memory!r}")
    utilization = engine.gpu_memory_utilization
    if utilization is not None and (isinstance(utilization, bool) or not isinstance(
            utilization, (int, float)) or not 0 < utilization <= 1):
        raise SpecError("InvalidSpec", f"spec.engine.gpuMemoryUtilization must be a number in "
                                       f"(0, 1], got {utilization!r}")
    if not isinstance(engine.enforce_eager, bool):
        raise SpecError("InvalidSpec", f"spec.engine.enforceEager must be true or false, "
                                       f"got {engine.enforce_eager!r}")
    if engine.quantization not in (None, "auto", "none"):
        raise SpecError("InvalidSpec", f"spec.engine.quantization must be 'auto' or 'none', "
                                       f"got {engine.quantization!r}")

    if _quantity(res.cpu, "spec.resources.cpu") <= 0:
        raise SpecError("InvalidSpec", f"spec.resources.cpu must be > 0, got {res.cpu!r}")
    memory = _quantity(res.memory, "spec.resources.memory")
    _check_int(res.gpus, "spec.resources.gpus", 0)
    if res.gpus > 1:
        raise SpecError("InvalidSpec", f"spec.resources.gpus is {res.gpus}, but tensor parallelism "
                                       f"is not supported yet: a pod runs its model on one GPU; "
                                       f"use one GPU per replica (gpus: 1) and scale replicas")
    kv_bytes = (CPU_KV_CACHE_BYTES if engine.kv_cache_memory is None
                else engine.kv_cache_memory_bytes)
    if res.gpus == 0 and model_location(model).kind != "sim" and kv_bytes >= memory:
        # On CPU the KV cache lives in the pod's memory, beside the weights and the runtime
        # (on a GPU it lives in GPU memory; a simulated one is only counted, never allocated).
        given = engine.kv_cache_memory or f"unset, so the engine's {CPU_KV_CACHE_BYTES >> 30}Gi"
        raise SpecError("InvalidSpec", f"spec.engine.kvCacheMemory ({given}) "
                                       f"must be below spec.resources.memory ({res.memory}) on a "
                                       f"CPU pod: the KV cache, the weights and the server share "
                                       f"that memory; raise memory or "
                                       f"{'lower' if engine.kv_cache_memory else 'set'} kvCacheMemory")

    for i, var in enumerate(spec.env):
        if not isinstance(var.get("name"), str) or not ENV_NAME.match(var["name"]):
            raise SpecError("InvalidSpec", f"spec.env[{i}].name must be a C identifier-like "
                                           f"environment variable name, got {var.get('name')!r}")
        if "value" in var and "valueFrom" in var:
            raise SpecError("InvalidSpec", f"spec.env[{i}] ({var['name']}) sets value and "
                                           f"valueFrom; set one")
    return spec
