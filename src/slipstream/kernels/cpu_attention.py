"""Paged attention on the CPU: decode rows read their K/V in place (``cpu_attention.c``); prefill
chunks, other dtypes and machines without the compiled kernels take :mod:`.reference`.

Same contract as :func:`reference.paged_attention`; the results differ from it only in
summation order (fp32 throughout).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import reference
from .cpu_native import library
from .metadata import AttentionMetadata

write_kv = reference.write_kv


@dataclass
class _Plan:
    """A step's split, the same for every layer: built once per forward pass."""
    q_rows: torch.Tensor  # [n] int64, query row of each decode request
    tables: torch.Tensor  # [n, max_blocks] int32, contiguous
    seq_lens: torch.Tensor  # [n] int32
    chunks: reference._Group | None  # the multi-token requests, padded, for the reference


def _plan(meta: AttentionMetadata, block_size: int, num_tokens: int, window: int | None) -> _Plan:
    key = ("cpu", block_size, num_tokens, window)
    if key in meta.backend_cache:
        return meta.backend_cache[key]
    bounds, lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
    q_lens = [end - start for start, end in zip(bounds, bounds[1:])]
    decode = [b for b, n in enumerate(q_lens) if n == 1]
    chunks = [b for b, n in enumerate(q_lens) if n > 1]
    idx = torch.tensor(decode, dtype=torch.int64)
    plan = _Plan(torch.tensor([bounds[b] for b in decode], dtype=torch.int64),
                 meta.block_tables.index_select(0, idx).to(torch.int32).contiguous(),
                 meta.seq_lens.index_select(0, idx).to(torch.int32).contiguous(),
                 reference._group(chunks, max(q_lens[b] for b in chunks), bounds, q_lens, lens, meta.block_tables,
                                  block_size, num_tokens, window) if chunks else None)
    meta.backend_cache[key] = plan
    return plan


def usable(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether :func:`paged_attention` runs the compiled kernel for these tensors."""
    return (query.device.type == "cpu" and query.dtype == k_cache.dtype == torch.float32
            and k_cache.is_contiguous() and library() is not None)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, window: int | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    """Causal attention of each request's new tokens over its paged context.

    Args/returns as :func:`reference.paged_attention`: ``query`` ``[num_tokens, num_heads,
    head_dim]``, caches ``[num_blocks, block_size, num_kv_heads, head_dim]``; output like
    ``query``; ``window`` (tokens) and ``softcap`` as there.

    Raises:
        ValueError: as :func:`reference.paged_attention`.
        RuntimeError: the kernel refused the shapes (heads not a multiple of KV heads) or ran
            out of memory.
    """
    if not (usable(query, k_cache) and v_cache.is_contiguous()):
        return reference.paged_attention(query, k_cache, v_cache, meta, scale, window, softcap)
    reference.check_options(window, softcap)
    num_tokens, num_heads, head_dim = query.shape
    plan = _plan(meta, k_cache.shape[1], num_tokens, window)
    query = query.contiguous()
    out = torch.zeros_like(query)
    n = plan.q_rows.numel()
    if n:
        status = library().paged_decode_attention(
            query.data_ptr(), plan.q_rows.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), plan.tables.data_ptr(),
            plan.tables.shape[1], plan.seq_lens.data_ptr(), n, num_heads, k_cache.shape[2], head_dim,
            k_cache.shape[1], scale, window or 0, softcap or 0.0, out.data_ptr(), torch.get_num_threads())
        if status:
            raise RuntimeError(f"paged_decode_attention failed ({'out of memory' if status == -2 else 'bad shapes'})")
    if plan.chunks is not None:
        reference._attend_group(query, k_cache, v_cache, plan.chunks, scale, out, softcap)
    return out
