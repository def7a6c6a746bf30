"""Paged attention in plain torch: the oracle for the Triton kernels and the CPU path.

Layouts: queries/keys/values ``[num_tokens, num_heads, head_dim]`` (keys/values with
``num_kv_heads``); caches ``[num_blocks, block_size, num_kv_heads, head_dim]``.
Algorithm: PagedAttention (Kwon et al., SOSP '23, §4.1) — each request reads its context
through its block table; grouped-query attention (Ainslie et al., 2023) shares a KV head
between ``num_heads // num_kv_heads`` query heads.

Two per-call options, both None by default:
- ``window`` (tokens): sliding-window attention (Longformer, Beltagy et al. 2020, §3.1; Mistral 7B,
  Jiang et al. 2023, §2): a query at position ``p`` sees keys at positions ``p - window < j <= p``
  (transformers' ``sliding_window_overlay``), so ``window`` keys including its own.
- ``softcap``: attention logit soft-capping, ``softcap * tanh(scores / softcap)`` on the scaled
  scores before the mask and softmax (Gemma 2, Gemma Team 2024, §2).
"""
from __future__ import annotations

from dataclasses import dataclass

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


@dataclass
class _Group:
    """One padded attention batch of a step; the same for every layer, so built once per step."""
    max_q: int
    block_ids: torch.Tensor  # [B * ctx_blocks] int64, each member's first ctx_blocks blocks
    ctx_blocks: int
    q_rows: torch.Tensor  # [B * max_q] int64, query row of each padded slot (clamped)
    mask: torch.Tensor  # [B, 1, max_q, ctx_blocks * block_size] bool, causal (and windowed) over the context
    # [B, ctx_blocks * block_size, 1, 1] bool: gathered key slots no valid query of the member sees
    # (past its context, behind its window, padding blocks). They hold other requests' or earlier
    # owners' K/V; masked scores still multiply their values by 0, and 0 × NaN is NaN.
    stale: torch.Tensor
    dest: torch.Tensor  # rows of ``out`` the valid slots fill: [B] for decode, [valid] for chunks
    valid: torch.Tensor | None  # [B, max_q] bool for chunks; None for decode (every slot valid)


def _group(members: list[int], max_q: int, bounds: list[int], q_lens: list[int], lens: list[int],
           block_tables: torch.Tensor, block_size: int, num_tokens: int, window: int | None = None) -> _Group:
    device = block_tables.device
    starts = torch.tensor([bounds[b] for b in members], device=device)
    q_len = torch.tensor([q_lens[b] for b in members], device=device)
    seq_len = torch.tensor([lens[b] for b in members], device=device)
    ctx_blocks = (max(lens[b] for b in members) + block_size - 1) // block_size
    tables = block_tables.index_select(0, torch.tensor(members, device=device))
    # Padded queries [B, max_q]; slot i of request b is token starts[b] + i, at position
    # seq_len - q_len + i, and sees keys 0..that position (the last ``window`` of them).
    q_idx = torch.arange(max_q, device=device)
    rows = starts[:, None] + q_idx[None, :]
    q_pos = (seq_len - q_len)[:, None] + q_idx[None, :]
    k_pos = torch.arange(ctx_blocks * block_size, device=device)
    mask = k_pos[None, None, :] <= q_pos[:, :, None]
    if window is not None:
        mask &= k_pos[None, None, :] > q_pos[:, :, None] - window
    mask = mask[:, None]
    live = k_pos[None, :] < seq_len[:, None]
    if window is not None:
        live &= k_pos[None, :] > (seq_len - q_len)[:, None] - window
    valid = None if max_q == 1 else q_idx[None, :] < q_len[:, None]
    return _Group(max_q, tables[:, :ctx_blocks].reshape(-1).long(), ctx_blocks,
                  rows.clamp(max=num_tokens - 1).reshape(-1), mask, ~live[:, :, None, None],
                  starts if valid is None else rows[valid], valid)


def _plan(meta: AttentionMetadata, block_size: int, num_tokens: int, window: int | None = None) -> list[_Group]:
    """The step's groups (:func:`context_groups` for decode rows, one more for multi-token
    chunks), built by the first layer with this ``window`` and kept in ``meta.backend_cache``
    for the others."""
    key = ("reference", block_size, num_tokens, window)
    if key in meta.backend_cache:
        return meta.backend_cache[key]
    bounds, lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
    q_lens = [end - start for start, end in zip(bounds, bounds[1:])]
    decode = [b for b, n in enumerate(q_lens) if n == 1]
    chunks = [b for b, n in enumerate(q_lens) if n > 1]
    members = [(g, 1) for g in context_groups(decode, lens)]
    if chunks:
        members.append((chunks, max(q_lens[b] for b in chunks)))
    plan = [_group(m, max_q, bounds, q_lens, lens, meta.block_tables, block_size, num_tokens, window)
            for m, max_q in members]
    meta.backend_cache[key] = plan
    return plan


def _attend_group(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, g: _Group, scale: float,
                  out: torch.Tensor, softcap: float | None = None) -> None:
    """Attention for one padded group of requests (see :class:`_Group`)."""
    num_heads, num_kv_heads, head_dim = query.shape[1], k_cache.shape[2], k_cache.shape[3]
    batch = g.mask.shape[0]
    ctx = g.ctx_blocks * k_cache.shape[1]
    # index_select copies whole blocks (2-5x faster on CPU than advanced indexing, which copies
    # element by element).
    keys = k_cache.index_select(0, g.block_ids).view(batch, ctx, num_kv_heads, head_dim)
    values = v_cache.index_select(0, g.block_ids).view(batch, ctx, num_kv_heads, head_dim)
    keys.masked_fill_(g.stale, 0.0)  # a damaged request's NaN stays its own
    values.masked_fill_(g.stale, 0.0)
    q = query.index_select(0, g.q_rows).view(batch, g.max_q, num_heads, head_dim)
    q, keys, values = q.transpose(1, 2).float(), keys.transpose(1, 2).float(), values.transpose(1, 2).float()
    if softcap is None:
        # torch's fused SDPA (flash-style on CPU); GQA by broadcasting KV heads to their query group.
        o = F.scaled_dot_product_attention(q, keys, values, attn_mask=g.mask, scale=scale,
                                           enable_gqa=num_heads > num_kv_heads)
    else:  # SDPA has no hook between the scores and the softmax: spell it out
        group = num_heads // num_kv_heads
        q = q.reshape(batch, num_kv_heads, group * g.max_q, head_dim)  # head kv_head * group + i
        scores = (q @ keys.transpose(2, 3) * scale).view(batch, num_heads, g.max_q, ctx)
        scores = softcap * torch.tanh(scores / softcap)
        probs = scores.masked_fill(~g.mask, float("-inf")).softmax(-1).nan_to_num_(0.0)  # padding rows: all masked
        o = (probs.view(batch, num_kv_heads, group * g.max_q, ctx) @ values).view(batch, num_heads, g.max_q, head_dim)
    o = o.transpose(1, 2).to(out.dtype)  # [B, max_q, h, d]; fully masked (padding) rows are never read
    if g.valid is None:
        out.index_copy_(0, g.dest, o[:, 0])
    else:
        out[g.dest] = o[g.valid]


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
                    meta: AttentionMetadata, scale: float, window: int | None = None,
                    softcap: float | None = None) -> torch.Tensor:
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
        window: sliding window in tokens (see the module docstring); None attends the whole context.
        softcap: attention logit soft-cap (see the module docstring); None leaves scores as they are.

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in ``query.dtype``.

    Raises:
        ValueError: ``window`` below 1 or ``softcap`` not positive.
    """
    check_options(window, softcap)
    out = torch.zeros_like(query)
    for group in _plan(meta, k_cache.shape[1], query.shape[0], window):
        _attend_group(query, k_cache, v_cache, group, scale, out, softcap)
    return out


def check_options(window: int | None, softcap: float | None) -> None:
    """Raise ``ValueError`` for a window below 1 token or a soft-cap that is not positive."""
    if window is not None and window < 1:
        raise ValueError(f"sliding window must be at least 1 token, got {window}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"attention soft-cap must be positive, got {softcap}")
