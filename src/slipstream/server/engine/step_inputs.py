"""A scheduled step laid out on the host as the model's flat inputs, and moved to the device in one copy.

Every integer input of a step (token ids, positions, slot mapping, query starts, context lengths,
block tables, the rows to sample) is written into one int64 host buffer — pinned on CUDA — and
copied to the device in a single host→device transfer; the int32 fields are cast on the device.
One copy instead of six matters on a GPU, where each small transfer costs a few microseconds of
launch and a decode step of a small model takes well under a millisecond.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from slipstream.kernels import AttentionMetadata

from .scheduler import SchedulerOutput


@dataclass
class HostStep:
    """One step's inputs on the host, int64.

    Attributes:
        input_ids, positions, slot_mapping: ``[num_tokens]``; padding rows have id 0, position 0,
            slot -1 (nothing written).
        query_start_loc: ``[num_seqs + 1]``; request i owns rows ``query_start_loc[i] ..
            query_start_loc[i+1] - 1``.
        seq_lens: ``[num_seqs]``, context length after the step (padding sequences: 1).
        block_tables: ``[num_seqs, width]``, zero past each request's blocks and in place of those
            released behind a sliding window.
        sample_rows: ``[num_sampled]``, the row of each sampled request's last scheduled token.
        num_requests: real requests (≤ num_seqs; the rest are padding).
        max_query_len, max_seq_len: over the real requests.
    """

    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    block_tables: np.ndarray
    sample_rows: np.ndarray
    num_requests: int
    max_query_len: int
    max_seq_len: int

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    def parts(self) -> list[np.ndarray]:
        """The fields in transfer order (:func:`unpack` reads them back)."""
        return [self.input_ids, self.positions, self.slot_mapping, self.query_start_loc, self.seq_lens,
                self.block_tables.reshape(-1), self.sample_rows]


def layout(batch: SchedulerOutput, block_size: int, sample: list[int], *, num_seqs: int | None = None,
           table_width: int | None = None) -> HostStep:
    """Flatten a scheduled step.

    Args:
        batch: the scheduled requests and their token counts.
        block_size: tokens per KV block.
        sample: indices into ``batch.requests`` of the requests to sample.
        num_seqs: pad to this many one-token sequences (a CUDA graph's size; only for batches in
            which every request has one new token). None: no padding.
        table_width: block-table columns (a graph's fixed width); None: the longest table.

    Raises:
        ValueError: padding asked for a batch with multi-token requests, fewer seats than
            requests, or a table wider than ``table_width``.
    """
    reqs, counts = batch.requests, batch.num_new_tokens
    n = len(reqs)
    rows = n if num_seqs is None else num_seqs
    if num_seqs is not None and (num_seqs < n or any(c != 1 for c in counts)):
        raise ValueError(f"padding to {num_seqs} one-token sequences needs at most that many one-token requests")
    width = max(len(r.block_table) for r in reqs) if table_width is None else table_width
    tables = np.zeros((rows, width), dtype=np.int64)
    q_start = np.zeros(rows + 1, dtype=np.int64)
    seq_lens = np.ones(rows, dtype=np.int64)
    ids, pos, slots = [], [], []
    for i, (req, count) in enumerate(zip(reqs, counts)):
        table = req.block_table
        if len(table) > width:
            raise ValueError(f"request {req.request_id} holds {len(table)} blocks, more than the table's {width}")
        tables[i, :len(table)] = table
        if req.num_released_blocks:  # released behind the sliding window: masked, so block 0 stands in
            tables[i, :req.num_released_blocks] = 0
        start = req.num_computed_tokens
        positions = np.arange(start, start + count, dtype=np.int64)
        ids.append(np.asarray(req.token_ids[start:start + count], dtype=np.int64))
        pos.append(positions)
        slots.append(tables[i, positions // block_size] * block_size + positions % block_size)
        q_start[i + 1] = q_start[i] + count
        seq_lens[i] = start + count
    pad = rows - n
    if pad:
        q_start[n + 1:] = q_start[n] + np.arange(1, pad + 1)
        ids.append(np.zeros(pad, dtype=np.int64))
        pos.append(np.zeros(pad, dtype=np.int64))
        slots.append(np.full(pad, -1, dtype=np.int64))
    return HostStep(np.concatenate(ids), np.concatenate(pos), np.concatenate(slots), q_start, seq_lens, tables,
                    q_start[np.asarray(sample, dtype=np.int64) + 1] - 1, n, max(counts), int(seq_lens[:n].max()))


def dummy_step(q_lens: list[int], table_width: int) -> HostStep:
    """Sequences of the given query lengths that write no K/V (slot -1) and read only block 0:
    for profiling memory and warming up or capturing graphs, without touching the cache's contents."""
    q_start = np.concatenate(([0], np.cumsum(q_lens))).astype(np.int64)
    total = int(q_start[-1])
    return HostStep(np.zeros(total, np.int64), np.concatenate([np.arange(n, dtype=np.int64) for n in q_lens]),
                    np.full(total, -1, np.int64), q_start, np.asarray(q_lens, np.int64),
                    np.zeros((len(q_lens), table_width), np.int64), q_start[1:] - 1, len(q_lens),
                    max(q_lens), max(q_lens))


@dataclass
class DeviceStep:
    """A :class:`HostStep` on the device: the model's inputs and where to read logits."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor


def unpack(flat: torch.Tensor, step: HostStep, out: DeviceStep | None = None) -> DeviceStep:
    """Views of ``flat`` (``step.parts()`` concatenated, int64, on the device) as a :class:`DeviceStep`,
    int32 fields cast; with ``out``, the int32 fields are written into ``out``'s tensors instead
    (a CUDA graph's static buffers: ``out``'s int64 fields must already be those views of ``flat``)."""
    sizes = [p.size for p in step.parts()]
    ids, pos, slots, q_start, seq_lens, tables, sample = torch.split(flat, sizes)
    tables = tables.view(step.block_tables.shape)
    if out is not None:
        out.meta.query_start_loc.copy_(q_start)
        out.meta.seq_lens.copy_(seq_lens)
        out.meta.block_tables.copy_(tables)
        return out
    meta = AttentionMetadata(slot_mapping=slots, query_start_loc=q_start.to(torch.int32),
                             seq_lens=seq_lens.to(torch.int32), block_tables=tables.to(torch.int32),
                             max_query_len=step.max_query_len, max_seq_len=step.max_seq_len)
    return DeviceStep(ids, pos, meta, sample)


class Transfer:
    """Moves a :class:`HostStep` to the device: one host→device copy per step.

    On CUDA the host side is a pinned staging buffer, reused (grown as needed) from step to step;
    the copy is asynchronous, and the next step waits for it before overwriting the buffer. On
    CPU the concatenated array is the device tensor.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._staging: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None

    def __call__(self, step: HostStep, out: torch.Tensor | None = None) -> torch.Tensor:
        """``step.parts()`` concatenated as one int64 device tensor (written into ``out`` when given)."""
        parts = step.parts()
        if self.device.type != "cuda":
            flat = torch.from_numpy(np.concatenate(parts))
            return flat if out is None else out.copy_(flat)
        total = sum(p.size for p in parts)
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy may still be reading the buffer
        if self._staging is None or self._staging.numel() < total:
            self._staging = torch.empty(max(total, 2 * (self._staging.numel() if self._staging is not None else 0),
                                            4096), dtype=torch.int64, pin_memory=True)
        host = self._staging[:total]
        np.concatenate(parts, out=host.numpy())
        if out is None:
            out = torch.empty(total, dtype=torch.int64, device=self.device)
        out.copy_(host, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return out
