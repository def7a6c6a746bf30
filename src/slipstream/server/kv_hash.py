"""The chained hash that names a full KV block, shared by the engine and the gateway.

vLLM's automatic prefix caching names a full block by a hash of its parent block's hash and its
own token ids, so a block's name fixes the whole prefix before it. The engine uses the names to
share blocks; the gateway hashes a prompt the same way to find the pod that holds its prefix,
and reads the pods' KV events by the same names. Standard library only: the gateway imports no
engine code. The bytes are stable across processes, machines and Python versions.
"""
from __future__ import annotations

import hashlib
import struct
from typing import Sequence

DIGEST_BYTES = 16


def block_hash(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """Chained hash of one full block: 16 bytes of BLAKE2b over the parent hash (None for the
    first block) and the token ids as 4-byte little-endian signed integers. A cryptographic hash,
    so one client cannot craft a prompt that collides with another's prefix."""
    h = hashlib.blake2b(parent or b"", digest_size=DIGEST_BYTES)
    h.update(struct.pack(f"<{len(tokens)}i", *tokens))
    return h.digest()


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, limit: int | None = None) -> list[bytes]:
    """Hashes of the full blocks of ``token_ids`` (a partial last block has none), at most
    ``limit`` of them. Raises ValueError for a block_size below 1."""
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")
    count = len(token_ids) // block_size
    if limit is not None:
        count = min(count, limit)
    hashes: list[bytes] = []
    parent = None
    for i in range(count):
        parent = block_hash(parent, token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(parent)
    return hashes
