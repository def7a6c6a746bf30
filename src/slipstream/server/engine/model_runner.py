"""Runs a scheduled step: the flattened token batch through the model, logits out.

:class:`StepRunner` is what the engine asks of whatever runs its steps: :class:`ModelRunner` (the
model's forward pass) and the simulator's cost-model runner implement it.
"""
from __future__ import annotations

import logging
import math
import mmap
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from slipstream import kernels

from ..models.llama import LlamaModel
from .cuda_graphs import DecodeGraphs, capture_sizes
from .memory import MemoryProfile
from .outputs import Logprob
from .scheduler import SchedulerOutput
from .step_inputs import HostStep, Transfer, dummy_step, layout, unpack

log = logging.getLogger("slipstream.engine")

# Rows of full-vocabulary logits held at once for prompt logprobs: 256 × 49,152 fp32 ≈ 48 MiB.
PROMPT_LOGPROBS_CHUNK_ROWS = 256


def kv_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed KV pool of ``shape``. On the CPU it lies in an anonymous memory map, whose pages
    the kernel zero-fills when first touched: ``torch.zeros`` wrote every page at start-up
    (0.2 s per GiB here) for blocks that may never be used."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)  # the tensor keeps the map


@dataclass(frozen=True, slots=True)
class PromptSpan:
    """Prompt tokens of one request whose logprobs this step's rows give.

    Position ``p`` predicts token ``p + 1``, so the span covers prompt tokens
    ``first .. first + count - 1``, read from the rows of positions ``first - 1 .. first + count - 2``.

    Attributes:
        index: the request's index in ``batch.requests``.
        first: the first prompt token predicted (≥ 1; nothing predicts token 0).
        count: how many prompt tokens (≥ 1).
        top_n: top-N alternatives per token (0: only the prompt token's own logprob).
    """

    index: int
    first: int
    count: int
    top_n: int


@dataclass
class StepOutput:
    """What one step's forward pass gives the engine.

    Attributes:
        logits: ``[len(sample_rows), V]`` fp32 at each sampled request's last scheduled token
            (``V`` ≤ the vocabulary).
        prompt_logprobs: per :class:`PromptSpan` asked for, its ``count`` :class:`Logprob` entries.
        non_finite_rows: ``[≥ num_tokens]`` bool on the device, the step's rows (batch order, each
            request's ``num_new_tokens`` in turn, then padding) whose final hidden state holds a
            NaN or an infinity; None where there are no hidden states (the simulator).
    """

    logits: torch.Tensor
    prompt_logprobs: list[list[Logprob]] = field(default_factory=list)
    non_finite_rows: torch.Tensor | None = None

    def non_finite_requests(self, batch: SchedulerOutput) -> list[int]:
        """Indices into ``batch.requests`` with a non-finite row this step: a damaged checkpoint or
        overflowing numerics. Their K/V is suspect (and, through attention's ``0 × NaN``, so is
        that of their earlier rows in the same chunk), so they fail before their blocks are named
        for the prefix cache. Reads one flag back from the device; the full rows only when it is set.
        """
        rows = self.non_finite_rows
        if rows is None or not bool(rows.any()):
            return []
        bad, found, start = rows.tolist(), [], 0
        for i, n in enumerate(batch.num_new_tokens):
            if any(bad[start:start + n]):
                found.append(i)
            start += n
        return found


def prompt_spans(batch: SchedulerOutput) -> list[PromptSpan]:
    """The prompt logprobs a step computes: for each scheduled request that still lacks some
    (``req.prompt_logprobs`` shorter than the prompt), the prompt tokens its scheduled positions
    predict and that it has not got yet. A chunk's last position predicts the next chunk's first
    token (its id is known), so chunk boundaries lose nothing; after a preemption the entries
    already held are not computed again."""
    spans = []
    for i, (req, n) in enumerate(zip(batch.requests, batch.num_new_tokens)):
        have = req.prompt_logprobs
        if have is None or len(have) >= req.num_prompt_tokens:
            continue
        first = max(req.num_computed_tokens + 1, len(have))
        end = min(req.num_computed_tokens + n, req.num_prompt_tokens - 1)  # last token predicted
        if end >= first:
            spans.append(PromptSpan(i, first, end - first + 1, req.params.prompt_logprobs))
    return spans


@dataclass(frozen=True, slots=True)
class LogitsChunk:
    """Up to :data:`PROMPT_LOGPROBS_CHUNK_ROWS` consecutive rows of one span whose full-vocabulary
    logits are taken at once: rows ``row0 .. row0 + len(targets) - 1`` predict ``targets``."""

    span: int
    row0: int
    targets: list[int]
    top_n: int


def logits_chunks(step: HostStep, batch: SchedulerOutput, spans: list[PromptSpan]) -> list[LogitsChunk]:
    """The spans' rows in the order their logits are taken, at most
    :data:`PROMPT_LOGPROBS_CHUNK_ROWS` rows at a time."""
    chunks = []
    for i, span in enumerate(spans):
        req = batch.requests[span.index]
        row0 = int(step.query_start_loc[span.index]) + (span.first - 1 - req.num_computed_tokens)
        targets = req.prompt_token_ids[span.first:span.first + span.count]
        for s in range(0, span.count, PROMPT_LOGPROBS_CHUNK_ROWS):
            chunks.append(LogitsChunk(i, row0 + s, targets[s:s + PROMPT_LOGPROBS_CHUNK_ROWS], span.top_n))
    return chunks


class StepRunner(Protocol):
    """What :class:`~slipstream.server.engine.engine.LLMEngine` calls to run its steps.

    Attributes:
        supports_prompt_logprobs: whether :meth:`run_with_prompt_logprobs` computes them (the
            model's forward pass does; a cost model does not, and such requests are refused).
    """

    supports_prompt_logprobs: bool

    def allocate_kv_cache(self, num_blocks: int, max_model_len: int) -> None:
        """Allocate the block pool (``num_blocks`` blocks) once the engine has sized it; the
        longest request is ``max_model_len`` tokens."""

    def run(self, batch: SchedulerOutput, sample_rows: list[int]) -> StepOutput:
        """Run the step: the logits of the sampled requests (``sample_rows`` index
        ``batch.requests``) and the rows that were not finite."""

    def run_with_prompt_logprobs(self, batch: SchedulerOutput, sample_rows: list[int],
                                 spans: list[PromptSpan]) -> StepOutput:
        """:meth:`run`, with the prompt logprobs of ``spans`` (see :func:`prompt_spans`)."""


class ModelRunner:
    """Runs steps through the model and owns the KV cache tensor
    ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``.

    The attention backend is resolved once here and handed to the model. Each step's inputs
    reach the device in one copy (:mod:`.step_inputs`); decode steps replay CUDA graphs
    (:mod:`.cuda_graphs`) unless ``enforce_eager``, the device is not CUDA, or the backend or
    the model (mixture of experts: ``model.graph_safe``) is not graph-safe.

    Args:
        model: the loaded model (on ``device``).
        block_size: tokens per KV block.
        device, dtype: where the cache lives and its precision (the model's).
        max_num_seqs: most requests in one step (the largest graph bucket).
        enforce_eager: never capture CUDA graphs.
        graphs: force the graph path on (True, on CPU: the padded static buffers run eagerly,
            which tests use) or off (False); None decides as above.

    Raises:
        ValueError, RuntimeError: ``SLIPSTREAM_ATTENTION`` invalid or not runnable here.
    """

    supports_prompt_logprobs = True

    def __init__(self, model: LlamaModel, block_size: int, device: torch.device, dtype: torch.dtype, *,
                 max_num_seqs: int = 32, enforce_eager: bool = False, graphs: bool | None = None):
        self.model = model
        self.block_size = block_size
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_num_seqs = max_num_seqs
        self.attention = kernels.resolve_backend(self.device)
        if graphs is None:
            graphs = (not enforce_eager and self.device.type == "cuda" and self.attention.graph_safe
                      and getattr(model, "graph_safe", True))
            if not enforce_eager and self.device.type == "cuda" and not self.attention.graph_safe:
                log.warning("attention backend %s is not graph-safe: decode steps run eagerly", self.attention.name)
        self.use_graphs = graphs
        self.transfer = Transfer(self.device)
        self.kv_cache: torch.Tensor | None = None
        self.graphs: DecodeGraphs | None = None
        # Tensor parallel, rank 0: called with each step's inputs and its logits rows
        # (first row, count) before the forward pass, to send them to the other ranks.
        self.on_step: Callable[[HostStep, list[tuple[int, int]]], None] | None = None

    def allocate_kv_cache(self, num_blocks: int, max_model_len: int) -> None:
        """Allocate the cache and, on the graph path, capture the decode graphs over it."""
        cfg = self.model.cfg
        self.kv_cache = kv_zeros((cfg.num_layers, 2, num_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim),
                                 self.dtype, self.device)
        if not self.use_graphs:
            return
        capture = self.device.type == "cuda"
        self.graphs = DecodeGraphs(self.model, self.kv_cache, self.attention, capture_sizes(self.max_num_seqs),
                                   self.block_size, max_model_len, capture=capture)
        if capture:
            t0, before = time.perf_counter(), torch.cuda.memory_reserved(self.device)
            self.graphs.capture_all()
            log.info("captured CUDA graphs for decode batches of %s in %.1f s (%.0f MiB)", self.graphs.sizes,
                     time.perf_counter() - t0, (torch.cuda.memory_reserved(self.device) - before) / 2**20)

    def run(self, batch: SchedulerOutput, sample_rows: list[int]) -> StepOutput:
        """Forward the step; the :class:`StepOutput` of the given requests (indices into
        ``batch.requests``), logits taken at each one's last scheduled token."""
        return self.run_with_prompt_logprobs(batch, sample_rows, [])

    @torch.inference_mode()
    def run_with_prompt_logprobs(self, batch: SchedulerOutput, sample_rows: list[int],
                                 spans: list[PromptSpan]) -> StepOutput:
        """Forward the step once; return :meth:`run`'s output with, per span (see :func:`prompt_spans`),
        the :class:`Logprob` of each prompt token it covers (``span.count`` entries, in order).

        A logprob is the natural log of the softmax of the raw fp32 logits (as the sampler's).
        Logits are computed only for the sampled rows and the spans' rows, at most
        :data:`PROMPT_LOGPROBS_CHUNK_ROWS` rows of the full vocabulary at a time.
        """
        if self.graphs is not None and not spans and self.graphs.fits(batch):
            hidden, rows = self.graphs.run(batch, sample_rows, self.transfer)
            chunks = []
        else:
            step = layout(batch, self.block_size, sample_rows)
            chunks = logits_chunks(step, batch, spans)
            if self.on_step is not None:
                self.on_step(step, [(c.row0, len(c.targets)) for c in chunks])
            hidden, rows = self.forward(step)
        non_finite = ~torch.isfinite(hidden).all(dim=-1)  # every row: a NaN's K/V is written whether sampled or not
        logits = self.sample_logits(hidden, rows)
        computed: list[list[Logprob]] = [[] for _ in spans]
        for chunk in chunks:
            rows_logits = self.model.logits(hidden[chunk.row0:chunk.row0 + len(chunk.targets)])
            computed[chunk.span].extend(chunk_logprobs(rows_logits, chunk.targets, chunk.top_n))
        return StepOutput(logits, computed, non_finite)

    def forward(self, step: HostStep, hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's hidden states ``[num_tokens, hidden_size]`` and its sampled rows on the device;
        ``hidden``: a later pipeline stage's input from the stage before."""
        inputs = unpack(self.transfer(step), step)
        staged = {} if hidden is None else {"hidden": hidden}
        return self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.meta, self.attention,
                          **staged), inputs.sample_rows

    def sample_logits(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``[len(rows), vocab_size]`` fp32 logits of the sampled rows (none: an empty tensor)."""
        if len(rows):
            return self.model.logits(hidden.index_select(0, rows))
        return hidden.new_empty(0, self.model.cfg.vocab_size, dtype=torch.float32)

    def replay(self, step: HostStep, chunks: list[tuple[int, int]]) -> None:
        """A tensor-parallel worker's share of rank 0's step (:attr:`on_step`): the same forward
        pass and the same logits calls, in the same order, so that every collective meets its
        peers; the results stay with rank 0."""
        hidden, rows = self.forward(step)
        self.sample_logits(hidden, rows)
        for row0, count in chunks:
            self.model.logits(hidden[row0:row0 + count])

    @torch.inference_mode()
    def profile_memory(self, max_num_batched_tokens: int) -> MemoryProfile:
        """Measure, on CUDA, the peak memory of a step at the token budget and of a decode step at
        the largest graph bucket (see :mod:`.memory`). Call before :meth:`allocate_kv_cache`.

        The profiling steps spread ``max_num_batched_tokens`` tokens over ``max_num_seqs``
        sequences over a one-block cache they never write to, and take full-vocabulary logits of
        as many rows as a step ever holds at once (the sampled rows, or a chunk of prompt logprobs).
        """
        dev = self.device
        cfg = self.model.cfg
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        seen: set[int] = set()
        weights = 0
        for t in [*self.model.parameters(), *self.model.buffers()]:
            if t.data_ptr() not in seen:  # tied embeddings count once
                seen.add(t.data_ptr())
                weights += t.numel() * t.element_size()
        cache = torch.zeros(cfg.num_layers, 2, 1, self.block_size, cfg.num_kv_heads, cfg.head_dim,
                            dtype=self.dtype, device=dev)

        def peak_of(step: HostStep, cache: torch.Tensor) -> int:
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            before = torch.cuda.memory_allocated(dev)
            inputs = unpack(self.transfer(step), step)
            # A later pipeline stage starts from hidden states, and only the last takes logits.
            staged = {} if getattr(self.model, "embed_tokens", True) is not None else \
                {"hidden": torch.zeros(step.num_tokens, cfg.hidden_size, dtype=self.dtype, device=dev)}
            hidden = self.model(inputs.input_ids, inputs.positions, cache, inputs.meta, self.attention, **staged)
            if getattr(self.model, "lm_head", True) is not None:
                # Full-vocabulary rows at their most: the sampled rows, or a chunk of prompt logprobs.
                rows = min(step.num_tokens, max(step.num_requests, PROMPT_LOGPROBS_CHUNK_ROWS))
                logits = self.model.logits(hidden[:rows])
                torch.log_softmax(logits, dim=-1).sort(dim=-1)  # the sampler's top-p path: its largest buffers
            torch.cuda.synchronize(dev)
            return torch.cuda.max_memory_allocated(dev) - before

        seqs = min(self.max_num_seqs, max_num_batched_tokens)
        q_lens = [max_num_batched_tokens // seqs] * seqs
        q_lens[-1] += max_num_batched_tokens - sum(q_lens)
        peak = peak_of(dummy_step(q_lens, -(-max(q_lens) // self.block_size)), cache)
        reserve = peak_of(dummy_step([1] * capture_sizes(self.max_num_seqs)[-1], 1), cache) if self.use_graphs else 0
        del cache
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(dev)
        return MemoryProfile(total, free, weights, peak, reserve)


def chunk_logprobs(logits: torch.Tensor, targets: list[int], top_n: int) -> list[Logprob]:
    """``logits`` ``[k, vocab]`` fp32 of the rows predicting the k ``targets``: each target's
    :class:`Logprob`, with the ``top_n`` most likely tokens when asked."""
    logprobs = torch.log_softmax(logits, dim=-1)
    ids = torch.tensor(targets, device=logprobs.device)
    own = logprobs.gather(1, ids[:, None])[:, 0].tolist()
    if top_n:
        top_vals, top_ids = logprobs.topk(top_n, dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(top_ids.tolist(), top_vals.tolist())]
    else:
        tops = [[] for _ in targets]
    return [Logprob(t, lp, top) for t, lp, top in zip(targets, own, tops)]
