"""Triton decode attention: one new token per request over its paged context, split-K.

A program owns one request, one KV head and one partition of the context. It loads the
partition's K/V once for all ``num_heads // num_kv_heads`` query heads that share the KV head
(grouped-query attention, Ainslie et al. 2023), reading the context through the block table
(PagedAttention, Kwon et al., SOSP '23, §4.1) with an online softmax (FlashAttention, Dao et al.
NeurIPS '22). Long contexts are split across programs and the partial results combined by their
log-sum-exp in a second kernel (flash-decoding, Dao, Haziza, Massa & Sizov 2023), so a small
batch still fills the GPU.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .metadata import AttentionMetadata
from .triton_common import NEG_BIG, attend_key_range, compute_in_fp32, score_args

TILE_N = 64          # keys per inner-loop step
MIN_ROWS = 16        # tl.dot needs at least 16 rows; query heads of a group are padded to it
MIN_PARTITION = 256  # keys; shorter partitions cost more in the reduce than they win in parallelism
PROGRAMS_PER_SM = 4  # enough resident programs per SM to keep loads in flight


@triton.jit
def _decode_kernel(query_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr,
                   query_start_loc_ptr, seq_lens_ptr, block_tables_ptr,
                   qk_scale, window, cap, partition_size, num_heads, num_splits,
                   stride_qt, stride_qh, stride_ot, stride_oh,
                   stride_cb, stride_cs, stride_ch, stride_bt,
                   GROUP: tl.constexpr, ROWS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   TILE_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                   SPLIT: tl.constexpr, SOFTCAP: tl.constexpr, COMPUTE_F32: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    key_start = split * partition_size
    # Multi-token rows belong to the prefill kernel; partitions past the context are empty.
    if (q_len != 1) | (key_start >= seq_len):
        return
    key_end = tl.minimum(key_start + partition_size, seq_len)

    rows = tl.arange(0, ROWS)
    row_ok = rows < GROUP
    heads = kv_head * GROUP + rows
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = row_ok[:, None] & (dims < HEAD_DIM)[None, :]
    q_row = q_start.to(tl.int64) * stride_qt
    q = tl.load(query_ptr + q_row + heads[:, None] * stride_qh + dims[None, :], mask=mask, other=0.0)
    if COMPUTE_F32:
        q = q.to(tl.float32)
    q_pos = tl.full([ROWS], 0, tl.int32) + (seq_len - 1)

    acc = tl.zeros([ROWS, HEAD_DIM_PAD], tl.float32)
    m_i = tl.full([ROWS], NEG_BIG, tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    # Keys before the window: a partition wholly before it folds nothing (lse -1e30, weight 0).
    acc, m_i, l_i = attend_key_range(
        acc, m_i, l_i, q, q_pos, tl.maximum(key_start, seq_len - window), key_end, k_cache_ptr, v_cache_ptr,
        block_tables_ptr + seq.to(tl.int64) * stride_bt, kv_head, stride_cb, stride_cs, stride_ch,
        qk_scale, window, cap, BLOCK_SIZE, TILE_N, HEAD_DIM, HEAD_DIM_PAD, SOFTCAP, COMPUTE_F32, DOT_PRECISION)
    l_i = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_i[:, None]
    if SPLIT:
        # Partial results [seq, head, split, :] with their log2-sum-exp, combined by the reduce.
        part = (seq.to(tl.int64) * num_heads + heads) * num_splits + split
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM_PAD + dims[None, :], o, mask=mask)
        tl.store(part_lse_ptr + part, m_i + tl.log2(l_i), mask=row_ok)
    else:
        o_row = q_start.to(tl.int64) * stride_ot
        tl.store(out_ptr + o_row + heads[:, None] * stride_oh + dims[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _reduce_kernel(out_ptr, part_out_ptr, part_lse_ptr, query_start_loc_ptr, seq_lens_ptr,
                   partition_size, num_heads, num_splits, stride_ot, stride_oh,
                   SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_len != 1:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    used = tl.cdiv(seq_len, partition_size)  # partitions this request actually filled
    splits = tl.arange(0, SPLITS_PAD)
    split_ok = splits < used
    part = (seq.to(tl.int64) * num_heads + head) * num_splits + splits
    lse = tl.load(part_lse_ptr + part, mask=split_ok, other=float("-inf"))
    weight = tl.exp2(lse - tl.max(lse, 0))
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    o = tl.load(part_out_ptr + part[:, None] * HEAD_DIM_PAD + dims[None, :],
                mask=split_ok[:, None] & dim_ok[None, :], other=0.0)
    o = tl.sum(o * weight[:, None], 0) / tl.sum(weight, 0)
    tl.store(out_ptr + q_start.to(tl.int64) * stride_ot + head * stride_oh + dims,
             o.to(out_ptr.dtype.element_ty), mask=dim_ok)


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_partition(batch: int, num_kv_heads: int, max_seq_len: int, device: torch.device,
                     num_splits: int | None = None, tile_n: int = TILE_N) -> tuple[int, int]:
    """Pick ``(num_splits, partition_size)`` for a decode launch from host-side numbers only.

    Split until ``batch * num_kv_heads * num_splits`` programs fill the GPU, never into partitions
    shorter than ``MIN_PARTITION`` keys; ``num_splits`` overrides the heuristic (tests use it).
    The partition size is a multiple of ``tile_n`` keys.
    """
    if num_splits is None:
        if device.type != "cuda":
            num_splits = 1
        else:
            want = triton.cdiv(PROGRAMS_PER_SM * _num_sms(device.index or 0), max(batch * num_kv_heads, 1))
            num_splits = min(want, triton.cdiv(max_seq_len, MIN_PARTITION))
    num_splits = max(1, num_splits)
    partition = triton.cdiv(triton.cdiv(max(max_seq_len, 1), num_splits), tile_n) * tile_n
    return triton.cdiv(max(max_seq_len, 1), partition), partition


def decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     meta: AttentionMetadata, scale: float, out: torch.Tensor,
                     num_splits: int | None = None, tile_n: int = TILE_N, window: int | None = None,
                     softcap: float | None = None) -> None:
    """Write ``out`` rows of the requests with exactly one new token; other rows are untouched.

    Args:
        query: ``[num_tokens, num_heads, head_dim]`` fp16/bf16/fp32, head_dim contiguous.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, same dtype.
        meta: batch layout; requests whose query length is not 1 are skipped.
        scale: softmax scale.
        out: ``[num_tokens, num_heads, head_dim]``, query's dtype, head_dim contiguous.
        num_splits: force the number of context partitions (split-K); ``None`` picks one.
        tile_n: keys per inner step (power of two, ≥ 16).
        window: sliding window (tokens), keys ``seq_len - window ..`` only; None: the whole context.
        softcap: attention logit soft-cap; None: none.

    Raises:
        ValueError: ``window`` below 1 or ``softcap`` not positive.
    """
    qk_scale, window, cap = score_args(scale, window, softcap)
    batch = meta.num_seqs
    if batch == 0 or query.shape[0] == 0:
        return
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    splits, partition = choose_partition(batch, num_kv_heads, meta.max_seq_len, query.device,
                                         num_splits, tile_n)
    head_dim_pad = triton.next_power_of_2(head_dim)
    fp32 = compute_in_fp32(query.dtype)
    if splits > 1:
        part_out = torch.empty(batch, num_heads, splits, head_dim_pad, dtype=torch.float32,
                               device=query.device)
        part_lse = torch.empty(batch, num_heads, splits, dtype=torch.float32, device=query.device)
    else:
        part_out = part_lse = out  # unused when not splitting
    _decode_kernel[(batch, num_kv_heads, splits)](
        query, k_cache, v_cache, out, part_out, part_lse,
        meta.query_start_loc, meta.seq_lens, meta.block_tables,
        qk_scale, window, cap, partition, num_heads, splits,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), meta.block_tables.stride(0),
        GROUP=group, ROWS=max(MIN_ROWS, triton.next_power_of_2(group)), BLOCK_SIZE=block_size,
        TILE_N=tile_n, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, SPLIT=splits > 1,
        SOFTCAP=softcap is not None, COMPUTE_F32=fp32, DOT_PRECISION="ieee" if fp32 else "tf32")
    if splits > 1:
        _reduce_kernel[(batch, num_heads)](
            out, part_out, part_lse, meta.query_start_loc, meta.seq_lens,
            partition, num_heads, splits, out.stride(0), out.stride(1),
            SPLITS_PAD=triton.next_power_of_2(splits), HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad)
