"""Engine settings that ``slipstream serve`` (``server/engine/config.py``) and the operator
(``spec.engine``) share: names, defaults and ranges, and ``spec.engine`` as the CRD declares it."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, model_validator

from .schema import QUANTITY_PATTERN, QUANTITY_RULE, CelRule, Quantity, SpecModel, spec_field

# The KV pool's size where no device memory can be profiled (CPU), unless given; the operator
# checks a CPU pod's memory against it.
CPU_KV_CACHE_BYTES = 1 << 30
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DEFAULT_BLOCK_SIZE = 16
DEFAULT_MAX_NUM_SEQS = 32
DEFAULT_MAX_NUM_BATCHED_TOKENS = 512
# 0: a prefill chunk is capped by the step's token budget only (vLLM's default too).
DEFAULT_LONG_PREFILL_TOKEN_THRESHOLD = 0
# The fraction of a GPU's memory the engine may use when none is given.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
QUANTIZATIONS = ("auto", "none")


BLOCK_SIZE_RULE = "a power of two from 1 to 256"


def _not_bool(value: Any) -> Any:
    # A Literal of ints takes True for 1; the API server does not.
    if isinstance(value, bool):
        raise ValueError(f"{{where}} must be {BLOCK_SIZE_RULE}, got {value!r}")
    return value


def check_gpu_memory_utilization(value: float) -> None:
    """Raise ValueError unless ``value`` is a fraction in (0, 1]."""
    if not 0 < value <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {value}")


class EngineSpec(SpecModel):
    """``spec.engine``: settings passed to ``slipstream serve``. ``kv_cache_memory`` is a quantity
    string (``"1Gi"``); None lets the engine size the KV pool (on a GPU from
    ``gpu_memory_utilization``, engine default :data:`DEFAULT_GPU_MEMORY_UTILIZATION` when None;
    on CPU :data:`CPU_KV_CACHE_BYTES`). ``enforce_eager``: no CUDA graphs for decode.
    ``max_model_len`` None leaves the model's own context length. ``quantization`` None leaves
    the server's default (auto). ``max_waiting`` None leaves the server's default (128)."""

    # has(): the API server also checks this against the default {} as written.
    cel_rules = (CelRule("!has(self.maxNumBatchedTokens) || !has(self.maxNumSeqs) || "
                         "self.maxNumBatchedTokens >= self.maxNumSeqs",
                         "maxNumBatchedTokens must be ≥ maxNumSeqs: every running request needs one "
                         "token of each step's budget"),)

    max_num_seqs: int = spec_field(DEFAULT_MAX_NUM_SEQS, ge=1, description="Most requests running at once.")
    max_num_batched_tokens: int = spec_field(
        DEFAULT_MAX_NUM_BATCHED_TOKENS, ge=1,
        description="Token budget of one engine step (decode tokens plus prefill chunks).")
    kv_cache_memory: Quantity | None = spec_field(
        None, rule=QUANTITY_RULE,
        description="Memory for the KV block pool, a quantity (bytes), e.g. 512Mi. Unset, the engine "
                    "sizes it: on a GPU from gpuMemoryUtilization (after profiling the weights and "
                    "activations), on CPU 1Gi. Set, it wins over gpuMemoryUtilization.",
        schema={"pattern": QUANTITY_PATTERN})
    max_model_len: int | None = spec_field(
        None, ge=1, description="Most tokens (prompt + output) of one request; unset takes the "
                                "model's context length.")
    block_size: Annotated[Literal[BLOCK_SIZES], BeforeValidator(_not_bool)] = spec_field(  # type: ignore[valid-type]
        DEFAULT_BLOCK_SIZE, rule=BLOCK_SIZE_RULE, description="Tokens per KV-cache block.")
    gpu_memory_utilization: float | None = spec_field(
        None, gt=0, le=1,
        description="GPU pods: the fraction in (0, 1] of the GPU's memory the server may use in all "
                    "(weights, activations, CUDA graphs, KV cache); the KV pool gets what is left of "
                    "it. Unset: 0.9 (slipstream serve's default).")
    enforce_eager: bool = spec_field(
        False, description="GPU pods: run every step eagerly, without CUDA graphs for decode (quicker "
                           "start, less memory, slower decode).")
    quantization: Literal[QUANTIZATIONS] | None = spec_field(  # type: ignore[valid-type]
        None, rule="'auto' or 'none'",
        description="auto (the server's default): on CPU pods, serve a GGUF's Q4_0/Q4_1/Q8_0 weights "
                    "as stored (about a sixth of fp32's bytes per decode step); none: dequantize "
                    "every weight.")
    long_prefill_token_threshold: int | None = spec_field(
        None, ge=1,
        description="Most prompt tokens one request computes in a step it shares with others "
                    "(vLLM's long_prefill_token_threshold), so short prompts arriving behind a long "
                    "one get their first token without waiting out its prefill; alone in a step it "
                    "takes the whole budget, and one long prompt is prefilled at a time. Unset: "
                    "chunks are capped by maxNumBatchedTokens only.")
    max_waiting: int | None = spec_field(
        None, ge=0,
        description="Most requests one pod queues beyond its running batch; more get 429 with "
                    "Retry-After. Unset: 128 (slipstream serve's default). Size it to hold the load "
                    "that arrives while new pods start.")

    @model_validator(mode="after")
    def _budget(self) -> EngineSpec:
        if self.max_num_batched_tokens < self.max_num_seqs:
            # Every running sequence needs one token of the step's budget (vLLM's rule too).
            raise ValueError(f"spec.engine.maxNumBatchedTokens ({self.max_num_batched_tokens}) must be "
                             f"≥ maxNumSeqs ({self.max_num_seqs})")
        return self
