"""Paged attention in plain torch: the oracle for the Triton kernels and the CPU path.

Layouts: queries/keys/values ``[num_tokens, num_heads, head_dim]`` (keys/values with
``num_kv_heads``); caches ``[num_blocks, block_size, num_kv_heads, head_dim]``.
Algorithm: PagedAttention (Kwon et al., SOSP '23, §4.1) — each request reads its context
through its block table; grouped-query attention (Ainslie et al., 2023) shares a KV head
between ``num_heads // num_kv_heads`` query heads.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .metadata import AttentionMetadata


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter new K/V into the cache in place.

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, same dtype.
        slot_mapping: ``[num_tokens]`` int64; ``-1`` entries are skipped.
    """
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def _attend_group(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  starts: torch.Tensor, q_lens: torch.Tensor, seq_lens: torch.Tensor,
                  block_tables: torch.Tensor, max_q: int, max_ctx: int, scale: float,
                  out: torch.Tensor) -> None:
    """Attention for a group of requests, padded to ``max_q`` queries and ``max_ctx`` keys."""
    batch = seq_lens.shape[0]
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    device = query.device

    # Gather each request's context through its block table: [B, ctx, kvh, d].
    num_ctx_blocks = (max_ctx + block_size - 1) // block_size
    tables = block_tables[:, :num_ctx_blocks].long()
    keys = k_cache[tables].reshape(batch, num_ctx_blocks * block_size, num_kv_heads, head_dim)
    values = v_cache[tables].reshape(batch, num_ctx_blocks * block_size, num_kv_heads, head_dim)

    # Padded queries [B, max_q, h, d]; row i of request b is token starts[b] + i.
    q_idx = torch.arange(max_q, device=device)
    q_valid = q_idx[None, :] < q_lens[:, None]
    rows = (starts[:, None] + q_idx[None, :]).clamp(max=query.shape[0] - 1)
    q = query[rows]

    # Query i of request b sits at position seq_len - q_len + i and sees keys 0..that position.
    q_pos = (seq_lens - q_lens)[:, None] + q_idx[None, :]
    k_pos = torch.arange(num_ctx_blocks * block_size, device=device)
    mask = k_pos[None, None, :] <= q_pos[:, :, None]  # [B, max_q, ctx]

    # torch's fused SDPA (flash-style on CPU); GQA by broadcasting KV heads to their query group.
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2).float(), keys.transpose(1, 2).float(), values.transpose(1, 2).float(),
        attn_mask=mask[:, None], scale=scale, enable_gqa=group > 1)
    o = o.transpose(1, 2)  # [B, max_q, h, d]; fully masked (padding) rows are never read
    out[rows[q_valid]] = o[q_valid].to(out.dtype)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal attention of each request's new tokens over its paged context.

    One op for prefill, chunked prefill, prefix-cache hits and decode: a request is just
    ``q_len`` new tokens at the end of a ``seq_len`` context. Decode rows (``q_len == 1``) are
    attended together in one batched matmul; multi-token chunks are padded as a second group so
    a long chunk does not pad every decode row. Softmax in fp32.

    Args:
        query: ``[num_tokens, num_heads, head_dim]``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, already holding
            the new tokens' K/V (see :func:`write_kv`).
        meta: the batch layout; ``num_heads`` must be a multiple of ``num_kv_heads``.
        scale: softmax scale, usually ``head_dim ** -0.5``.

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in ``query.dtype``.
    """
    out = torch.zeros_like(query)
    starts = meta.query_start_loc[:-1].long()
    q_lens = (meta.query_start_loc[1:] - meta.query_start_loc[:-1]).long()
    seq_lens = meta.seq_lens.long()
    decode = q_lens == 1
    for sel, max_q in ((decode, 1), (~decode & (q_lens > 0), meta.max_query_len)):
        if not bool(sel.any()):
            continue
        sel_seq = seq_lens[sel]
        max_ctx = meta.max_seq_len if max_q > 1 else int(sel_seq.max())
        _attend_group(query, k_cache, v_cache, starts[sel], q_lens[sel], sel_seq,
                      meta.block_tables[sel], max_q, max_ctx, scale, out)
    return out
