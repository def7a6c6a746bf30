"""The per-step description of a flattened batch that the attention ops read."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    """Where each request's tokens sit in the flattened batch and in the paged KV cache.

    Request ``b`` owns query rows ``query_start_loc[b]:query_start_loc[b+1]`` (its new tokens);
    its context after this step is ``seq_lens[b]`` tokens, so its first new token sits at position
    ``seq_lens[b] - q_len``. Context token ``j`` lives in block ``block_tables[b, j // block_size]``
    at offset ``j % block_size`` (PagedAttention, Kwon et al. SOSP '23, §4.1).

    Fields:
        slot_mapping: ``[num_tokens]`` int64, ``block * block_size + offset`` where each new
            token's K/V is written; ``-1`` marks padding (skipped).
        query_start_loc: ``[batch + 1]`` int32, cumulative query lengths, starting at 0.
        seq_lens: ``[batch]`` int32, context length per request including the new tokens.
        block_tables: ``[batch, max_blocks]`` int32, padded with 0 past each request's blocks.
        max_query_len: largest query length in the batch (Python int, avoids a device sync).
        max_seq_len: largest context length in the batch (Python int).
        backend_cache: what an attention backend derives from the layout once per forward pass
            and reuses in every layer (the reference's padded groups); the model clears it at
            the start of each forward, since CUDA-graph buffers are refilled in place.
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int
    backend_cache: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]
