"""How long one engine step takes on a modelled GPU: a roofline with efficiency factors (pure).

A step runs the batch's new tokens (prefill chunks and decode tokens, flattened) through the
model once. Its time is the larger of two lower bounds, each derated by an efficiency factor,
plus a fixed per-step overhead (Williams et al., "Roofline", CACM 2009):

- compute: ``2 × params`` FLOPs per new token (every weight is one multiply-add), plus attention
  ``4 × layers × heads × head_dim`` FLOPs per (query token, context token) pair (QKᵀ and PV);
- memory: every weight read once per step, the KV of each request's context read once, the new
  tokens' KV written once.

This is a model, not a measurement: it ignores kernel shapes, tensor-parallel communication,
CUDA-graph padding and the CPU's own share, and its efficiency factors are assumptions
(``compute_efficiency`` is the model-FLOPs utilization a prefill reaches, ``bandwidth_efficiency``
the fraction of peak HBM bandwidth a decode reaches). It puts a batch's cost within tens of
percent of what published vLLM runs of the same model and GPU show, which is what autoscaling
and scheduling experiments need: the right shape (decode is bandwidth-bound and nearly free to
batch, prefill is compute-bound and linear in tokens) and the right order of magnitude.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

GB = 10**9
GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class Device:
    """One accelerator: ``memory_bytes`` of HBM, peak ``bandwidth`` (bytes/s) and peak dense
    BF16 ``flops`` (FLOP/s, without structured sparsity); ``source`` says where they come from."""

    name: str
    memory_bytes: int
    bandwidth: float
    flops: float
    source: str


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The numbers of a decoder-only transformer that decide its cost.

    num_params: parameters (weights read per step = num_params × bytes_per_param).
    num_layers, num_heads, num_kv_heads, head_dim: attention shape (GQA: fewer KV heads).
    max_model_len: context length in tokens. kv_bytes: bytes per K or V element (2 = BF16).
    """

    name: str
    num_params: float
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    max_model_len: int
    bytes_per_param: int = 2
    kv_bytes: int = 2
    source: str = ""

    @property
    def weight_bytes(self) -> float:
        return self.num_params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers: ``2 × layers × kv_heads × head_dim × kv_bytes``."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_bytes

    @property
    def attention_flops_per_pair(self) -> int:
        """FLOPs of one query token attending to one context token over all layers:
        QKᵀ and PV, each ``2 × heads × head_dim`` (multiply-add)."""
        return 4 * self.num_layers * self.num_heads * self.head_dim


@dataclass(frozen=True, slots=True)
class Profile:
    """A model on a device, with the roofline's derating and the engine settings it suits.

    compute_efficiency, bandwidth_efficiency: fractions of peak reached (assumed, see module).
    step_overhead: seconds every step costs regardless of size (launches, scheduling, sampling).
    gpu_memory_utilization: share of HBM the engine takes (vLLM's ``--gpu-memory-utilization``
    default 0.9); the KV cache gets that share minus the weights.
    max_num_seqs, max_num_batched_tokens: engine settings ``slipstream simulate`` uses by default.
    """

    name: str
    model: ModelShape
    device: Device
    compute_efficiency: float = 0.5
    bandwidth_efficiency: float = 0.8
    step_overhead: float = 0.002
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    description: str = ""

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes left for the KV cache: ``memory × gpu_memory_utilization − weights``.

        Raises ValueError when the weights do not fit."""
        free = self.device.memory_bytes * self.gpu_memory_utilization - self.model.weight_bytes
        if free < self.model.kv_bytes_per_token:
            raise ValueError(f"profile {self.name}: {self.model.weight_bytes / GB:.1f} GB of weights leave no "
                             f"KV cache in {self.device.memory_bytes / GB:.1f} GB × "
                             f"{self.gpu_memory_utilization}")
        return int(free)

    @property
    def kv_cache_tokens(self) -> int:
        return self.kv_cache_bytes // self.model.kv_bytes_per_token


@dataclass(frozen=True, slots=True)
class BatchShape:
    """What a step computes, summed over its requests (all counts in tokens).

    new_tokens: tokens run through the model (prefill chunks + decode tokens).
    context_tokens: KV read: each request's context up to and including its new tokens.
    attention_pairs: (query, key) pairs attended: for a chunk of n tokens after c cached ones,
        ``n × c + n(n+1)/2`` (causal).
    """

    new_tokens: int = 0
    context_tokens: int = 0
    attention_pairs: int = 0


def batch_shape(chunks: Iterable[tuple[int, int]]) -> BatchShape:
    """BatchShape of ``(num_computed_tokens, num_new_tokens)`` per scheduled request."""
    new = context = pairs = 0
    for cached, n in chunks:
        new += n
        context += cached + n
        pairs += n * cached + n * (n + 1) // 2
    return BatchShape(new, context, pairs)


@dataclass(frozen=True, slots=True)
class StepCost:
    """seconds: the modelled step time. compute_seconds, memory_seconds: the two derated
    bounds (without the overhead); ``bound`` names the larger."""

    seconds: float
    compute_seconds: float
    memory_seconds: float

    @property
    def bound(self) -> str:
        return "compute" if self.compute_seconds >= self.memory_seconds else "memory"


def step_cost(profile: Profile, batch: BatchShape) -> StepCost:
    """The roofline time of one step (see the module docstring); an empty batch costs nothing."""
    if batch.new_tokens <= 0:
        return StepCost(0.0, 0.0, 0.0)
    model, device = profile.model, profile.device
    flops = 2 * model.num_params * batch.new_tokens + model.attention_flops_per_pair * batch.attention_pairs
    memory = model.weight_bytes + model.kv_bytes_per_token * (batch.context_tokens + batch.new_tokens)
    compute_s = flops / (device.flops * profile.compute_efficiency)
    memory_s = memory / (device.bandwidth * profile.bandwidth_efficiency)
    return StepCost(profile.step_overhead + max(compute_s, memory_s), compute_s, memory_s)


def step_time(profile: Profile, batch: BatchShape) -> float:
    """Seconds one step of ``batch`` takes on ``profile`` (:func:`step_cost`'s ``seconds``)."""
    return step_cost(profile, batch).seconds


# --- profiles ---------------------------------------------------------------------------------
# Device numbers are the vendors' datasheet peaks; dense BF16 is half the "with sparsity" figure.
H100_SXM = Device("H100 SXM 80GB", 80 * GIB, 3.35e12, 989e12,
                  "NVIDIA H100 Tensor Core GPU datasheet: 80 GB HBM3, 3.35 TB/s, 989 TFLOPS dense BF16 (SXM)")
H200_SXM = Device("H200 SXM 141GB", 141 * GB, 4.8e12, 989e12,
                  "NVIDIA H200 Tensor Core GPU datasheet: 141 GB HBM3e, 4.8 TB/s, 989 TFLOPS dense BF16 (SXM)")
L4 = Device("L4 24GB", 24 * GIB, 300e9, 121e12,
            "NVIDIA L4 datasheet: 24 GB GDDR6, 300 GB/s, 242 TFLOPS BF16 with sparsity (121 dense)")
# Not a real part: slow enough that a CPU keeps up with the engine's bookkeeping in tests.
TOY = Device("toy accelerator", 2 * GB, 100e9, 10e12, "made up for tests")

LLAMA3_8B = ModelShape(
    "Llama-3-8B", num_params=8.03e9, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
    hidden_size=4096, intermediate_size=14336, max_model_len=8192,
    source="meta-llama/Meta-Llama-3-8B config.json; 8.03 B parameters × 2 bytes (BF16) = 16 GB; "
           "KV 32 layers × 8 KV heads × 128 dims × 2 (K, V) × 2 bytes = 128 KiB per token")
TINY = ModelShape(
    "tiny", num_params=0.5e9, num_layers=16, num_heads=8, num_kv_heads=2, head_dim=64,
    hidden_size=512, intermediate_size=1536, max_model_len=4096,
    source="made up: about 14 ms per decode step and 8 KiB of KV per token on the toy device")

PROFILES: dict[str, Profile] = {p.name: p for p in (
    Profile("llama3-8b-h100", LLAMA3_8B, H100_SXM,
            description="Llama-3-8B BF16 on one H100 SXM: ~8 ms decode steps at batch 1, ~21 ms at 256 × 1k-token contexts, "
                        "57 GiB (~470k tokens) of KV cache"),
    Profile("llama3-8b-h200", LLAMA3_8B, H200_SXM,
            description="Llama-3-8B BF16 on one H200 SXM: ~6 ms decode steps at batch 1, ~15 ms at 256 × 1k-token contexts, "
                        "103 GiB (~850k tokens) of KV cache"),
    Profile("llama3-8b-l4", LLAMA3_8B, L4,
            description="Llama-3-8B BF16 on one L4: ~70 ms decode steps at batch 1, 6.6 GiB (~54k tokens) "
                        "of KV cache (long contexts fill it)"),
    Profile("tiny", TINY, TOY, step_overhead=0.001, max_num_seqs=8, max_num_batched_tokens=512,
            description="a fictitious small model for tests and laptops: ~14 ms decode steps, "
                        "~100k tokens of KV cache"),
)}


def get_profile(name: str) -> Profile:
    """The named profile; raises ValueError listing the known ones."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown simulation profile {name!r}; known: {', '.join(PROFILES)}") from None
