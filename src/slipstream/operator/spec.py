"""The InferenceService spec as typed, defaulted, validated values: the contract's models
(:mod:`slipstream.api_types.inference_service`, from which the CRD is generated) plus the rules
only the operator checks.

The API server defaults and validates with the CRD; the operator does the same again, with the
same models, because it cannot count on it: an API server older than 1.25 runs no CEL rules and
an emulator runs no schema at all. Some rules are not expressible in the schema (a memory limit
that must exceed the KV cache, quantities as numbers, the model URI grammar's messages): those
are here and in :mod:`~slipstream.operator.model_spec`.
"""
from __future__ import annotations

import re
from decimal import Decimal
from typing import Any, Mapping

from kubernetes.utils.quantity import parse_quantity

from slipstream.api_types.autoscaling import AutoscalingSpec  # noqa: F401
from slipstream.api_types.engine import BLOCK_SIZES, CPU_KV_CACHE_BYTES, EngineSpec  # noqa: F401
from slipstream.api_types.inference_service import (DEFAULT_IMAGE, MAX_NAME_LENGTH, EnvVar,  # noqa: F401
                                                    InferenceServiceSpec, ResourcesSpec, Toleration)
from slipstream.api_types.inference_service import DNS1035_LABEL as _DNS1035_LABEL
from slipstream.api_types.routing import POLICIES as ROUTING_POLICIES  # noqa: F401
from slipstream.api_types.routing_spec import RoutingSpec, RoutingWeights  # noqa: F401
from slipstream.api_types.schema import SpecValueError

from .model_spec import (MODEL_SOURCES, SIM_PROFILE, ModelCacheSpec, ModelSpec, OCISpec,  # noqa: F401
                         S3Spec, SecretRef, model_location, quantity_bytes, validate_model)
from .spec_error import SpecError

# A Service name is an RFC 1035 label; the InferenceService's name becomes one.
DNS1035_LABEL = re.compile(_DNS1035_LABEL)
ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")


def _quantity(value: str, where: str) -> Decimal:
    try:
        return parse_quantity(value)
    except ValueError:
        raise SpecError("InvalidSpec", f"{where} must be a Kubernetes quantity such as "
                                       f"'512Mi' or '2', got {value!r}") from None


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
    rule broken: the CRD schema's bounds and its CEL rules (the contract's models), plus the
    rules the schema cannot state (quantities as numbers, KV cache memory below the memory
    limit on CPU pods, set or the engine's 1 GiB; the model URI grammar).
    """
    if name is not None:
        validate_name(name)
    try:
        spec = InferenceServiceSpec.from_dict(raw or {})
    except SpecValueError as exc:
        raise SpecError("InvalidSpec", str(exc)) from None
    model, engine, res = spec.model, spec.engine, spec.resources

    validate_model(model)

    if engine.kv_cache_memory is not None:
        kv_bytes = _quantity(engine.kv_cache_memory, "spec.engine.kvCacheMemory")
        if kv_bytes < 1 or kv_bytes != int(kv_bytes):
            raise SpecError("InvalidSpec", f"spec.engine.kvCacheMemory must be a whole number of "
                                           f"bytes ≥ 1, got {engine.kv_cache_memory!r}")
    if _quantity(res.cpu, "spec.resources.cpu") <= 0:
        raise SpecError("InvalidSpec", f"spec.resources.cpu must be > 0, got {res.cpu!r}")
    memory = _quantity(res.memory, "spec.resources.memory")
    kv_bytes = (CPU_KV_CACHE_BYTES if engine.kv_cache_memory is None
                else quantity_bytes(engine.kv_cache_memory))
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
        # Not in the CRD's schema: the API server takes any non-empty name.
        if not ENV_NAME.match(var.name):
            raise SpecError("InvalidSpec", f"spec.env[{i}].name must be a C identifier-like "
                                           f"environment variable name, got {var.name!r}")
    return spec
