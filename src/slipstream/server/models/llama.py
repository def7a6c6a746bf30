"""Llama-family decoder forward over one flattened token batch (Touvron et al., 2023): the
decoder stack of :mod:`.layers` with the sparse expert layers of Mixtral and Qwen3-MoE
(:mod:`.moe`), and the one-call CPU decode step (:mod:`.fused_decode`) where the layers qualify.
"""
from __future__ import annotations

import torch
from torch import nn

from slipstream import kernels
from slipstream.kernels import AttentionBackend, AttentionMetadata

from . import fused_decode
from .config import ModelConfig
from .decoder_weights import load_decoder_weights
from .layers import MLP, DecoderLayer, Linear, RMSNorm, rope_inv_freq
from .moe import SparseMoE
from .quant import GGMLTensor


class LlamaModel(nn.Module):
    """The decoder stack and LM head. Parameter names follow Hugging Face's, with q/k/v and
    gate/up fused (one matmul each) by :meth:`load_weights`. Qwen3's q/k norms and the sparse
    expert layers of Mixtral and Qwen3-MoE (:mod:`.moe`) come from the config's fields."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # _weight skips reset_parameters, whose init under the meta device imports torch._dynamo (~1.6 s)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, SparseMoE(cfg) if i in cfg.moe_layers else MLP(cfg))
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        # CUDA graphs need fixed shapes; MoE layers size each expert's matmul from the routing.
        self.graph_safe = not cfg.moe_layers
        self._fused: fused_decode.cpu_decode.Packed | None | bool = False  # False: not planned yet

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, attention: AttentionBackend | None = None,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states of the step's tokens.

        Args:
            input_ids: ``[num_tokens]`` int64, every scheduled token of every request, flattened.
            positions: ``[num_tokens]`` int64, each token's position in its request.
            kv_cache: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``.
            meta: where each request's tokens and context are (see :class:`AttentionMetadata`).
            attention: the backend the runner resolved once; None resolves one for ``input_ids``'
                device (a direct call, e.g. in tests).
            hidden: a later pipeline stage's input, ``[num_tokens, hidden_size]`` from the stage
                before (:mod:`.pipeline_parallel`); None embeds ``input_ids``.

        Returns:
            ``[num_tokens, hidden_size]`` after the final norm (before it, on a pipeline stage
            that is not the last); see :meth:`logits`.
        """
        attention = attention or kernels.resolve_backend(input_ids.device)
        meta.backend_cache.clear()  # the layout may have been refilled in place (CUDA-graph buffers)
        x = self.embed_tokens(input_ids) if hidden is None else hidden
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, head_dim], broadcast over heads
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        if fused_decode.step_fits(x, kv_cache, meta, attention) and self.fused_plan() is not None:
            x = fused_decode.cpu_decode.decode_layers(self._fused, x, cos[:, 0], sin[:, 0], meta.slot_mapping, kv_cache,
                                                      meta.block_tables, meta.seq_lens)
            return self.norm(x)
        for layer, layer_cache in zip(self.layers, kv_cache):
            x = layer(x, cos, sin, layer_cache, meta, attention)
        return x if self.norm is None else self.norm(x)

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
