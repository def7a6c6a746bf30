"""When a decode step runs its decoder layers as one C call (:mod:`slipstream.kernels.cpu_decode`)
instead of the modules' torch path, and the weights that call reads.

A model qualifies when every layer is the plain Llama layer (:class:`.layers.DecoderLayer` with an :class:`.layers.MLP`: RMSNorm,
grouped-query attention without a soft-cap, optional q/k/v bias and Qwen3's q/k norms, a dense
SwiGLU feed-forward) and its four products are GGML blocks served as stored
(:class:`.quant.QuantLinear`, one type each); Gemma, mixture-of-experts layers, a q/k/v of mixed types
(:class:`.quant.MixedQuantLinear`, Q4_K_M's Q6_K v beside Q4_K q and k) and fp32 weights keep the torch
path. A step qualifies when it runs on the CPU attention backend, every request brings one token,
and there are at most :data:`.quant.KERNEL_MAX_ROWS` of them (above that the products dequantize
for a dense GEMM). ``SLIPSTREAM_FUSED_DECODE=0`` turns it off.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from slipstream import kernels
from slipstream.kernels import cpu_decode

from . import quant
from .layers import MLP, Attention, DecoderLayer, RMSNorm
from .quant import QuantLinear


def plan(model) -> cpu_decode.Packed | None:
    """The packed layers of ``model`` (a :class:`.llama.LlamaModel`; any module whose ``layers`` and ``cfg`` look alike), or None when it does not
    qualify (see the module docstring)."""
    if os.environ.get("SLIPSTREAM_FUSED_DECODE", "1") == "0" or not kernels.cpu_native.available():
        return None
    layers = []
    for layer in model.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if not (type(layer) is DecoderLayer and type(attn) is Attention and type(mlp) is MLP
                and mlp.activation is F.silu and attn.softcap is None and attn.scale == attn.head_dim ** -0.5
                and all(type(n) is RMSNorm for n in (layer.input_layernorm, layer.post_attention_layernorm))
                and (not attn.qk_norm or type(attn.q_norm) is type(attn.k_norm) is RMSNorm)):
            return None
        products = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if not all(type(p) is QuantLinear and p.qtype in kernels.ggml_cpu.TYPE_IDS for p in products) \
                or attn.o_proj.bias is not None:
            return None
        bias = attn.qkv_proj.bias
        layers.append(cpu_decode.LayerWeights(
            *((p.blocks, p.qtype) for p in products), layer.input_layernorm.weight.data,
            layer.post_attention_layernorm.weight.data, None if bias is None else bias.data,
            attn.q_norm.weight.data if attn.qk_norm else None, attn.k_norm.weight.data if attn.qk_norm else None,
            attn.window))
    cfg = model.cfg
    try:
        return cpu_decode.pack(layers, cpu_decode.Dims(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                                       cfg.intermediate_size, cfg.rms_norm_eps, cfg.head_dim ** -0.5))
    except ValueError:  # e.g. weights not fp32 on the CPU
        return None


def step_fits(x: torch.Tensor, kv_cache: torch.Tensor, meta, attention) -> bool:
    """Whether this step's inputs qualify (see the module docstring)."""
    return (attention.name == "cpu" and meta.max_query_len == 1 and x.shape[0] == meta.num_seqs
            and 0 < x.shape[0] <= quant.KERNEL_MAX_ROWS and x.dtype == kv_cache.dtype == torch.float32
            and kv_cache.is_contiguous())
