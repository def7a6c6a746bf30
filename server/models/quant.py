"""GGUF-quantized weights served as stored: Q4_0, Q4_1 and Q8_0 blocks kept as the file's bytes.

A :class:`GGMLTensor` is one tensor's blocks; :class:`QuantLinear` and :class:`QuantEmbedding`
use them in place of ``Linear`` / ``nn.Embedding`` on the CPU (``kernels/ggml_cpu.c``). Every
weight they multiply by is computed as the gguf package dequantizes it (fp32 multiply, then add:
bit for bit the weights transformers' GGUF loader builds), so only summation order differs from
a dense fp32 GEMM on the dequantized file. Other types (K-quants, …) are dequantized at load.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
import torch.nn.functional as F

from slipstream.kernels import ggml_cpu

# Batches of more rows dequantize the weight once into fp32 and call the dense GEMM: the kernel
# dequantizes every weight once per eight rows, and from ~16 rows MKL's GEMM on a dequantized
# copy is faster (SmolLM2 shapes, one core). The default; :mod:`.crossover` measures this
# machine's at start-up.
KERNEL_MAX_ROWS = 16


@dataclass
class GGMLTensor:
    """One GGUF tensor as stored.

    blocks: ``[rows, cols / 32 * block_bytes]`` uint8, the file's bytes, row-major; a stack of
        experts' matrices (GGUF's ``ffn_*_exps``) is ``[experts, rows, cols / 32 * block_bytes]``.
    qtype: ``"Q4_0"``, ``"Q4_1"`` or ``"Q8_0"`` (:data:`ggml_cpu.BLOCK_BYTES`).
    shape: ``(rows, cols)`` of the dequantized matrix, or ``(experts, rows, cols)``.
    """

    blocks: torch.Tensor
    qtype: str
    shape: tuple[int, ...]

    def dequantize(self) -> torch.Tensor:
        """``shape`` fp32."""
        flat = self.blocks.reshape(-1, self.blocks.shape[-1])
        return ggml_cpu.dequantize(flat, self.qtype, self.shape[-1]).reshape(self.shape)

    @staticmethod
    def cat(parts: list["GGMLTensor"]) -> "GGMLTensor | torch.Tensor":
        """Rows of ``parts`` stacked (q/k/v, gate/up fusion); fp32 if their types differ."""
        if len({p.qtype for p in parts}) != 1 or len({p.shape[1] for p in parts}) != 1:
            return torch.cat([p.dequantize() for p in parts])
        return GGMLTensor(torch.cat([p.blocks for p in parts]), parts[0].qtype,
                          (sum(p.shape[0] for p in parts), parts[0].shape[1]))


def quant_linear(x: torch.Tensor, blocks: torch.Tensor, qtype: str, in_features: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T (+ bias)``: ``x`` ``[M, in_features]`` fp32, ``blocks`` ``W``'s GGML blocks
    ``[N, row bytes]`` → ``[M, N]`` fp32. Up to :data:`KERNEL_MAX_ROWS` rows read the blocks
    directly; more dequantize ``W`` to a temporary fp32 copy for the dense GEMM."""
    if x.shape[0] <= KERNEL_MAX_ROWS:
        y = ggml_cpu.matmul(x, blocks, qtype, in_features)
        return y if bias is None else y + bias
    return F.linear(x, ggml_cpu.dequantize(blocks, qtype, in_features), bias)


def supported(qtype: str) -> bool:
    """Whether tensors of ``qtype`` can be served as stored on this machine."""
    return qtype in ggml_cpu.TYPE_IDS and ggml_cpu.available()


class QuantLinear(nn.Module):
    """``y = x @ W.T (+ bias)`` with ``W`` in GGML blocks; CPU only.

    ``x`` ``[..., in_features]`` fp32 → ``[..., out_features]`` fp32. At most
    :data:`KERNEL_MAX_ROWS` rows read the blocks directly; more rows dequantize ``W`` to a
    temporary fp32 copy for the dense GEMM.
    """

    def __init__(self, weight: GGMLTensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.qtype = weight.qtype
        self.register_buffer("blocks", weight.blocks)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @property
    def weight(self) -> GGMLTensor:
        return GGMLTensor(self.blocks, self.qtype, (self.out_features, self.in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = quant_linear(x.reshape(-1, self.in_features), self.blocks, self.qtype, self.in_features, self.bias)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, qtype={self.qtype}"


class QuantEmbedding(nn.Module):
    """Token embedding whose table stays in GGML blocks: ``[T]`` int64 ids → ``[T, dim]`` fp32,
    dequantizing only the looked-up rows.

    Raises:
        IndexError: an id outside ``[0, num_embeddings)``.
    """

    def __init__(self, weight: GGMLTensor):
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.shape
        self.qtype = weight.qtype
        self.register_buffer("blocks", weight.blocks)

    @property
    def weight(self) -> GGMLTensor:
        return GGMLTensor(self.blocks, self.qtype, (self.num_embeddings, self.embedding_dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ggml_cpu.dequantize(self.blocks, self.qtype, self.embedding_dim, ids.reshape(-1))
        return flat.reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, qtype={self.qtype}"
