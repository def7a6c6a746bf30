"""CPU products over GGML-quantized weights as stored (Q4_0, Q4_1, Q8_0): ``ggml_cpu.c``, built
by :mod:`.cpu_native` (None there means: serve dequantized weights instead).
"""
from __future__ import annotations

import torch

from .cpu_native import library, require as _require

# GGML type ids (gguf.GGMLQuantizationType) and bytes per block of 32 weights.
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
TYPE_IDS = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8}
BLOCK_SIZE = 32


def available() -> bool:
    return library() is not None


def _check(blocks: torch.Tensor, qtype: str, k: int) -> int:
    if qtype not in TYPE_IDS:
        raise ValueError(f"no CPU kernel for GGML type {qtype} (have {', '.join(TYPE_IDS)})")
    if k % BLOCK_SIZE or blocks.dtype != torch.uint8 or not blocks.is_contiguous() \
            or blocks.shape[-1] != k // BLOCK_SIZE * BLOCK_BYTES[qtype]:
        raise ValueError(f"{qtype} blocks {tuple(blocks.shape)} {blocks.dtype} do not hold rows of {k} weights")
    return TYPE_IDS[qtype]


def matmul(x: torch.Tensor, blocks: torch.Tensor, qtype: str, k: int) -> torch.Tensor:
    """``x @ W.T`` with ``W`` read from its GGML blocks.

    Args:
        x: ``[M, k]`` fp32 CPU activations (any M; rows are taken up to eight at a time, each
            weight row dequantized once per eight rows, so large M is better served by
            :func:`dequantize` and a dense GEMM).
        blocks: ``[N, k / 32 * block_bytes]`` uint8, the tensor's blocks as stored in the GGUF file.
        qtype: ``"Q4_0"``, ``"Q4_1"`` or ``"Q8_0"``.
        k: weights per row.

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
