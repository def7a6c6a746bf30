"""GGUF-quantized weights served as stored: Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K blocks kept as
the file's bytes.

A :class:`GGMLTensor` is one tensor's blocks; :class:`QuantLinear` and :class:`QuantEmbedding`
use them in place of ``Linear`` / ``nn.Embedding`` on the CPU (``kernels/ggml_cpu.c``). Every
weight they multiply by is computed as the gguf package dequantizes it (fp32 multiply, then add:
bit for bit the weights transformers' GGUF loader builds), so only summation order differs from
a dense fp32 GEMM on the dequantized file. Other types (Q5_0, Q2_K, Q3_K, IQ*, …) are dequantized
at load.
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

    blocks: ``[rows, ggml_cpu.row_bytes(qtype, cols)]`` uint8, the file's bytes, row-major; a stack
        of experts' matrices (GGUF's ``ffn_*_exps``) is ``[experts, rows, row bytes]``.
    qtype: a key of :data:`ggml_cpu.TYPE_IDS`.
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
    def cat(parts: list["GGMLTensor"]) -> "GGMLTensor | GGMLRows":
        """Rows of ``parts`` stacked (q/k/v, gate/up fusion): one tensor when they share a type,
        else :class:`GGMLRows` of each run of one type. ValueError if their columns differ."""
        if len({p.shape[1] for p in parts}) != 1:
            raise ValueError(f"cannot stack rows of {[p.shape[1] for p in parts]} columns")
        runs: list[GGMLTensor] = []
        for p in parts:
            if runs and runs[-1].qtype == p.qtype:
                last = runs.pop()
                p = GGMLTensor(torch.cat([last.blocks, p.blocks]), p.qtype, (last.shape[0] + p.shape[0], p.shape[1]))
            runs.append(p)
        return runs[0] if len(runs) == 1 else GGMLRows(runs)


@dataclass
class GGMLRows:
    """Row blocks of different GGML types stacked, each kept as stored: a fused q/k/v whose v is
    Q6_K beside Q4_K q and k, as llama.cpp's Q4_K_M files mix them. ``shape`` ``(rows, cols)``."""

    parts: list[GGMLTensor]

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    def dequantize(self) -> torch.Tensor:
        """``shape`` fp32."""
        return torch.cat([p.dequantize() for p in self.parts])


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


class MixedQuantLinear(nn.Module):
    """``y = x @ W.T (+ bias)`` with ``W``'s rows in parts of different GGML types
    (:class:`GGMLRows`); buffers ``blocks_0``, ``blocks_1``, … Shapes as :class:`QuantLinear`."""

    def __init__(self, weight: GGMLRows, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.qtypes = [p.qtype for p in weight.parts]
        for i, p in enumerate(weight.parts):
            self.register_buffer(f"blocks_{i}", p.blocks)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @property
    def weight(self) -> GGMLRows:
        return GGMLRows([GGMLTensor(b, t, (b.shape[0], self.in_features)) for b, t in zip(self._blocks(), self.qtypes)])

    def _blocks(self) -> list[torch.Tensor]:
        return [getattr(self, f"blocks_{i}") for i in range(len(self.qtypes))]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        y = torch.cat([quant_linear(flat, b, t, self.in_features) for b, t in zip(self._blocks(), self.qtypes)], dim=1)
        if self.bias is not None:
            y += self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, qtypes={'+'.join(self.qtypes)}"


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
