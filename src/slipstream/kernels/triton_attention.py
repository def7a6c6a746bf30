"""Triton paged attention for a mixed batch: decode rows and prefill chunks in one call."""
from __future__ import annotations

import torch

from .metadata import AttentionMetadata
from .triton_common import check_inputs, check_runnable
from .triton_decode import decode_attention
from .triton_kv_write import write_kv
from .triton_prefill import prefill_attention

__all__ = ["write_kv", "paged_attention"]


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, window: int | None = None,
                    softcap: float | None = None, num_splits: int | None = None) -> torch.Tensor:
    """Causal attention of each request's new tokens over its paged context, on Triton.

    Same contract as :func:`slipstream.kernels.reference.paged_attention`. Requests with one new
    token go to the split-K decode kernel, longer ones to the prefill kernel; both launch over the
    whole batch and skip the other kind's rows on the device, so no host sync is needed. Rows
    outside every request (padding) are zero.

    Args:
        query: ``[num_tokens, num_heads, head_dim]`` fp16/bf16/fp32, head_dim contiguous.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, query's dtype.
        meta: batch layout (device tensors on query's device).
        scale: softmax scale, usually ``head_dim ** -0.5``.
        window: sliding window (tokens); softcap: attention logit soft-cap; as in the reference.
        num_splits: force the decode kernel's context partitions; ``None`` picks by occupancy.

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in ``query.dtype``.

    Raises:
        ValueError: mismatched dtypes, shapes or strides; a window below 1 or a soft-cap not positive.
        RuntimeError: CPU tensors outside Triton's interpreter.
    """
    check_runnable(query)
    check_inputs(query, k_cache, v_cache)
    out = torch.zeros_like(query, memory_format=torch.contiguous_format)
    decode_attention(query, k_cache, v_cache, meta, scale, out, num_splits=num_splits, window=window, softcap=softcap)
    prefill_attention(query, k_cache, v_cache, meta, scale, out, min_q_len=2, window=window, softcap=softcap)
    return out
