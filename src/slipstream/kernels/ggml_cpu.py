"""CPU products over GGML-quantized weights as stored (Q4_0, Q4_1, Q8_0 and the K-quants Q4_K, Q5_K,
Q6_K): ``ggml_cpu.c``, built
by :mod:`.cpu_native` (None there means: serve dequantized weights instead).
"""
from __future__ import annotations

import torch

from .cpu_native import library, require as _require

# GGML type ids (gguf.GGMLQuantizationType), weights per block and bytes per block
# (K-quants: super-blocks of 256).
TYPE_IDS = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
BLOCK_SIZE = {"Q4_0": 32, "Q4_1": 32, "Q8_0": 32, "Q4_K": 256, "Q5_K": 256, "Q6_K": 256}
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def row_bytes(qtype: str, k: int) -> int:
    """Bytes of one row of ``k`` weights of ``qtype`` (``k`` a multiple of its block size)."""
    return k // BLOCK_SIZE[qtype] * BLOCK_BYTES[qtype]


def available() -> bool:
    return library() is not None


def _check(blocks: torch.Tensor, qtype: str, k: int) -> int:
    if qtype not in TYPE_IDS:
        raise ValueError(f"no CPU kernel for GGML type {qtype} (have {', '.join(TYPE_IDS)})")
    if k % BLOCK_SIZE[qtype] or blocks.dtype != torch.uint8 or not blocks.is_contiguous() \
            or blocks.shape[-1] != row_bytes(qtype, k):
        raise ValueError(f"{qtype} blocks {tuple(blocks.shape)} {blocks.dtype} do not hold rows of {k} weights")
    return TYPE_IDS[qtype]


def matmul(x: torch.Tensor, blocks: torch.Tensor, qtype: str, k: int) -> torch.Tensor:
    """``x @ W.T`` with ``W`` read from its GGML blocks.

    Args:
        x: ``[M, k]`` fp32 CPU activations (any M; rows are taken up to eight at a time, each
            weight row dequantized once per eight rows, so large M is better served by
            :func:`dequantize` and a dense GEMM).
        blocks: ``[N, row_bytes(qtype, k)]`` uint8, the tensor's blocks as stored in the GGUF file.
        qtype: a key of :data:`TYPE_IDS`.
        k: weights per row, a multiple of the type's block size (32; 256 for K-quants).

    Returns:
        ``[M, N]`` fp32.

    Raises:
        ValueError: an unknown type or blocks that do not match ``k``.
        RuntimeError: the kernels are not available (see :func:`library`).
    """
    lib = _require()
    type_id = _check(blocks, qtype, k)
    x = x.contiguous()
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [M, {k}] float32, got {tuple(x.shape)} {x.dtype}")
    y = torch.empty(x.shape[0], blocks.shape[0], dtype=torch.float32)
    lib.ggml_matmul(type_id, blocks.data_ptr(), blocks.shape[0], k, x.data_ptr(), x.shape[0], y.data_ptr(),
                    torch.get_num_threads())
    return y


def dequantize(blocks: torch.Tensor, qtype: str, k: int, ids: torch.Tensor | None = None) -> torch.Tensor:
    """Rows of ``W`` as fp32: ``[len(ids) or N, k]``, equal to the gguf package's dequantization.

    ``ids``: ``[R]`` int64 row indices (an embedding lookup), or None for every row.
    Raises as :func:`matmul`, and IndexError for an id outside ``[0, N)``.
    """
    lib = _require()
    type_id = _check(blocks, qtype, k)
    if ids is not None:
        ids = ids.to(torch.int64).contiguous()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= blocks.shape[0]):
            raise IndexError(f"row id out of range [0, {blocks.shape[0]})")
    rows = blocks.shape[0] if ids is None else ids.numel()
    out = torch.empty(rows, k, dtype=torch.float32)
    lib.ggml_dequantize(type_id, blocks.data_ptr(), k, None if ids is None else ids.data_ptr(), rows,
                        out.data_ptr(), torch.get_num_threads())
    return out
