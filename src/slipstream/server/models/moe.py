"""Sparse mixture-of-experts feed-forward: a softmax router picks ``top_k`` SwiGLU experts per token
(Shazeer et al., 2017, §2; Mixtral, Jiang et al., 2024, §2.1; Qwen3-MoE).

Experts run batched per step: the step's ``[num_tokens, hidden]`` rows are grouped by expert (one
stable sort of the ``num_tokens * top_k`` assignments) and each expert that received rows runs one
matmul pair over all of them — the Python loop is over experts, never over tokens.
"""
from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

from .config import ModelConfig
from .layers import Linear
from .quant import GGMLTensor, quant_linear


def run_experts(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, num_experts: int,
                ffn) -> torch.Tensor:
    """Weighted sum of each token's chosen experts, grouped by expert.

    Args:
        x: ``[num_tokens, hidden]`` in the model's dtype.
        experts: ``[num_tokens, top_k]`` int64 expert indices.
        weights: ``[num_tokens, top_k]`` fp32 routing weights.
        ffn: ``ffn(rows, e)``, expert ``e``'s SwiGLU on ``[n, hidden]`` rows → ``[n, hidden]``.

    Returns:
        ``[num_tokens, hidden]`` in ``x``'s dtype; the weighting and the sum over ``top_k``
        are done in fp32.
    """
    num_tokens, top_k = experts.shape
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)  # assignments grouped by expert
    # One host sync per layer: each expert's slice bounds set its matmul's shape.
    ends = torch.bincount(flat, minlength=num_experts).cumsum(0).tolist()
    rows = x[order // top_k]
    out = torch.empty_like(rows)
    start = 0
    for e, end in enumerate(ends):
        if end > start:
            out[start:end] = ffn(rows[start:end], e)
        start = end
    weighted = torch.empty(flat.numel(), x.shape[1], dtype=torch.float32, device=x.device)
    weighted[order] = out.float() * weights.reshape(-1)[order, None]  # back to (token, slot) order
    return weighted.view(num_tokens, top_k, -1).sum(1).to(x.dtype)


class Experts(nn.Module):
    """``num_experts`` SwiGLU experts stored stacked, one 3-D tensor per projection.

    ``gate_up_proj``: ``[num_experts, 2 * inter, hidden]`` (gate rows, then up rows);
    ``down_proj``: ``[num_experts, hidden, inter]``. Checkpoints' per-expert tensors are stacked
    into these at load (:func:`.decoder_weights.load_decoder_weights`).
    """

    def __init__(self, num_experts: int, hidden: int, inter: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter))

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``[num_tokens, hidden]``: :func:`run_experts` with these experts' weights."""
        def ffn(rows: torch.Tensor, e: int) -> torch.Tensor:
            gate, up = F.linear(rows, self.gate_up_proj[e]).chunk(2, dim=-1)
            return F.linear(F.silu(gate) * up, self.down_proj[e])

        return run_experts(x, experts, weights, self.gate_up_proj.shape[0], ffn)


class QuantExperts(nn.Module):
    """:class:`Experts` whose stacked projections stay in a GGUF's blocks (Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K
    ``ffn_*_exps``), multiplied by :func:`.quant.quant_linear`; CPU only, fp32 activations.

    ``gate_up_blocks``: ``[num_experts, 2 * inter, row bytes]`` uint8; ``down_blocks``:
    ``[num_experts, hidden, row bytes]`` uint8.
    """

    def __init__(self, gate_up: GGMLTensor, down: GGMLTensor):
        super().__init__()
        self.num_experts, _, self.hidden = gate_up.shape
        self.inter = down.shape[2]
        self.qtypes = (gate_up.qtype, down.qtype)
        self.register_buffer("gate_up_blocks", gate_up.blocks)
        self.register_buffer("down_blocks", down.blocks)

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """As :meth:`Experts.forward`."""
        def ffn(rows: torch.Tensor, e: int) -> torch.Tensor:
            gate, up = quant_linear(rows, self.gate_up_blocks[e], self.qtypes[0], self.hidden).chunk(2, dim=-1)
            return quant_linear(F.silu(gate) * up, self.down_blocks[e], self.qtypes[1], self.inter)

        return run_experts(x, experts, weights, self.num_experts, ffn)

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, hidden={self.hidden}, inter={self.inter}, qtypes={self.qtypes}"


class SparseMoE(nn.Module):
    """Router plus experts: ``[num_tokens, hidden]`` → ``[num_tokens, hidden]``, same dtype.

    Routing as the checkpoints were trained (transformers' Mixtral and Qwen3-MoE): router logits
    in the model's dtype, softmax over all experts in fp32, the ``num_experts_per_tok`` largest
    probabilities, rescaled to sum to 1 when ``cfg.norm_topk_prob`` (always for Mixtral).
    Parameter names: ``gate.weight`` ``[num_experts, hidden]`` (the router), ``experts.*``.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.renormalize = cfg.norm_topk_prob
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``([num_tokens, top_k]`` int64 expert indices, ``[num_tokens, top_k]`` fp32 weights)."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts, weights = self.route(x)
        return self.experts(x, experts, weights)


_MIXTRAL_EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def hf_expert_name(name: str) -> str:
    """Mixtral's tensor names in the Qwen3-MoE spelling this module loads:
    ``layers.0.block_sparse_moe.experts.3.w1.weight`` → ``layers.0.mlp.experts.3.gate_proj.weight``
    (``w1``/``w3``/``w2`` are gate/up/down); other names are returned unchanged."""
    if ".block_sparse_moe." not in name:
        return name
    parts = name.replace(".block_sparse_moe.", ".mlp.").split(".")
    if len(parts) >= 2 and parts[-2] in _MIXTRAL_EXPERT_NAMES and "experts" in parts:
        parts[-2] = _MIXTRAL_EXPERT_NAMES[parts[-2]]
    return ".".join(parts)


def stack_expert_weights(w: dict[str, torch.Tensor], prefix: str, num_experts: int) -> None:
    """Replace, in place, one MoE layer's expert tensors in ``w`` by :class:`Experts`' stacked
    parameters ``{prefix}experts.gate_up_proj`` ``[E, 2 * inter, hidden]`` and
    ``{prefix}experts.down_proj`` ``[E, hidden, inter]``.

    Accepted layouts, under ``prefix`` (e.g. ``layers.3.mlp.``): per expert
    ``experts.{e}.{gate,up,down}_proj.weight`` (Hugging Face checkpoints); stacked 3-D
    ``experts.{gate,up,down}_proj`` (GGUF's ``ffn_*_exps``); already ``gate_up_proj`` +
    ``down_proj`` (the weight cache), left as they are.

    Raises:
        ValueError: an expert's tensor is missing; the message names it.
    """
    e = prefix + "experts."
    if e + "gate_up_proj" in w:
        return
    try:
        if e + "gate_proj" in w:
            w[e + "gate_up_proj"] = _cat_rows([w.pop(e + "gate_proj"), w.pop(e + "up_proj")])
            return
        gate_up, down = [], []
        for i in range(num_experts):
            gate_up.append(_dense(torch.cat([_dense(w.pop(f"{e}{i}.gate_proj.weight")),
                                             _dense(w.pop(f"{e}{i}.up_proj.weight"))])))
            down.append(_dense(w.pop(f"{e}{i}.down_proj.weight")))
    except KeyError as err:
        raise ValueError(f"checkpoint is missing tensor {err.args[0]!r}") from None
    w[e + "gate_up_proj"] = torch.stack(gate_up)
    w[e + "down_proj"] = torch.stack(down)


def _dense(t: torch.Tensor | GGMLTensor) -> torch.Tensor:
    return t.dequantize() if isinstance(t, GGMLTensor) else t


def _cat_rows(parts: list) -> torch.Tensor | GGMLTensor:
    """Stacked experts' rows joined per expert (``[E, rows, cols]`` along rows); blocks stay
    blocks when every part has the same type and width, else fp32."""
    if all(isinstance(p, GGMLTensor) for p in parts) and len({(p.qtype, p.shape[0], p.shape[2]) for p in parts}) == 1:
        first = parts[0]
        return GGMLTensor(torch.cat([p.blocks for p in parts], dim=1), first.qtype,
                          (first.shape[0], sum(p.shape[1] for p in parts), first.shape[2]))
    return torch.cat([_dense(p) for p in parts], dim=1)
