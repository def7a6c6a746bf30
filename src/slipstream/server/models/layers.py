"""The layers the architectures share: RMSNorm, rotary embeddings, the CPU-aware ``Linear``,
grouped-query attention over the paged KV cache, the gated MLP and the pre-norm decoder layer.
Llama (:mod:`.llama`), Gemma (:mod:`.gemma`) and the expert layers (:mod:`.moe`) build on them.

Orca's selective batching (Yu et al., OSDI '22, §4.2): every linear layer sees the whole
``[num_tokens, hidden]`` matrix of the step — prefill chunks and decode tokens alike — and only
attention splits per request, reading each request's KV through its block table.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.kernels import AttentionBackend, AttentionMetadata

from .config import ModelConfig


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich, 2019), computed in fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` fp32 of rotary embeddings (Su et al., RoFormer, §3.4),
    with the checkpoint's scaling: ``linear`` (position interpolation, Chen et al. 2023),
    ``llama3`` (Llama 3.1's frequency-band rescaling) or ``freq_factors`` (the same as a GGUF
    stores it: llama.cpp's ``rope_freqs`` tensor, one divisor per rotary pair).

    Raises:
        ValueError: a rope scaling type this engine does not implement.
    """
    dim = cfg.head_dim
    # device="cpu": computed for real even under the meta device (whose reference ops import torch._dynamo)
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "freq_factors":  # a GGUF's rope_freqs: llama.cpp divides each pair's frequency by its factor
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32, device="cpu")
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(is_mid, mid, scaled)
    raise ValueError(f"rope scaling type {kind!r} is not supported (supported: default, linear, llama3)")


# At most this many rows, a CPU linear runs as ``W @ x.T``. MKL's fp32 GEMM for ``x @ W.T`` with
# 1-4 rows re-streams the weight per row or two (one core, SmolLM2 shapes: 57 ms for the 30
# layers at 2 rows, 24 ms as ``W @ x.T``; the LM head 25 ms vs 6 ms), and small batches are
# the long tail of every decode workload. One row is padded to two: MKL's GEMV path is slower.
# The default; :mod:`.crossover` measures this machine's at start-up.
SMALL_BATCH_ROWS = 4


def small_batch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed as ``W @ x.T``: ``x`` ``[M, K]`` (M ≥ 1), ``weight``
    ``[N, K]`` → ``[M, N]``, equal up to summation order."""
    rows = x.shape[0]
    padded = x if rows > 1 else torch.cat((x, x))
    y = torch.mm(weight, padded.t()).t()[:rows].contiguous()
    return y if bias is None else y + bias


class Linear(nn.Linear):
    """``nn.Linear`` whose small CPU batches stream the weight once (see ``SMALL_BATCH_ROWS``,
    which :mod:`.crossover` sets for this machine at start-up).

    ``x`` ``[..., in_features]`` → ``[..., out_features]``, same parameters and result as
    ``nn.Linear`` up to summation order. Only 2-D CPU inputs of 1 to ``SMALL_BATCH_ROWS`` rows
    take the ``W @ x.T`` path; GPUs and larger batches call ``F.linear``.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if x.device.type != "cpu" or x.dim() != 2 or rows > SMALL_BATCH_ROWS or rows == 0:
            return F.linear(x, self.weight, self.bias)
        return small_batch_linear(x, self.weight, self.bias)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    """Grouped-query attention over the paged KV cache, RoPE applied to q and k; Qwen3's per-head
    q/k norms (``qk_norm``, of class ``norm``), the layer's sliding window and, for subclasses
    (Gemma), a logit soft-cap and another scale."""

    def __init__(self, cfg: ModelConfig, layer: int = 0, norm: type[nn.Module] = RMSNorm,
                 qk_norm: bool | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.scale = cfg.head_dim ** -0.5
        self.softcap: float | None = None
        self.window = cfg.layer_window(layer)  # sliding window (Mistral), None for full attention
        self.qk_norm = cfg.qk_norm if qk_norm is None else qk_norm
        if self.qk_norm:  # Qwen3: per-head RMSNorm of q and k, before RoPE
            self.q_norm = norm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = norm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, attention: AttentionBackend) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        attention.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        o = attention.paged_attention(q, k_cache, v_cache, meta, self.scale, window=self.window,
                                      softcap=self.softcap)
        return self.o_proj(o.reshape(-1, self.q_size))


class MLP(nn.Module):
    """Gated feed-forward (Shazeer, 2020), ``down(act(gate(x)) * up(x))`` with gate/up fused:
    SwiGLU with the default SiLU, GeGLU with a GELU (Gemma). ``[..., hidden]`` in and out."""

    def __init__(self, cfg: ModelConfig, activation=F.silu):
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.activation(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``; ``mlp`` is the
    layer's feed-forward (an :class:`MLP`, or :class:`.moe.SparseMoE` on an expert layer).
    ``[num_tokens, hidden]`` in and out."""

    def __init__(self, cfg: ModelConfig, layer: int, mlp: nn.Module):
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, kv_cache, meta, attention):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta, attention)
        return x + self.mlp(self.post_attention_layernorm(x))
