"""Pipeline parallelism (GPipe, Huang et al. 2019, without micro-batches): which layers a stage
keeps. Stage 0 keeps the embedding, the last stage the final norm and the LM head; each stage's
forward pass takes the previous stage's hidden states (``[num_tokens, hidden_size]``) and hands
its own to the next (:mod:`slipstream.server.distributed.pipeline`)."""
from __future__ import annotations

import dataclasses

from torch import nn


def stage_layers(num_layers: int, stages: int, stage: int) -> tuple[int, int]:
    """Layers ``[start, stop)`` of ``stage`` of ``stages``: as even as can be, the first stages
    one more when they do not divide evenly (rank 0 schedules and samples: a little less would be
    kinder, but the last stage computes the LM head).

    Raises:
        ValueError: more stages than layers.
    """
    if stages > num_layers:
        raise ValueError(f"pipeline parallel size {stages} exceeds the model's {num_layers} layers")
    base, extra = divmod(num_layers, stages)
    start = stage * base + min(stage, extra)
    return start, start + base + (stage < extra)


def keep_stage(net: nn.Module, stage: int, stages: int) -> nn.Module:
    """Drop from a loaded model (:class:`~.llama.LlamaModel`, :class:`~.gemma.GemmaModel`) what
    ``stage`` of ``stages`` does not run; ``net.cfg`` becomes the stage's (its layers only, for the
    KV cache's shape). The one-call CPU decode path is turned off. Returns ``net``.

    Raises:
        ValueError: more stages than layers.
    """
    cfg = net.cfg
    start, stop = stage_layers(cfg.num_layers, stages, stage)
    net.layers = nn.ModuleList(list(net.layers)[start:stop])
    if stage > 0:
        net.embed_tokens = None
    if stage < stages - 1:
        net.norm = net.lm_head = None
    net.cfg = dataclasses.replace(
        cfg, num_layers=stop - start, layer_windows=cfg.layer_windows[start:stop],
        moe_layers=[i - start for i in cfg.moe_layers if start <= i < stop])
    net._fused = None
    return net
