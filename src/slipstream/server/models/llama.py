"""Llama-family decoder forward over one flattened token batch (Touvron et al., 2023).

Orca's selective batching (Yu et al., OSDI '22, §4.2): every linear layer sees the whole
``[num_tokens, hidden]`` matrix of the step — prefill chunks and decode tokens alike — and only
attention splits per request, reading each request's KV through its block table.
"""
from __future__ import annotations

import math

import torch
from torch import nn
import torch.nn.functional as F

from slipstream import kernels
from slipstream.kernels import AttentionBackend, AttentionMetadata

from . import fused_decode
from .config import ModelConfig
from .moe import QuantExperts, SparseMoE, hf_expert_name, stack_expert_weights
from .quant import GGMLRows, GGMLTensor, MixedQuantLinear, QuantEmbedding, QuantLinear


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


def _cat(parts: list) -> torch.Tensor | GGMLTensor | GGMLRows:
    """Stack weights by rows (q/k/v, gate/up): blocks stay blocks when all parts are blocks."""
    if all(isinstance(p, GGMLTensor) for p in parts):
        return GGMLTensor.cat(parts)
    return torch.cat([p.dequantize() if isinstance(p, GGMLTensor) else p for p in parts])


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
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = SparseMoE(cfg) if layer in cfg.moe_layers else MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, kv_cache, meta, attention):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta, attention)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """The decoder stack and LM head. Parameter names follow Hugging Face's, with q/k/v and
    gate/up fused (one matmul each) by :meth:`load_weights`. Qwen3's q/k norms and the sparse
    expert layers of Mixtral and Qwen3-MoE (:mod:`.moe`) come from the config's fields."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # _weight skips reset_parameters, whose init under the meta device imports torch._dynamo (~1.6 s)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        # CUDA graphs need fixed shapes; MoE layers size each expert's matmul from the routing.
        self.graph_safe = not cfg.moe_layers
        self._fused: fused_decode.cpu_decode.Packed | None | bool = False  # False: not planned yet

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, attention: AttentionBackend | None = None) -> torch.Tensor:
        """Hidden states of the step's tokens.

        Args:
            input_ids: ``[num_tokens]`` int64, every scheduled token of every request, flattened.
            positions: ``[num_tokens]`` int64, each token's position in its request.
            kv_cache: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``.
            meta: where each request's tokens and context are (see :class:`AttentionMetadata`).
            attention: the backend the runner resolved once; None resolves one for ``input_ids``'
                device (a direct call, e.g. in tests).

        Returns:
            ``[num_tokens, hidden_size]`` after the final norm; see :meth:`logits`.
        """
        attention = attention or kernels.resolve_backend(input_ids.device)
        meta.backend_cache.clear()  # the layout may have been refilled in place (CUDA-graph buffers)
        x = self.embed_tokens(input_ids)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, head_dim], broadcast over heads
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        if fused_decode.step_fits(x, kv_cache, meta, attention) and self.fused_plan() is not None:
            x = fused_decode.cpu_decode.decode_layers(self._fused, x, cos[:, 0], sin[:, 0], meta.slot_mapping, kv_cache,
                                                      meta.block_tables, meta.seq_lens)
            return self.norm(x)
        for layer, layer_cache in zip(self.layers, kv_cache):
            x = layer(x, cos, sin, layer_cache, meta, attention)
        return self.norm(x)

    def fused_plan(self):
        """The layers packed for one-call decode steps (:mod:`.fused_decode`), or None when this
        model's layers do not qualify; planned on first use, again after :meth:`load_weights`."""
        if self._fused is False:
            self._fused = fused_decode.plan(self)
        return self._fused

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, hidden_size]`` → ``[n, vocab_size]`` fp32 logits."""
        return self.lm_head(hidden).float()

    def load_weights(self, weights: dict[str, torch.Tensor | GGMLTensor]) -> None:
        """Load a Hugging Face-named state dict (``model.layers.0.self_attn.q_proj.weight``, …)
        or one already in this module's fused layout: :func:`load_decoder_weights`. Without an
        ``lm_head.weight`` the config must tie the word embeddings.

        Raises:
            ValueError: a missing or unexpected tensor, or a shape mismatch; the message names it.
        """
        self._fused = False
        w = {k.removeprefix("model."): v for k, v in weights.items()}
        if "lm_head.weight" not in w:
            if not self.cfg.tie_word_embeddings:
                raise ValueError("checkpoint has no lm_head.weight and does not tie word embeddings")
            w["lm_head.weight"] = w["embed_tokens.weight"]
        load_decoder_weights(self, w)


def load_decoder_weights(net: nn.Module, weights: dict[str, torch.Tensor | GGMLTensor]) -> None:
    """Load ``weights`` into a decoder with this module's layout (``embed_tokens``,
    ``layers.N.self_attn.qkv_proj``, ``layers.N.mlp.gate_up_proj`` or experts, ``norm``,
    ``lm_head``; ``net.cfg`` its config), names without the ``model.`` prefix: q/k/v and gate/up
    are fused (unless already), per-expert tensors (Qwen3-MoE's names or Mixtral's
    ``block_sparse_moe.experts.N.w1``) stacked by :func:`.moe.stack_expert_weights`, and a
    :class:`~.quant.GGMLTensor` weight replaces its ``Linear`` / ``Embedding`` by the quantized
    module (CPU only). The LM head is the embedding when the config ties them or ``lm_head.weight``
    is the embedding's own tensor.

    Raises:
        ValueError: a missing or unexpected tensor, or a shape mismatch; the message names it.
    """
    cfg = net.cfg
    w = {hf_expert_name(k): v for k, v in weights.items()}
    tied = cfg.tie_word_embeddings or w.get("lm_head.weight") is w.get("embed_tokens.weight")
    fused: dict[str, torch.Tensor] = {}
    already_fused = "layers.0.self_attn.qkv_proj.weight" in w  # e.g. from the weight cache
    for i in range(0 if already_fused else cfg.num_layers):
        p = f"layers.{i}."
        try:
            for kind in ("weight", "bias") if cfg.attention_bias else ("weight",):
                fused[p + f"self_attn.qkv_proj.{kind}"] = _cat(
                    [w.pop(p + f"self_attn.{n}_proj.{kind}") for n in "qkv"])
            if i in cfg.moe_layers:
                stack_expert_weights(w, p + "mlp.", cfg.num_experts)
            else:
                fused[p + "mlp.gate_up_proj.weight"] = _cat(
                    [w.pop(p + "mlp.gate_proj.weight"), w.pop(p + "mlp.up_proj.weight")])
        except KeyError as e:
            raise ValueError(f"checkpoint is missing tensor {e.args[0]!r}") from None
    w.update(fused)
    w = {k: v for k, v in w.items() if not k.endswith("rotary_emb.inv_freq")}
    for name in [k for k in w if k.endswith("experts.gate_up_proj")]:
        _use_quantized_experts(net, name.removesuffix("gate_up_proj"), w)
    for name in [k for k, v in w.items() if isinstance(v, (GGMLTensor, GGMLRows))]:
        _use_quantized(net, name.removesuffix(".weight"), w.pop(name), w)
    own = net.state_dict()
    missing = sorted(set(own) - set(w))
    unexpected = sorted(set(w) - set(own))
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match the {cfg.architecture} architecture: "
                         f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, tensor in w.items():
        if tuple(tensor.shape) != tuple(own[name].shape):
            raise ValueError(f"tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(own[name].shape)}")
    net.load_state_dict(w, strict=True, assign=True)
    if tied and not isinstance(net.lm_head, QuantLinear):
        net.lm_head.weight = net.embed_tokens.weight


def _use_quantized_experts(net: nn.Module, prefix: str, w: dict) -> None:
    """Swap the :class:`.moe.Experts` at ``prefix`` (``layers.N.mlp.experts.``) for
    :class:`.moe.QuantExperts` when both its stacked projections in ``w`` are GGML blocks;
    a projection in blocks beside a dense one is dequantized."""
    gate_up, down = w[prefix + "gate_up_proj"], w[prefix + "down_proj"]
    if not (isinstance(gate_up, GGMLTensor) and isinstance(down, GGMLTensor)):
        for name in (prefix + "gate_up_proj", prefix + "down_proj"):
            if isinstance(w[name], GGMLTensor):
                w[name] = w[name].dequantize()
        return
    path = prefix.removesuffix(".")
    old = net.get_submodule(path)
    for got, want in ((gate_up.shape, old.gate_up_proj.shape), (down.shape, old.down_proj.shape)):
        if tuple(got) != tuple(want):
            raise ValueError(f"tensors {path}.*: shape {tuple(got)}, expected {tuple(want)}")
    parent_path, _, attr = path.rpartition(".")
    setattr(net.get_submodule(parent_path), attr, QuantExperts(gate_up, down))
    del w[prefix + "gate_up_proj"], w[prefix + "down_proj"]
    w[prefix + "gate_up_blocks"], w[prefix + "down_blocks"] = gate_up.blocks, down.blocks


def _use_quantized(net: nn.Module, path: str, weight: GGMLTensor | GGMLRows, w: dict) -> None:
    """Swap the module at ``path`` of ``net`` for its quantized form; its state-dict entries in
    ``w`` become ``path.blocks`` (``path.blocks_N`` for mixed types; the bias kept as given)."""
    parent_path, _, attr = path.rpartition(".")
    parent = net.get_submodule(parent_path) if parent_path else net
    old = getattr(parent, attr)
    expected = tuple(old.weight.shape)
    if weight.shape != expected:
        raise ValueError(f"tensor {path}.weight has shape {weight.shape}, expected {expected}")
    if isinstance(old, nn.Embedding):
        new = QuantEmbedding(weight)
    else:
        bias = w.get(path + ".bias")
        bias = None if bias is None else torch.empty_like(bias, device="cpu")
        new = MixedQuantLinear(weight, bias) if isinstance(weight, GGMLRows) else QuantLinear(weight, bias)
    setattr(parent, attr, new)
    if isinstance(weight, GGMLRows):
        w.update({f"{path}.blocks_{i}": p.blocks for i, p in enumerate(weight.parts)})
    else:
        w[path + ".blocks"] = weight.blocks
