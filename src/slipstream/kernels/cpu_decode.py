"""A decode step's decoder layers in one C call on the CPU (``cpu_decode.c``), for layers whose
four products read GGML blocks: RMSNorm, q/k/v product, optional q/k norms, rotary embedding,
K/V write, paged attention, output product, SwiGLU feed-forward, residuals.

:func:`pack` lays the layers' weights out once; :func:`decode_layers` runs a step. The model
decides when a step qualifies (:mod:`slipstream.server.models.fused_decode`).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from .cpu_native import require
from .ggml_cpu import TYPE_IDS


class _Layer(ctypes.Structure):
    # the field order of cpu_decode.c's decode_layer
    _fields_ = [("qkv", ctypes.c_void_p), ("o", ctypes.c_void_p), ("gate_up", ctypes.c_void_p),
                ("down", ctypes.c_void_p), ("qkv_type", ctypes.c_int32), ("o_type", ctypes.c_int32),
                ("gate_up_type", ctypes.c_int32), ("down_type", ctypes.c_int32), ("qkv_bias", ctypes.c_void_p),
                ("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("q_norm", ctypes.c_void_p),
                ("k_norm", ctypes.c_void_p), ("window", ctypes.c_int64)]


@dataclass(frozen=True)
class LayerWeights:
    """One layer. Products as ``(blocks, qtype)``: ``blocks`` uint8 ``[N, ggml_cpu.row_bytes(qtype, K)]``
    as stored (``qkv``: q, k, v rows stacked; ``gate_up``: gate then up); norms fp32
    ``[hidden]``, ``q_norm``/``k_norm`` ``[head_dim]`` or None; ``qkv_bias`` fp32 or None;
    ``window``: the sliding window in tokens, or None."""
    qkv: tuple[torch.Tensor, str]
    o: tuple[torch.Tensor, str]
    gate_up: tuple[torch.Tensor, str]
    down: tuple[torch.Tensor, str]
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    window: int | None = None


@dataclass(frozen=True)
class Dims:
    """The model's shapes: ``hidden`` and ``inter`` (feed-forward) sizes, query and KV heads,
    ``head_dim``; ``eps`` of its RMSNorms; ``scale`` of attention scores."""
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    eps: float
    scale: float


@dataclass(frozen=True)
class Packed:
    """:func:`pack`'s result: the C array and the tensors it points into (kept alive here)."""
    array: ctypes.Array
    tensors: tuple
    dims: Dims


def pack(layers: list[LayerWeights], dims: Dims) -> Packed:
    """The layers as ``cpu_decode.c`` reads them.

    Raises:
        ValueError: a tensor that is not contiguous fp32 / uint8 on the CPU, or a block type
            without a kernel.
    """
    array = (_Layer * len(layers))()
    keep = []

    def ptr(t: torch.Tensor | None, dtype: torch.dtype) -> int | None:
        if t is None:
            return None
        if t.device.type != "cpu" or t.dtype != dtype or not t.is_contiguous():
            raise ValueError(f"a {tuple(t.shape)} {t.dtype} tensor on {t.device}: need contiguous {dtype} on the CPU")
        keep.append(t)
        return t.data_ptr()

    for slot, w in zip(array, layers):
        for name in ("qkv", "o", "gate_up", "down"):
            blocks, qtype = getattr(w, name)
            if qtype not in TYPE_IDS:
                raise ValueError(f"no CPU kernel for GGML type {qtype}")
            setattr(slot, name, ptr(blocks, torch.uint8))
            setattr(slot, f"{name}_type", TYPE_IDS[qtype])
        for name in ("qkv_bias", "input_norm", "post_norm", "q_norm", "k_norm"):
            setattr(slot, name, ptr(getattr(w, name), torch.float32))
        slot.window = w.window or 0
    return Packed(array, tuple(keep), dims)


def decode_layers(packed: Packed, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor,
                  kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """Run every packed layer over one decode step, each request one new token.

    Args:
        x: ``[M, hidden]`` fp32, the embedded tokens (M requests, row i request i).
        cos, sin: ``[M, head_dim]`` fp32, each row's rotary factors at its position.
        slot_mapping: ``[M]`` int64, each new token's cache slot (``-1``: padding, not written).
        kv_cache: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` fp32,
            contiguous; written at ``slot_mapping``.
        block_tables: ``[M, max_blocks]`` int32; seq_lens: ``[M]`` int32 (the new token included).

    Returns:
        ``[M, hidden]`` fp32, the residual stream after the last layer (before the final norm).

    Raises:
        RuntimeError: the kernel refused the shapes or ran out of memory.
    """
    d = packed.dims
    x = x.contiguous().clone()
    cos, sin = cos.contiguous(), sin.contiguous()
    slots = slot_mapping.to(torch.int64).contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    status = require().decode_layers(
        packed.array, len(packed.array), d.hidden, d.heads, d.kv_heads, d.head_dim, d.inter, d.eps, d.scale,
        x.data_ptr(), x.shape[0], cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), kv_cache.data_ptr(),
        kv_cache.shape[2], kv_cache.shape[3], tables.data_ptr(), tables.shape[1], lens.data_ptr(),
        torch.get_num_threads())
    if status:
        raise RuntimeError(f"decode_layers failed ({'out of memory' if status == -2 else 'bad shapes'})")
    return x
