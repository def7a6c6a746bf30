"""The KV cache's size from what the GPU has: ``total × utilization`` minus everything else.

As vLLM does (``--gpu-memory-utilization``, default 0.9): after the weights are loaded, one
profiling forward pass at the step's token budget gives the peak of activations (and the sampler's
``[rows, vocab]`` buffers), a decode pass at the largest CUDA-graph bucket gives what the graphs'
memory pool will hold, and the KV block pool gets what is left of this engine's share::

    kv = total × utilization − used − peak_activations − graph_reserve

``used`` is the device's memory in use after profiling with torch's cache emptied: the weights,
the CUDA context and libraries' workspaces, and whatever other processes hold (so two engines on
one GPU each ask for their own fraction, as with vLLM).
"""
from __future__ import annotations

from dataclasses import dataclass

GiB = 1 << 30


@dataclass(frozen=True)
class MemoryProfile:
    """What the profiling pass measured, bytes.

    Attributes:
        total: the device's memory.
        free: free after profiling, torch's cache emptied (``torch.cuda.mem_get_info``).
        weights: the model's parameters and buffers (reported; already inside ``total - free``).
        peak_activations: the forward pass's and sampler's peak beyond what was allocated before it.
        graph_reserve: set aside for the CUDA graphs' memory pool (0 with ``enforce_eager``).
    """

    total: int
    free: int
    weights: int
    peak_activations: int
    graph_reserve: int


@dataclass(frozen=True)
class KVCachePlan:
    """The KV pool's size and how it was reached (for the start-up log line)."""

    kv_cache_bytes: int
    num_blocks: int
    budget: int  # total × utilization
    used: int    # total − free

    def describe(self, profile: MemoryProfile, utilization: float) -> str:
        return (f"GPU memory: {profile.total / GiB:.1f} GiB total × {utilization:g} = {self.budget / GiB:.2f} GiB; "
                f"in use {self.used / GiB:.2f} GiB (weights {profile.weights / GiB:.2f}), peak activations "
                f"{profile.peak_activations / GiB:.2f} GiB, CUDA graphs {profile.graph_reserve / GiB:.2f} GiB "
                f"-> KV cache {self.kv_cache_bytes / GiB:.2f} GiB ({self.num_blocks} blocks)")


def plan_kv_cache(profile: MemoryProfile, utilization: float, block_bytes: int, block_size: int,
                  max_model_len: int) -> KVCachePlan:
    """Size the KV block pool from a :class:`MemoryProfile`.

    Args:
        profile: the measured numbers.
        utilization: fraction in (0, 1] of ``profile.total`` this engine may use.
        block_bytes: bytes of one block across all layers (K and V).
        block_size: tokens per block.
        max_model_len: the longest request; the pool must hold at least one.

    Returns:
        The plan: whole blocks only, ``kv_cache_bytes = num_blocks × block_bytes``.

    Raises:
        ValueError: ``utilization`` outside (0, 1], or the pool would not hold one request of
            ``max_model_len`` tokens; the message gives the numbers and what to change.
    """
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    budget = int(profile.total * utilization)
    used = profile.total - profile.free
    left = budget - used - profile.peak_activations - profile.graph_reserve
    num_blocks = max(left, 0) // block_bytes
    needed = -(-max_model_len // block_size)
    if num_blocks < needed:
        raise ValueError(
            f"no room for the KV cache of one {max_model_len}-token request ({needed * block_bytes / GiB:.2f} GiB): "
            f"gpu_memory_utilization {utilization:g} of {profile.total / GiB:.1f} GiB is {budget / GiB:.2f} GiB, and "
            f"{used / GiB:.2f} GiB is in use (weights {profile.weights / GiB:.2f} GiB, the rest CUDA context and other "
            f"processes), peak activations take {profile.peak_activations / GiB:.2f} GiB and CUDA graphs "
            f"{profile.graph_reserve / GiB:.2f} GiB, leaving {max(left, 0) / GiB:.2f} GiB. Raise "
            f"--gpu-memory-utilization, lower --max-model-len or --max-num-batched-tokens, pass --enforce-eager, "
            f"or give --kv-cache-memory-bytes")
    return KVCachePlan(num_blocks * block_bytes, num_blocks, budget, used)
