"""One step through the pipeline stages: each stage receives the previous stage's hidden states,
runs its layers and sends its own on; the last stage takes the logits (its tensor ranks
together) and its first tensor rank sends them, with the non-finite row flags, to rank 0.
No micro-batches: one step is in one stage at a time, so pipeline parallelism here buys memory
(a model larger than one node's GPUs), not throughput."""
from __future__ import annotations

import torch

from ..engine.model_runner import ModelRunner
from ..engine.step_inputs import HostStep
from .group import ParallelGroups


def run_stage(groups: ParallelGroups, runner: ModelRunner, step: HostStep, chunks: list[tuple[int, int]]) -> None:
    """This rank's part of the step (every rank, rank 0 included); ``chunks`` are the logits rows
    (first row, count) rank 0 asked for besides the sampled rows."""
    cfg = runner.model.cfg
    hidden_in = None
    if not groups.first_stage:
        hidden_in = torch.empty(step.num_tokens, cfg.hidden_size, dtype=runner.dtype, device=runner.device)
        groups.recv(hidden_in, groups.peer(groups.stage - 1))
    hidden, rows = runner.forward(step, hidden_in)
    if not groups.last_stage:
        groups.send(hidden, groups.peer(groups.stage + 1))
        return
    outputs = [(~torch.isfinite(hidden).all(dim=-1)).to(torch.uint8), runner.sample_logits(hidden, rows)]
    outputs += [runner.model.logits(hidden[row0:row0 + count]) for row0, count in chunks]
    if groups.tensor_rank == 0:
        for t in outputs:
            if t.numel():
                groups.send(t, 0)


def receive_outputs(groups: ParallelGroups, step: HostStep, chunks: list[tuple[int, int]], vocab_size: int,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Rank 0: the last stage's ``[num_tokens]`` bool non-finite rows, ``[len(sample_rows), vocab]``
    fp32 logits of the sampled rows and ``[count, vocab]`` fp32 logits per chunk."""
    last = groups.peer(groups.pipeline_size - 1) - groups.tensor_rank

    def recv(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        t = torch.empty(*shape, dtype=dtype, device=device)
        return groups.recv(t, last) if t.numel() else t

    non_finite = recv(step.num_tokens, dtype=torch.uint8).bool()
    logits = recv(len(step.sample_rows), vocab_size)
    return non_finite, logits, [recv(count, vocab_size) for _, count in chunks]
