"""Triton KV write: scatter the step's new K/V into the paged cache through the slot mapping.

Each new token has a slot ``block * block_size + offset`` chosen by the block manager
(PagedAttention, Kwon et al., SOSP '23, §4.1); padding tokens carry slot ``-1`` and are skipped,
so a padded batch (e.g. a captured CUDA graph's fixed size) writes nothing for them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import check_runnable


@triton.jit
def _write_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                     num_kv_heads, stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cb, stride_cs, stride_ch,
                     BLOCK_SIZE: tl.constexpr, HEADS_PAD: tl.constexpr,
                     HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    # Mask instead of branching: a padding token (slot -1) loads and stores nothing. The slot is
    # broadcast before comparing: the interpreter types scalar-bool & tensor-bool as an integer.
    keep = ((slot + tl.zeros([HEADS_PAD], tl.int64)) >= 0) & (heads < num_kv_heads)
    mask = keep[:, None] & (dims < HEAD_DIM)[None, :]
    src = heads[:, None] * stride_kh + dims[None, :]
    k = tl.load(key_ptr + token.to(tl.int64) * stride_kt + src, mask=mask)
    src = heads[:, None] * stride_vh + dims[None, :]
    v = tl.load(value_ptr + token.to(tl.int64) * stride_vt + src, mask=mask)
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs \
        + heads[:, None] * stride_ch + dims[None, :]
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter new K/V into the cache in place, converting to the cache's dtype (as torch rounds).

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``, any strides with head_dim
            contiguous (e.g. views into a fused QKV projection).
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, shared strides,
            head_dim contiguous.
        slot_mapping: ``[num_tokens]`` int64 (or int32); ``-1`` entries are skipped.

    Raises:
        ValueError: shapes or strides the kernel does not handle.
        RuntimeError: CPU tensors outside Triton's interpreter.
    """
    check_runnable(key)
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape or k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError(f"write_kv: key {tuple(key.shape)} / value {tuple(value.shape)} and k_cache "
                         f"{tuple(k_cache.shape)} / v_cache {tuple(v_cache.shape)} must match pairwise")
    if tuple(k_cache.shape[2:]) != (num_kv_heads, head_dim):
        raise ValueError(f"write_kv: key heads/dim {(num_kv_heads, head_dim)} do not match the cache's "
                         f"{tuple(k_cache.shape[2:])}")
    if key.stride(2) != 1 or value.stride(2) != 1 or k_cache.stride(3) != 1:
        raise ValueError("write_kv: head_dim must be the contiguous (stride 1) dimension")
    if num_tokens == 0:
        return
    # Cast on the host (rare: the engine computes K/V in the cache dtype) so the kernel copies bits
    # and rounds exactly like torch.
    key, value = key.to(k_cache.dtype), value.to(v_cache.dtype)
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, num_kv_heads,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        BLOCK_SIZE=k_cache.shape[1], HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim))
