"""Gemma 2 and Gemma 3 (text) decoders over one flattened token batch.

What differs from :mod:`.llama` (Gemma Team, "Gemma 2: Improving Open Language Models at a
Practical Size", 2024, §2; "Gemma 3 Technical Report", 2025, §2):

- embeddings scaled by ``sqrt(hidden_size)``, rounded to the model dtype first;
- RMSNorm scales by ``1 + weight`` in fp32 before rounding (weights are stored zero-centred);
- GeGLU feed-forward, ``gelu_tanh(gate) * up``;
- four norms per layer: before and after attention, before and after the feed-forward;
- attention scale ``query_pre_attn_scalar ** -0.5`` rather than ``head_dim ** -0.5``;
- local layers with a sliding window interleaved with global ones (Gemma 2: every other layer;
  Gemma 3: five local to one global, from ``layer_types``); the window is passed to the
  attention kernels per layer;
- Gemma 2: attention logits and final logits soft-capped (``cap * tanh(x / cap)``);
- Gemma 3: RMSNorm on each query and key head before RoPE, no attention soft-cap, RoPE base
  ``rope_local_theta`` on local layers and ``rope_theta`` with ``rope_scaling`` on global ones.

Parameter names follow Hugging Face's ``Gemma2ForCausalLM`` / ``Gemma3ForCausalLM``; a
``Gemma3ForConditionalGeneration`` checkpoint's text decoder (``model.language_model.*`` or the
older ``language_model.model.*``) is served and its vision tower ignored.
"""
from __future__ import annotations

import dataclasses
import re

import torch
from torch import nn
import torch.nn.functional as F

from slipstream import kernels
from slipstream.kernels import AttentionBackend, AttentionMetadata

from .config import ModelConfig
from .decoder_weights import load_decoder_weights
from .layers import MLP, Attention, Linear, rope_inv_freq
from .quant import GGMLTensor

ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")


def is_gemma3(cfg: ModelConfig) -> bool:
    return cfg.architecture.startswith("Gemma3")


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation: Gemma's GeGLU gate (Shazeer, 2020)."""
    return F.gelu(x, approximate="tanh")


class GemmaRMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich, 2019) scaling by ``1 + weight``, all in fp32, then rounded:
    ``[..., dim]`` in, same shape and dtype out."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


class GemmaAttention(Attention):
    """:class:`.layers.Attention` with Gemma's scale (``query_pre_attn_scalar``), Gemma 2's logit
    soft-cap, Gemma 3's ``(1 + w)`` q/k norms, and ``attention_bias`` on the output projection too."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg, layer, norm=GemmaRMSNorm, qk_norm=is_gemma3(cfg))
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        self.softcap = None if is_gemma3(cfg) else cfg.attn_logit_softcap  # Gemma 3 has none


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = GemmaAttention(cfg, layer)
        self.mlp = MLP(cfg, activation=gelu_tanh)
        eps = cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)

    def forward(self, x, cos, sin, kv_cache, meta, attention):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta, attention))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaModel(nn.Module):
    """The Gemma 2 / Gemma 3 text decoder and its (tied) LM head; same interface as
    :class:`~.llama.LlamaModel` (``forward``, ``logits``, ``load_weights``, ``cfg``)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # _weight skips reset_parameters (slow under the meta device, see LlamaModel)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(GemmaDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # Global layers: rope_theta with the checkpoint's scaling; local ones: their own base, unscaled.
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        local = dataclasses.replace(cfg, rope_theta=cfg.rope_local_theta, rope_scaling=None) if cfg.rope_local_theta else cfg
        self.register_buffer("local_inv_freq", rope_inv_freq(local), persistent=False)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, attention: AttentionBackend | None = None,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states ``[num_tokens, hidden_size]`` after the final norm; arguments as
        :meth:`~.llama.LlamaModel.forward` (``input_ids``/``positions`` ``[num_tokens]`` int64,
        ``kv_cache`` ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``, ``hidden``
        a later pipeline stage's input)."""
        attention = attention or kernels.resolve_backend(input_ids.device)
        meta.backend_cache.clear()  # the layout may have been refilled in place (CUDA-graph buffers)
        if hidden is None:
            x = self.embed_tokens(input_ids)
            x = x * torch.tensor(self.cfg.hidden_size ** 0.5, dtype=x.dtype)  # the scale rounded as Gemma's
        else:
            x = hidden
        rope = {}
        for name, inv_freq in (("global", self.inv_freq), ("local", self.local_inv_freq)):
            freqs = positions.float()[:, None] * inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, head_dim], broadcast over heads
            rope[name] = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        for layer, layer_cache in zip(self.layers, kv_cache):
            cos, sin = rope["global" if layer.self_attn.window is None else "local"]
            x = layer(x, cos, sin, layer_cache, meta, attention)
        return x if self.norm is None else self.norm(x)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, hidden_size]`` → ``[n, vocab_size]`` fp32 logits, soft-capped where the config says."""
        logits = self.lm_head(hidden).float()
        cap = self.cfg.final_logit_softcap
        return logits if cap is None else cap * torch.tanh(logits / cap)

    def load_weights(self, weights: dict[str, torch.Tensor | GGMLTensor]) -> None:
        """Load a Hugging Face-named state dict (``model.layers.0.self_attn.q_proj.weight``, …;
        a multimodal checkpoint's ``model.language_model.*`` or ``language_model.model.*``,
        whose vision tower and projector are skipped) by :func:`.decoder_weights.load_decoder_weights`:
        q/k/v and gate/up fused, GGUF blocks (:class:`~.quant.GGMLTensor`) served as stored, the
        LM head tied to the embedding unless the checkpoint has its own.

        Raises:
            ValueError: a missing or unexpected tensor, or a shape mismatch; the message names it.
        """
        w = {}
        for name, tensor in weights.items():
            name = _text_name(name)
            if name is not None:
                w[name] = tensor
        if "embed_tokens.weight" not in w:
            raise ValueError("checkpoint is missing tensor 'embed_tokens.weight'")
        w.setdefault("lm_head.weight", w["embed_tokens.weight"])  # Gemma ties the LM head
        load_decoder_weights(self, w)


# model.language_model.X (transformers 5), language_model.model.X (4.x), model.X; None: not text.
_TEXT_PREFIX = re.compile(r"^(?:model\.language_model\.|language_model\.model\.|language_model\.|model\.)")


def _text_name(name: str) -> str | None:
    """The text decoder's own name for checkpoint tensor ``name``, or None for a vision tensor."""
    if name.startswith(("model.vision_tower.", "vision_tower.", "model.multi_modal_projector.", "multi_modal_projector.")):
        return None
    return _TEXT_PREFIX.sub("", name, count=1)


def config_fields(text: dict) -> dict:
    """The :class:`ModelConfig` fields of a Gemma text config as transformers fills it in
    (``AutoConfig(...).to_dict()`` of the text part: a checkpoint's ``config.json`` may omit
    defaults, a multimodal one most of its ``text_config``).

    Handles both transformers 5 (``rope_parameters`` per layer type, ``layer_types``) and older
    files (``rope_theta``, ``rope_local_base_freq``, ``rope_scaling``, ``sliding_window_pattern``).

    Raises:
        ValueError: an activation other than the tanh GELU, or bidirectional attention.
    """
    act = text.get("hidden_activation") or text.get("hidden_act")
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"Gemma hidden_activation {act!r} is not supported (supported: gelu_pytorch_tanh)")
    if text.get("use_bidirectional_attention"):
        raise ValueError("bidirectional Gemma models (embedding models) are not supported")
    num_layers = int(text["num_hidden_layers"])
    rope = text.get("rope_parameters") or {}
    if "full_attention" in rope:  # Gemma 3, transformers 5
        full, local = rope["full_attention"], rope.get("sliding_attention") or {}
        rope_theta, local_theta = full.get("rope_theta", 1e6), local.get("rope_theta", 1e4)
        scaling = full if full.get("rope_type", "default") != "default" else None
    else:
        rope_theta = float(rope.get("rope_theta") or text.get("rope_theta") or 1e4)
        local_theta = text.get("rope_local_base_freq")
        scaling = text.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    types = text.get("layer_types")
    if not types:
        pattern = int(text.get("sliding_window_pattern") or 2)  # Gemma 2: every other layer
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    window = text.get("sliding_window")
    return {
        "rope_theta": float(rope_theta),
        "rope_local_theta": None if local_theta is None else float(local_theta),
        "rope_scaling": scaling,
        "layer_windows": [int(window) if t == "sliding_attention" and window else None for t in types],
        "attn_logit_softcap": text.get("attn_logit_softcapping"),
        "final_logit_softcap": text.get("final_logit_softcapping"),
        "query_pre_attn_scalar": float(text.get("query_pre_attn_scalar") or text.get("head_dim")),
    }


def text_config(path) -> dict:
    """The text decoder's config of the checkpoint directory ``path`` with transformers' defaults
    filled in (``AutoConfig``; a multimodal config's ``text_config``), as a plain dict."""
    from transformers import AutoConfig

    conf = AutoConfig.from_pretrained(str(path))
    return (getattr(conf, "text_config", None) or conf).to_dict()
