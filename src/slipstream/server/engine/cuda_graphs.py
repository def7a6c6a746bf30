"""CUDA graphs for decode steps: one captured forward pass per batch-size bucket.

A decode step of a small model is mostly kernel-launch overhead when launched eagerly (dozens of
kernels per layer, each a few microseconds of CPU time); replaying a captured graph launches them
all at once. As in vLLM, SGLang and nano-vllm: every forward input lives in a static buffer of
the bucket's size, a batch is padded up to the nearest bucket (padding sequences write no K/V and
attend to one token), prefill and mixed steps stay eager.

Graph safety: the captured forward must not sync with the host or change shapes between replays.
Launch shapes come from host-side numbers fixed at capture — the bucket's size, the block table's
width, and ``max_seq_len = max_model_len`` for the decode kernel's split — while each request's
real context length is read from ``seq_lens`` on the device. The int32 metadata is cast from the
step's one int64 transfer inside the graph, so a replay is one host→device copy and one launch.

Without a GPU the same buffers and padding run eagerly (``capture=False``): the CPU tests check
that the padded step gives the unpadded step's tokens.
"""
from __future__ import annotations

import bisect
import logging

import numpy as np
import torch

from slipstream.kernels import AttentionBackend

from ..models.llama import LlamaModel
from .scheduler import SchedulerOutput
from .step_inputs import HostStep, Transfer, dummy_step, layout, unpack

log = logging.getLogger("slipstream.engine")


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch-size buckets to capture: powers of two below ``max_num_seqs``, then ``max_num_seqs``
    (1, 2, 4, …, 32 for 32; 1, 2, 4, 8, 12 for 12). Padding costs under 2× the rows, and a decode
    step's time is mostly reading the weights, which padding does not add to.

    Raises:
        ValueError: ``max_num_seqs < 1``.
    """
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes, size = [], 1
    while size < max_num_seqs:
        sizes.append(size)
        size *= 2
    return sizes + [max_num_seqs]


def bucket(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest of ``sizes`` (ascending) holding ``num_seqs`` sequences; None if none does."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


class _Graph:
    """One bucket: its static input buffers, output, and (on CUDA) the captured graph."""

    def __init__(self, size: int, width: int, max_seq_len: int, device: torch.device):
        self.size, self.width = size, width
        # Padding only, in the transfer layout of a step of this size; the decode kernel's split is
        # sized for the longest context any replay may bring.
        self.dummy = dummy_step([1] * size, width)
        self.dummy.max_seq_len = max_seq_len
        self.flat = torch.from_numpy(np.concatenate(self.dummy.parts())).to(device)
        self.inputs = unpack(self.flat, self.dummy)  # int64 views of flat; the int32 casts are the static metadata
        self.graph: torch.cuda.CUDAGraph | None = None
        self.hidden: torch.Tensor | None = None


class DecodeGraphs:
    """Decode forward passes replayed from CUDA graphs, one per bucket of :func:`capture_sizes`.

    Args:
        model: the model (its weights stay where they are: graphs read them in place).
        kv_cache: the runner's cache ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``.
        attention: the runner's backend; capture needs ``attention.graph_safe``.
        sizes: buckets, ascending.
        block_size: tokens per block.
        max_model_len: longest context; sets the block table's width and the decode kernel's split.
        capture: capture CUDA graphs (CUDA only); False runs the same padded buffers eagerly.
    """

    def __init__(self, model: LlamaModel, kv_cache: torch.Tensor, attention: AttentionBackend, sizes: list[int],
                 block_size: int, max_model_len: int, capture: bool):
        if capture and not (kv_cache.is_cuda and attention.graph_safe):
            raise ValueError(f"CUDA graphs need CUDA tensors and a graph-safe attention backend, got "
                             f"{kv_cache.device.type} and {attention.name}")
        self.model, self.kv_cache, self.attention = model, kv_cache, attention
        self.sizes = sizes
        self.block_size = block_size
        self.width = -(-max_model_len // block_size)
        self.capture = capture
        self.device = kv_cache.device
        self.graphs = {size: _Graph(size, self.width, max_model_len, self.device) for size in sizes}
        self.pool = None
        self.num_replays = 0
        self.num_padded_rows = 0

    def fits(self, batch: SchedulerOutput) -> bool:
        """Whether the step is decode-shaped (one new token per request) and some bucket holds it."""
        return (len(batch.requests) <= self.sizes[-1] and all(n == 1 for n in batch.num_new_tokens)
                and max(len(r.block_table) for r in batch.requests) <= self.width)

    def _forward(self, g: _Graph, flat: torch.Tensor, step: HostStep) -> torch.Tensor:
        unpack(flat, step, out=g.inputs)  # int32 casts into the static metadata (inside the graph)
        return self.model(g.inputs.input_ids, g.inputs.positions, self.kv_cache, g.inputs.meta, self.attention)

    def capture_all(self) -> None:
        """Capture every bucket, largest first so the smaller ones reuse its memory pool."""
        if not self.capture:
            return
        self.pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            g = self.graphs[size]
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), torch.inference_mode():
                self._forward(g, g.flat, g.dummy)  # warm-up: Triton compiles and autotunes outside capture
            torch.cuda.current_stream().wait_stream(stream)
            g.graph = torch.cuda.CUDAGraph()
            with torch.inference_mode(), torch.cuda.graph(g.graph, pool=self.pool):
                g.hidden = self._forward(g, g.flat, g.dummy)
        torch.cuda.synchronize()

    def run(self, batch: SchedulerOutput, sample: list[int], transfer: Transfer) -> tuple[torch.Tensor, torch.Tensor]:
        """Run a step that :meth:`fits`: returns hidden states ``[bucket, hidden_size]`` (rows past
        the batch are padding) and the sampled rows ``[len(sample)]`` int64 on the device."""
        size = bucket(len(batch.requests), self.sizes)
        g = self.graphs[size]
        step = layout(batch, self.block_size, sample, num_seqs=size, table_width=self.width)
        step.sample_rows = np.pad(step.sample_rows, (0, size - len(step.sample_rows)))  # the static layout
        transfer(step, out=g.flat)
        self.num_replays += 1
        self.num_padded_rows += size - len(batch.requests)
        if g.graph is None:
            hidden = self._forward(g, g.flat, step)
        else:
            g.graph.replay()
            hidden = g.hidden
        return hidden, g.inputs.sample_rows[:len(sample)]
