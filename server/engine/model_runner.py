"""Lays a scheduled step out as one flattened token batch, runs the model, returns logits."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from slipstream.kernels import AttentionMetadata

from ..models.llama import LlamaModel
from .outputs import Logprob
from .scheduler import SchedulerOutput

# Rows of full-vocabulary logits held at once for prompt logprobs: 256 × 49,152 fp32 ≈ 48 MiB.
PROMPT_LOGPROBS_CHUNK_ROWS = 256


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


class ModelRunner:
    """Owns the KV cache tensor ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``.

    Args:
        model: the loaded model (on ``device``).
        num_blocks, block_size: the pool's shape.
        device, dtype: where the cache lives and its precision (the model's).
    """

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype):
        cfg = model.cfg
        self.model = model
        self.block_size = block_size
        self.device = device
        self.kv_cache = torch.zeros(cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
                                    dtype=dtype, device=device)

    def prepare(self, batch: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Flatten the step: ``input_ids`` and ``positions`` ``[num_tokens]``, the attention
        metadata, and the row where each request's scheduled tokens start (``num_requests + 1``
        entries, the last one ``num_tokens``: request i's rows are ``starts[i] .. starts[i+1] - 1``)."""
        bs = self.block_size
        ids, pos, slots, q_start, seq_lens = [], [], [], [0], []
        for req, n in zip(batch.requests, batch.num_new_tokens):
            start = req.num_computed_tokens
            positions = np.arange(start, start + n)
            table = np.asarray(req.block_table, dtype=np.int64)
            ids.append(np.asarray(req.token_ids[start:start + n], dtype=np.int64))
            pos.append(positions)
            slots.append(table[positions // bs] * bs + positions % bs)
            q_start.append(q_start[-1] + n)
            seq_lens.append(start + n)
        width = max(len(r.block_table) for r in batch.requests)
        tables = np.zeros((len(batch.requests), width), dtype=np.int32)
        for i, req in enumerate(batch.requests):
            tables[i, :len(req.block_table)] = req.block_table
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(slots)).to(dev),
            query_start_loc=torch.tensor(q_start, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.from_numpy(tables).to(dev),
            max_query_len=max(batch.num_new_tokens),
            max_seq_len=max(seq_lens),
        )
        return (torch.from_numpy(np.concatenate(ids)).to(dev), torch.from_numpy(np.concatenate(pos)).to(dev),
                meta, q_start)

    def run(self, batch: SchedulerOutput, sample_rows: list[int]) -> torch.Tensor:
        """Forward the step; returns fp32 logits ``[len(sample_rows), vocab]`` for the given
        requests (indices into ``batch.requests``), taken at each one's last scheduled token."""
        return self.run_with_prompt_logprobs(batch, sample_rows, [])[0]

    @torch.inference_mode()
    def run_with_prompt_logprobs(self, batch: SchedulerOutput, sample_rows: list[int],
                                 spans: list[PromptSpan]) -> tuple[torch.Tensor, list[list[Logprob]]]:
        """Forward the step once; return :meth:`run`'s logits and, per span (see :func:`prompt_spans`),
        the :class:`Logprob` of each prompt token it covers (``span.count`` entries, in order).

        A logprob is the natural log of the softmax of the raw fp32 logits (as the sampler's).
        Logits are computed only for the sampled rows and the spans' rows, at most
        :data:`PROMPT_LOGPROBS_CHUNK_ROWS` rows of the full vocabulary at a time.
        """
        input_ids, positions, meta, starts = self.prepare(batch)
        hidden = self.model(input_ids, positions, self.kv_cache, meta)
        if sample_rows:
            rows = torch.tensor([starts[i + 1] - 1 for i in sample_rows], device=self.device)
            logits = self.model.logits(hidden[rows])
        else:
            logits = hidden.new_empty(0, self.model.cfg.vocab_size, dtype=torch.float32)
        computed = []
        for span in spans:
            req = batch.requests[span.index]
            row0 = starts[span.index] + (span.first - 1 - req.num_computed_tokens)
            targets = req.prompt_token_ids[span.first:span.first + span.count]
            computed.append(self._logprobs(hidden[row0:row0 + span.count], targets, span.top_n))
        return logits, computed

    def _logprobs(self, hidden: torch.Tensor, targets: list[int], top_n: int) -> list[Logprob]:
        """``hidden`` ``[k, hidden_size]``, ``targets`` the k tokens those rows predict."""
        out: list[Logprob] = []
        for s in range(0, len(targets), PROMPT_LOGPROBS_CHUNK_ROWS):
            chunk = targets[s:s + PROMPT_LOGPROBS_CHUNK_ROWS]
            logprobs = torch.log_softmax(self.model.logits(hidden[s:s + len(chunk)]), dim=-1)
            ids = torch.tensor(chunk, device=logprobs.device)
            own = logprobs.gather(1, ids[:, None])[:, 0].tolist()
            if top_n:
                top_vals, top_ids = logprobs.topk(top_n, dim=-1)
                tops = [list(zip(i, v)) for i, v in zip(top_ids.tolist(), top_vals.tolist())]
            else:
                tops = [[] for _ in chunk]
            out.extend(Logprob(t, lp, top) for t, lp, top in zip(chunk, own, tops))
        return out
