"""Triton prefill / chunked-prefill attention over varlen queries and a paged prefix.

A request contributes ``q_len`` new tokens at positions ``seq_len - q_len .. seq_len - 1``; the
first ``seq_len - q_len`` keys are its cached prefix (an earlier chunk, or a prefix-cache hit)
and are read through the block table like the new ones, so prefill, chunked prefill and
prefix-cache hits are one kernel (PagedAttention, Kwon et al., SOSP '23, §4.1; varlen batching
as in FlashAttention-2, Dao 2023). A program owns ``BLOCK_Q`` query tokens of one request times
the query heads of one KV head (grouped-query attention, Ainslie et al. 2023), so each K/V tile
is loaded once per group, and runs FlashAttention's online softmax over keys ``0 ..`` the tile's
last position, causally masked.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .metadata import AttentionMetadata
from .triton_common import NEG_BIG, attend_key_range, compute_in_fp32, score_args

TILE_N = 64   # keys per inner-loop step
BLOCK_M = 64  # query rows (tokens x heads of one group) per program


@triton.jit
def _prefill_kernel(query_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
                    query_start_loc_ptr, seq_lens_ptr, block_tables_ptr,
                    qk_scale, window, cap, min_q_len,
                    stride_qt, stride_qh, stride_ot, stride_oh,
                    stride_cb, stride_cs, stride_ch, stride_bt,
                    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
                    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, SOFTCAP: tl.constexpr,
                    COMPUTE_F32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    seq = tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    first_tok = q_tile * BLOCK_Q
    if (q_len < min_q_len) | (first_tok >= q_len):
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len

    # Row r is token first_tok + r // GROUP_PAD, query head kv_head * GROUP + r % GROUP_PAD.
    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    toks = first_tok + rows // GROUP_PAD
    in_group = rows % GROUP_PAD
    row_ok = (toks < q_len) & (in_group < GROUP)
    heads = kv_head * GROUP + in_group
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = row_ok[:, None] & (dims < HEAD_DIM)[None, :]
    tok_rows = (q_start + toks).to(tl.int64)
    q = tl.load(query_ptr + tok_rows[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=mask, other=0.0)
    if COMPUTE_F32:
        q = q.to(tl.float32)

    acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    m_i = tl.full([BLOCK_Q * GROUP_PAD], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    # Keys past the tile's last token, or before its first token's window, are masked for every
    # row: the loop covers only the keys between.
    key_start = tl.maximum(prefix + first_tok - window + 1, 0)
    key_end = prefix + tl.minimum(first_tok + BLOCK_Q, q_len)
    acc, m_i, l_i = attend_key_range(
        acc, m_i, l_i, q, prefix + toks, key_start, key_end, k_cache_ptr, v_cache_ptr,
        block_tables_ptr + seq.to(tl.int64) * stride_bt, kv_head, stride_cb, stride_cs, stride_ch,
        qk_scale, window, cap, BLOCK_SIZE, TILE_N, HEAD_DIM, HEAD_DIM_PAD, SOFTCAP, COMPUTE_F32, DOT_PRECISION)
    l_i = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_i[:, None]
    tl.store(out_ptr + tok_rows[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :],
             o.to(out_ptr.dtype.element_ty), mask=mask)


def prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      meta: AttentionMetadata, scale: float, out: torch.Tensor,
                      min_q_len: int = 2, block_m: int = BLOCK_M, tile_n: int = TILE_N,
                      window: int | None = None, softcap: float | None = None) -> None:
    """Write ``out`` rows of the requests with at least ``min_q_len`` new tokens.

    Args:
        query: ``[num_tokens, num_heads, head_dim]`` fp16/bf16/fp32, head_dim contiguous.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, already holding
            the new tokens' K/V.
        meta: batch layout; ``meta.max_query_len`` bounds the launch grid.
        scale: softmax scale.
        out: ``[num_tokens, num_heads, head_dim]``, query's dtype, head_dim contiguous.
        min_q_len: shorter requests are skipped (the dispatcher leaves ``q_len == 1`` to the
            decode kernel; ``1`` makes this kernel take every request).
        block_m: query rows per program (power of two); tile_n: keys per inner step.
        window: sliding window (tokens); None: the whole context. softcap: attention logit
            soft-cap; None: none.

    Raises:
        ValueError: ``window`` below 1 or ``softcap`` not positive.
    """
    qk_scale, window, cap = score_args(scale, window, softcap)
    batch = meta.num_seqs
    if batch == 0 or query.shape[0] == 0 or meta.max_query_len < min_q_len:
        return
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    block_q = max(1, block_m // group_pad)
    fp32 = compute_in_fp32(query.dtype)
    grid = (batch, triton.cdiv(meta.max_query_len, block_q), num_kv_heads)
    _prefill_kernel[grid](
        query, k_cache, v_cache, out, meta.query_start_loc, meta.seq_lens, meta.block_tables,
        qk_scale, window, cap, min_q_len,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), meta.block_tables.stride(0),
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_SIZE=block_size, TILE_N=tile_n,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim), SOFTCAP=softcap is not None,
        COMPUTE_F32=fp32, DOT_PRECISION="ieee" if fp32 else "tf32")
