"""Loading a checkpoint's tensors into a decoder built from :mod:`.layers`: q/k/v and gate/up
fused, experts stacked (:mod:`.moe`), GGML blocks swapped in as quantized modules (:mod:`.quant`).
Llama and Gemma load through :func:`load_decoder_weights`."""
from __future__ import annotations

import torch
from torch import nn

from .moe import QuantExperts, hf_expert_name, stack_expert_weights
from .quant import GGMLRows, GGMLTensor, MixedQuantLinear, QuantEmbedding, QuantLinear


def _cat(parts: list) -> torch.Tensor | GGMLTensor | GGMLRows:
    """Stack weights by rows (q/k/v, gate/up): blocks stay blocks when all parts are blocks."""
    if all(isinstance(p, GGMLTensor) for p in parts):
        return GGMLTensor.cat(parts)
    return torch.cat([p.dequantize() if isinstance(p, GGMLTensor) else p for p in parts])


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
