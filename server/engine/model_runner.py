"""Lays a scheduled step out as one flattened token batch, runs the model, returns logits."""
from __future__ import annotations

import numpy as np
import torch

from slipstream.kernels import AttentionMetadata

from ..models.llama import LlamaModel
from .scheduler import SchedulerOutput


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
        metadata, and the row of each request's last scheduled token (sampled only if it ends
        the request's known tokens; chunks in mid-prompt are not)."""
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
        last_rows = [q - 1 for q in q_start[1:]]
        return (torch.from_numpy(np.concatenate(ids)).to(dev), torch.from_numpy(np.concatenate(pos)).to(dev),
                meta, last_rows)

    @torch.inference_mode()
    def run(self, batch: SchedulerOutput, sample_rows: list[int]) -> torch.Tensor:
        """Forward the step; returns fp32 logits ``[len(sample_rows), vocab]`` for the given
        requests (indices into ``batch.requests``), taken at each one's last scheduled token."""
        input_ids, positions, meta, last_rows = self.prepare(batch)
        hidden = self.model(input_ids, positions, self.kv_cache, meta)
        if not sample_rows:
            return hidden.new_empty(0, self.model.cfg.vocab_size, dtype=torch.float32)
        rows = torch.tensor([last_rows[i] for i in sample_rows], device=self.device)
        return self.model.logits(hidden[rows])
