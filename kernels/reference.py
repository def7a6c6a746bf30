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


def _gather(cache: torch.Tensor, tables: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """``[B, num_blocks * block_size, num_kv_heads, head_dim]``: each request's first
    ``num_blocks`` blocks, in order. ``index_select`` copies whole blocks (2-5× faster on CPU
    than advanced indexing, which copies element by element)."""
    batch = tables.shape[0]
    flat = cache.index_select(0, tables[:, :num_blocks].reshape(-1).long())
    return flat.view(batch, num_blocks * cache.shape[1], *cache.shape[2:])


def _attend_group(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  starts: torch.Tensor, q_lens: torch.Tensor, seq_lens: torch.Tensor,
                  block_tables: torch.Tensor, max_q: int, max_ctx: int, scale: float,
                  out: torch.Tensor) -> None:
    """Attention for a group of requests, padded to ``max_q`` queries and ``max_ctx`` keys."""
    num_heads, num_kv_heads = query.shape[1], k_cache.shape[2]
    block_size = k_cache.shape[1]
    device = query.device

    num_ctx_blocks = (max_ctx + block_size - 1) // block_size
    keys = _gather(k_cache, block_tables, num_ctx_blocks)
    values = _gather(v_cache, block_tables, num_ctx_blocks)

    # Padded queries [B, max_q, h, d]; row i of request b is token starts[b] + i.
    q_idx = torch.arange(max_q, device=device)
    rows = starts[:, None] + q_idx[None, :]
    q_valid = q_idx[None, :] < q_lens[:, None]
    q = query.index_select(0, rows.clamp(max=query.shape[0] - 1).reshape(-1)).view(*rows.shape, *query.shape[1:])

    # Query i of request b sits at position seq_len - q_len + i and sees keys 0..that position.
    q_pos = (seq_lens - q_lens)[:, None] + q_idx[None, :]
    k_pos = torch.arange(num_ctx_blocks * block_size, device=device)
    mask = k_pos[None, None, :] <= q_pos[:, :, None]  # [B, max_q, ctx]

    # torch's fused SDPA (flash-style on CPU); GQA by broadcasting KV heads to their query group.
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2).float(), keys.transpose(1, 2).float(), values.transpose(1, 2).float(),
        attn_mask=mask[:, None], scale=scale, enable_gqa=num_heads > num_kv_heads)
    o = o.transpose(1, 2).to(out.dtype)  # [B, max_q, h, d]; fully masked (padding) rows are never read
    if max_q == 1:
        out.index_copy_(0, starts, o[:, 0])
    else:
        out[rows[q_valid]] = o[q_valid]


def context_groups(requests: list[int], seq_lens: list[int], ratio: float = 2.0) -> list[list[int]]:
    """Split decode requests into groups, longest context first, each holding the requests
    whose context is at least ``1 / ratio`` of its longest one's.

    Each group is padded to its own longest context, so padding wastes under half of a group's
    gathered K/V, where one group would pad a 20-token context to the batch's 2,000.

    Args:
        requests: indices into ``seq_lens``.
        seq_lens: context length per request (tokens).

    Returns:
        Lists of request indices, each sorted by descending context.
    """
    groups: list[list[int]] = []
    for b in sorted(requests, key=seq_lens.__getitem__, reverse=True):
        if groups and seq_lens[b] * ratio >= seq_lens[groups[-1][0]]:
            groups[-1].append(b)
        else:
            groups.append([b])
    return groups


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal attention of each request's new tokens over its paged context.

    One op for prefill, chunked prefill, prefix-cache hits and decode: a request is just
    ``q_len`` new tokens at the end of a ``seq_len`` context. Decode rows (``q_len == 1``) are
    attended in batched matmuls, grouped by context length (:func:`context_groups`);
    multi-token chunks are padded as one more group so a long chunk does not pad every decode
    row. Softmax in fp32.

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
    bounds, lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
    q_lens = [end - start for start, end in zip(bounds, bounds[1:])]
    decode = [b for b, n in enumerate(q_lens) if n == 1]
    chunks = [b for b, n in enumerate(q_lens) if n > 1]
    groups = [(g, 1) for g in context_groups(decode, lens)]
    if chunks:
        groups.append((chunks, max(q_lens[b] for b in chunks)))
    device = query.device
    for members, max_q in groups:
        idx = torch.tensor(members, device=device)
        _attend_group(query, k_cache, v_cache, torch.tensor([bounds[b] for b in members], device=device),
                      torch.tensor([q_lens[b] for b in members], device=device),
                      torch.tensor([lens[b] for b in members], device=device),
                      meta.block_tables.index_select(0, idx), max_q, max(lens[b] for b in members),
                      scale, out)
    return out
