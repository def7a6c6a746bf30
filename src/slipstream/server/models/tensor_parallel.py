"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019, §3): which slice of each weight a rank
keeps, and the two all-reduces per layer that put the slices' results back together.

A loaded model is sharded in place, layer by layer (:func:`shard_model`):

- **Attention**: each rank keeps ``num_heads / size`` query heads (their rows of the fused q/k/v,
  column-parallel) and the KV heads those query heads read. With at least as many KV heads as
  ranks, the KV heads are split too (``num_kv_heads`` must then be a multiple of ``size``); with
  fewer, each KV head is **replicated** on the ``size / num_kv_heads`` ranks whose query heads
  read it (``size`` must be a multiple of ``num_kv_heads``), as vLLM does. Each rank's KV cache
  holds only its own KV heads. ``o_proj`` is row-parallel (the columns of the rank's heads),
  summed over ranks by one all-reduce.
- **MLP**: gate/up column-parallel (``intermediate_size / size`` rows of each), down
  row-parallel, one all-reduce. **Experts** (Mixtral, Qwen3-MoE) are split the same way inside
  every expert (tensor-parallel, not expert-parallel): every rank routes every token and runs
  every chosen expert on its slice, so the load is even whatever the routing.
- **Embedding and LM head**: vocabulary-parallel; each rank keeps ``ceil(vocab / size)`` rows
  (the last padded with zeros). The embedding looks up the ids in its range and all-reduces; the
  LM head's logits are all-gathered.

GGUF blocks stay blocks: row slices are whole rows; a column slice (``o_proj``, ``down_proj``)
must fall on a block boundary (32 or 256 values), else that tensor is dequantized on the rank,
with a warning naming it. Norms, the router and rotary tables are replicated.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from typing import Protocol

import torch
from torch import nn

from slipstream.kernels import ggml_cpu

from .layers import Linear
from .moe import Experts, QuantExperts, SparseMoE
from .quant import GGMLRows, GGMLTensor, MixedQuantLinear, QuantEmbedding, QuantLinear

log = logging.getLogger("slipstream.loader")

Weight = torch.Tensor | GGMLTensor | GGMLRows


class Collectives(Protocol):
    """What a sharded model needs of its ranks (:class:`~slipstream.server.distributed.group.TensorParallelGroup`)."""

    rank: int
    size: int

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor: ...

    def all_gather(self, t: torch.Tensor) -> torch.Tensor: ...


@dataclasses.dataclass(frozen=True)
class HeadSplit:
    """Rank ``rank``'s heads: query heads ``[q_start, q_start + num_heads)`` and KV heads
    ``[kv_start, kv_start + num_kv_heads)`` of the full model."""

    q_start: int
    num_heads: int
    kv_start: int
    num_kv_heads: int


def head_split(num_heads: int, num_kv_heads: int, rank: int, size: int) -> HeadSplit:
    """The heads rank ``rank`` of ``size`` keeps (see the module's docstring).

    Raises:
        ValueError: ``num_heads`` is not a multiple of ``size``, or neither of ``num_kv_heads``
            and ``size`` is a multiple of the other.
    """
    if num_heads % size:
        raise ValueError(f"tensor parallel size {size} must divide the model's {num_heads} attention heads")
    if num_kv_heads % size and size % num_kv_heads:
        raise ValueError(f"tensor parallel size {size} and the model's {num_kv_heads} KV heads: one must be a "
                         f"multiple of the other (KV heads are split, or replicated when fewer than the ranks)")
    per_rank = num_heads // size
    q_start = rank * per_rank
    if num_kv_heads >= size:
        kv_per_rank = num_kv_heads // size
        return HeadSplit(q_start, per_rank, rank * kv_per_rank, kv_per_rank)
    return HeadSplit(q_start, per_rank, q_start // (num_heads // num_kv_heads), 1)


def check_tensor_parallel(cfg, size: int) -> None:
    """Raise ValueError, before any process starts, when the model cannot be split ``size`` ways:
    its heads (:func:`head_split`) or its (expert) MLP width."""
    head_split(cfg.num_heads, cfg.num_kv_heads, 0, size)
    for name in ("intermediate_size", "moe_intermediate_size"):
        width = getattr(cfg, name, 0)
        if width and width % size:
            raise ValueError(f"tensor parallel size {size} must divide the model's {name} ({width})")


def rows(weight: Weight, ranges: list[tuple[int, int]]) -> Weight:
    """The rows ``[start, stop)`` of each range of ``weight`` (``[rows, cols]``), stacked in order;
    GGML blocks stay blocks (a :class:`GGMLRows` keeps each part's type)."""
    if isinstance(weight, torch.Tensor):
        return torch.cat([weight[a:b] for a, b in ranges])
    parts = weight.parts if isinstance(weight, GGMLRows) else [weight]
    picked, offset = [], 0
    for a, b in ranges:
        offset = 0
        for p in parts:
            lo, hi = max(a, offset), min(b, offset + p.shape[0])
            if lo < hi:
                picked.append(GGMLTensor(p.blocks[lo - offset:hi - offset], p.qtype, (hi - lo, p.shape[1])))
            offset += p.shape[0]
    return GGMLTensor.cat(picked)


def columns(weight: Weight, start: int, stop: int, name: str) -> Weight:
    """Columns ``[start, stop)`` of ``weight`` (``[..., rows, cols]``). GGML blocks are sliced on
    block boundaries; a slice that splits a block dequantizes ``name`` (with a warning)."""
    if isinstance(weight, torch.Tensor):
        return weight[..., start:stop].contiguous()
    if isinstance(weight, GGMLRows):
        return GGMLTensor.cat([columns(p, start, stop, name) for p in weight.parts])
    per_block = ggml_cpu.BLOCK_SIZE[weight.qtype]
    if start % per_block or stop % per_block:
        log.warning("tensor parallel: %s splits at column %d, inside a %s block of %d values: dequantized to "
                    "fp32 on this rank", name, start, weight.qtype, per_block)
        return weight.dequantize()[..., start:stop].contiguous()
    nbytes = ggml_cpu.BLOCK_BYTES[weight.qtype]
    blocks = weight.blocks[..., start // per_block * nbytes:stop // per_block * nbytes].contiguous()
    return GGMLTensor(blocks, weight.qtype, (*weight.shape[:-1], stop - start))


def pad_rows(weight: Weight, count: int) -> Weight:
    """``weight`` with zero rows appended up to ``count`` rows (zero GGML bytes are zero values:
    every block's scale is 0)."""
    have = weight.shape[0]
    if have == count:
        return weight
    if isinstance(weight, GGMLRows):
        weight = weight.dequantize()
    if isinstance(weight, torch.Tensor):
        return torch.cat([weight, weight.new_zeros(count - have, *weight.shape[1:])])
    zeros = weight.blocks.new_zeros(count - have, weight.blocks.shape[1])
    return GGMLTensor(torch.cat([weight.blocks, zeros]), weight.qtype, (count, weight.shape[1]))


def linear(weight: Weight, bias: torch.Tensor | None) -> nn.Module:
    """The module multiplying by ``weight``: :class:`Linear`, :class:`QuantLinear` or :class:`MixedQuantLinear`."""
    if isinstance(weight, GGMLTensor):
        return QuantLinear(weight, bias)
    if isinstance(weight, GGMLRows):
        return MixedQuantLinear(weight, bias)
    out_features, in_features = weight.shape
    module = Linear(in_features, out_features, bias=bias is not None, device="meta")
    module.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        module.bias = nn.Parameter(bias, requires_grad=False)
    return module


def _weight(module: nn.Module) -> Weight:
    return module.weight.data if isinstance(module.weight, nn.Parameter) else module.weight


def _bias(module: nn.Module) -> torch.Tensor | None:
    return None if getattr(module, "bias", None) is None else module.bias.data


class AllReduce(nn.Module):
    """A row-parallel projection (``o_proj``, ``down_proj``, the experts), whose output on each
    rank is a partial sum: ``inner(*args)`` summed over the ranks. Shapes are ``inner``'s."""

    def __init__(self, inner: nn.Module, group: Collectives):
        super().__init__()
        self.inner = inner
        self.group = group

    def forward(self, *args, **kwargs) -> torch.Tensor:
        return self.group.all_reduce(self.inner(*args, **kwargs))


class VocabParallelEmbedding(nn.Module):
    """Rows ``[start, start + count)`` of the embedding table (``inner``, padded to the shard's
    size): ``[T]`` int64 ids → ``[T, hidden]``; ids outside the range give zeros here and their
    rows come from the rank holding them, through one all-reduce."""

    def __init__(self, inner: nn.Module, start: int, count: int, group: Collectives):
        super().__init__()
        self.inner, self.start, self.count, self.group = inner, start, count, group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        inside = (local >= 0) & (local < self.count)
        x = self.inner(torch.where(inside, local, torch.zeros_like(local)))
        return self.group.all_reduce(x.masked_fill(~inside[..., None], 0))


class VocabParallelHead(nn.Module):
    """The LM head's rows of one rank's vocabulary shard (``inner``): ``[n, hidden]`` →
    ``[n, vocab_size]``, the shards' logits all-gathered and the padding cut off."""

    def __init__(self, inner: nn.Module, vocab_size: int, group: Collectives):
        super().__init__()
        self.inner, self.vocab_size, self.group = inner, vocab_size, group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.group.all_gather(self.inner(hidden))[..., :self.vocab_size]


def _shard_attention(attn: nn.Module, split: HeadSplit, cfg, rank: int, name: str) -> None:
    d, q_size, kv_size = cfg.head_dim, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    q = (split.q_start * d, (split.q_start + split.num_heads) * d)
    k = (q_size + split.kv_start * d, q_size + (split.kv_start + split.num_kv_heads) * d)
    v = (k[0] + kv_size, k[1] + kv_size)
    qkv_bias = _bias(attn.qkv_proj)
    attn.qkv_proj = linear(rows(_weight(attn.qkv_proj), [q, k, v]),
                           None if qkv_bias is None else rows(qkv_bias, [q, k, v]))
    o_bias = _bias(attn.o_proj)  # added once, on rank 0, after the all-reduce would sum it size times
    attn.o_proj = linear(columns(_weight(attn.o_proj), *q, f"{name}.o_proj"), o_bias if rank == 0 else None)
    attn.num_heads, attn.num_kv_heads = split.num_heads, split.num_kv_heads
    attn.q_size, attn.kv_size = split.num_heads * d, split.num_kv_heads * d


def _shard_mlp(mlp: nn.Module, rank: int, size: int, name: str) -> None:
    if isinstance(mlp, SparseMoE):
        _shard_experts(mlp, rank, size, name)
        return
    width = mlp.down_proj.in_features
    a, b = rank * width // size, (rank + 1) * width // size
    mlp.gate_up_proj = linear(rows(_weight(mlp.gate_up_proj), [(a, b), (width + a, width + b)]), None)
    mlp.down_proj = linear(columns(_weight(mlp.down_proj), a, b, f"{name}.down_proj"), None)


def _shard_experts(moe: SparseMoE, rank: int, size: int, name: str) -> None:
    experts = moe.experts
    if isinstance(experts, QuantExperts):
        gate_up = GGMLTensor(experts.gate_up_blocks, experts.qtypes[0], (experts.num_experts, 2 * experts.inter, experts.hidden))
        down = GGMLTensor(experts.down_blocks, experts.qtypes[1], (experts.num_experts, experts.hidden, experts.inter))
    else:
        gate_up, down = experts.gate_up_proj.data, experts.down_proj.data
    width = down.shape[2]
    a, b = rank * width // size, (rank + 1) * width // size
    if isinstance(gate_up, GGMLTensor):
        gate_up = GGMLTensor(torch.cat([gate_up.blocks[:, a:b], gate_up.blocks[:, width + a:width + b]], dim=1),
                             gate_up.qtype, (gate_up.shape[0], 2 * (b - a), gate_up.shape[2]))
    else:
        gate_up = torch.cat([gate_up[:, a:b], gate_up[:, width + a:width + b]], dim=1)
    down = columns(down, a, b, f"{name}.experts.down_proj")
    if isinstance(gate_up, GGMLTensor) and isinstance(down, GGMLTensor):
        moe.experts = QuantExperts(gate_up, down)
        return
    dense = Experts(gate_up.shape[0], gate_up.shape[2], b - a)
    dense.gate_up_proj = nn.Parameter(gate_up.dequantize() if isinstance(gate_up, GGMLTensor) else gate_up,
                                      requires_grad=False)
    dense.down_proj = nn.Parameter(down.dequantize() if isinstance(down, GGMLTensor) else down, requires_grad=False)
    moe.experts = dense


def _shard_vocab(net: nn.Module, group: Collectives) -> None:
    vocab = net.cfg.vocab_size
    per_rank = math.ceil(vocab / group.size)
    start = min(group.rank * per_rank, vocab)
    count = min(per_rank, vocab - start)
    # A pipeline stage may hold only one of them (:mod:`.pipeline_parallel`).
    has_embed, has_head = net.embed_tokens is not None, net.lm_head is not None
    tied = has_embed and has_head and _weight(net.lm_head) is _weight(net.embed_tokens)

    def shard(module: nn.Module) -> Weight:
        return pad_rows(rows(_weight(module), [(start, start + count)]), per_rank)

    embed = None
    if has_embed:
        table = shard(net.embed_tokens)
        embed = QuantEmbedding(table) if isinstance(table, GGMLTensor) else \
            nn.Embedding(per_rank, table.shape[1], _weight=table)
        net.embed_tokens = VocabParallelEmbedding(embed, start, count, group)
    if has_head:
        head = linear(table, None) if tied else linear(shard(net.lm_head), None)
        if tied and isinstance(head, Linear) and isinstance(embed, nn.Embedding):
            head.weight = embed.weight
        net.lm_head = VocabParallelHead(head, vocab, group)


def shard_model(net: nn.Module, group: Collectives) -> nn.Module:
    """Keep rank ``group.rank``'s slice of every weight of ``net`` (a loaded
    :class:`~.llama.LlamaModel` or :class:`~.gemma.GemmaModel`, on the CPU) and insert the
    collectives; ``net.cfg`` becomes the rank's config (its own head counts, for the KV cache's
    shape). The one-call CPU decode path is turned off: it has no all-reduce between layers.
    Returns ``net``.

    Raises:
        ValueError: the model cannot be split ``group.size`` ways (:func:`check_tensor_parallel`).
    """
    cfg = net.cfg
    check_tensor_parallel(cfg, group.size)
    split = head_split(cfg.num_heads, cfg.num_kv_heads, group.rank, group.size)
    for i, layer in enumerate(net.layers):
        name = f"layers.{i}"
        attn, mlp = layer.self_attn, layer.mlp
        _shard_attention(attn, split, cfg, group.rank, f"{name}.self_attn")
        attn.o_proj = AllReduce(attn.o_proj, group)
        _shard_mlp(mlp, group.rank, group.size, f"{name}.mlp")
        if isinstance(mlp, SparseMoE):
            mlp.experts = AllReduce(mlp.experts, group)  # the routing weights are linear: sum after them
        else:
            mlp.down_proj = AllReduce(mlp.down_proj, group)
    _shard_vocab(net, group)
    net.cfg = dataclasses.replace(cfg, num_heads=split.num_heads, num_kv_heads=split.num_kv_heads)
    net._fused = None
    net.graph_safe = False  # an all-reduce per layer: decode steps run eagerly
    return net
