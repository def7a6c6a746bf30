"""The KV block pool: fixed-size blocks, per-request block tables, reference counts, prefix sharing.

PagedAttention (Kwon et al., SOSP '23, §4.2–4.4): a request's KV lives in blocks of
``block_size`` tokens anywhere in the pool; its block table maps logical to physical blocks.
Full blocks are named by a chained hash (parent hash + the block's token ids, as vLLM's
automatic prefix caching does), so equal prefixes map to the same physical block, shared with a
reference count. A block whose count drops to zero keeps its contents and hash and waits in an
LRU free queue: a later request with the same prefix revives it, and allocation evicts the least
recently freed first.

Sliding windows (Mistral 7B, Jiang et al. 2023, §2; vLLM's sliding-window manager): when every
layer attends only the last ``sliding_window`` tokens, the blocks wholly behind the window of a
request's next query can never be read again by it; :meth:`KVCacheManager.free_out_of_window`
releases them before each allocation (the request's table keeps :data:`NULL_BLOCK` in their
place), so a request holds about ``window + chunk`` tokens of blocks however long it grows. They
keep their hashes, so prefix sharing still finds them until they are evicted.

KV events: while ``events`` is a list (:meth:`record_events`), the manager appends what changed
in the set of shareable blocks, by hash — ``stored`` when a full block gets its hash,
``removed`` when an evicted block loses it — as vLLM publishes ``BlockStored`` and
``BlockRemoved``; the serving layer streams them to gateways (``GET /v1/kv_events``). While
``events`` is None (the default) recording costs one test per hashed or evicted block.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from ..kv_hash import block_hash
from .request import Request

__all__ = ["KVCacheManager", "KVEvent", "NULL_BLOCK", "block_hash"]

STORED = "stored"
REMOVED = "removed"
NULL_BLOCK = -1  # a block-table entry released behind the sliding window (the step layout reads block 0 there)


@dataclass(slots=True)
class KVEvent:
    """One run of same-kind changes: ``kind`` is ``"stored"`` (the blocks became shareable under
    these hashes) or ``"removed"`` (their hashes are gone: evicted); ``block_hashes`` in the order
    they happened, each :data:`~slipstream.server.kv_hash.DIGEST_BYTES` bytes."""

    kind: str
    block_hashes: list[bytes] = field(default_factory=list)


class KVCacheManager:
    """Owns which physical block holds what; the tensor itself lives in the model runner.

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        enable_prefix_caching: share and revive full blocks by content hash.
        sliding_window: tokens of K/V a query reads behind it when every layer slides (keys
            ``p - window < j <= p``, as the attention kernels); None: every token stays readable.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding_window: int | None = None):
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1 token, got {sliding_window}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        self.ref_counts = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.prefix_queries = 0  # tokens looked up at admission (counted by the scheduler)
        self.prefix_hits = 0     # of those, tokens found cached
        self.events: list[KVEvent] | None = None  # KV events since the last take_events(); None: not recorded

    # --- accounting ---------------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        """Tokens the whole pool holds: ``num_blocks * block_size``."""
        return self.num_blocks * self.block_size

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request references (cached ones included: they can be evicted)."""
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    @property
    def usage(self) -> float:
        """Fraction of the pool referenced by requests, 0..1 (the ``kv_cache_usage_perc`` gauge)."""
        return self.num_used_blocks / self.num_blocks

    def max_blocks_held(self, num_tokens: int, chunk: int) -> int:
        """The most blocks one request of ``num_tokens`` tokens holds at once when it advances at
        most ``chunk`` tokens a step: all of them, or behind a sliding window only the window's
        and the chunk's (one more when they straddle a block boundary)."""
        full = self.blocks_needed(num_tokens)
        if self.sliding_window is None:
            return full
        return min(full, self.blocks_needed(self.sliding_window - 1 + chunk) + 1)

    def utilization(self, requests: list[Request]) -> float:
        """Tokens held / slots allocated over the given requests' blocks, 0..1; a shared block counts once.

        With paging only each request's last block is partly empty, so this stays near 1;
        a contiguous reservation of ``max_model_len`` per request would hold far less.
        """
        filled: dict[int, int] = {}
        for req in requests:
            for i, block in enumerate(req.block_table):
                if block == NULL_BLOCK:
                    continue
                n = min(self.block_size, max(0, req.num_computed_tokens - i * self.block_size))
                filled[block] = max(filled.get(block, 0), n)
        return sum(filled.values()) / (len(filled) * self.block_size) if filled else 0.0

    # --- KV events ----------------------------------------------------------------------------
    def record_events(self, on: bool) -> None:
        """Start (``on``) or stop recording KV events; stopping drops those not yet taken."""
        self.events = ([] if self.events is None else self.events) if on else None

    def take_events(self) -> list[KVEvent]:
        """The events recorded since the last call, oldest first (empty when not recording)."""
        if not self.events:
            return []
        events, self.events = self.events, []
        return events

    def cached_hashes(self) -> list[bytes]:
        """Hash of every block that can be shared now (a snapshot for a new KV-event subscriber)."""
        return list(self.cached)

    def _emit(self, kind: str, h: bytes) -> None:
        events = self.events
        if events and events[-1].kind == kind:
            events[-1].block_hashes.append(h)
        else:
            events.append(KVEvent(kind, [h]))

    # --- allocation ---------------------------------------------------------------------------
    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, req: Request) -> int:
        """Give a new request the cached blocks of its longest cached prefix of full blocks.

        Covers at most ``req.num_reusable_tokens``: never the last token (its logits must be
        computed), and none of a prompt whose logprobs are asked for and not yet computed (as
        vLLM: such a request bypasses the cache; its blocks are still cached for others). Sets
        ``req.block_table`` and ``req.num_computed_tokens``; returns the number of tokens found.
        """
        assert not req.block_table and req.num_computed_tokens == 0
        self._extend_hashes(req)
        if not self.enable_prefix_caching:
            return 0
        limit = req.num_reusable_tokens // self.block_size
        for h in req.block_hashes[:limit]:
            block = self.cached.get(h)
            if block is None:
                break
            self._ref(block)
            req.block_table.append(block)
        hit = len(req.block_table) * self.block_size
        req.num_computed_tokens = hit
        req.num_cached_tokens = max(req.num_cached_tokens, hit)
        return hit

    def cached_prefix_blocks(self, req: Request) -> int:
        """How many leading full blocks of ``req`` (up to what :meth:`match_prefix` would reuse)
        the prefix cache holds now; takes nothing. 0 with prefix caching off."""
        if not self.enable_prefix_caching:
            return 0
        self._extend_hashes(req)
        count = 0
        for h in req.block_hashes[:req.num_reusable_tokens // self.block_size]:
            if h not in self.cached:
                break
            count += 1
        return count

    def allocate(self, req: Request, num_new_tokens: int) -> bool:
        """Make the block table cover ``num_computed_tokens + num_new_tokens`` tokens.

        All or nothing: returns False, allocating nothing, when too few blocks are free.
        """
        need = self.blocks_needed(req.num_computed_tokens + num_new_tokens) - len(req.block_table)
        if need <= 0:
            return True
        if need > len(self.free):
            return False
        for _ in range(need):
            block, _ = self.free.popitem(last=False)
            self._evict(block)
            self.ref_counts[block] = 1
            req.block_table.append(block)
        return True

    def fork(self, parent: Request, child: Request, num_computed: int | None = None) -> None:
        """Let ``child`` (same prompt) share the parent's computed full prompt blocks.

        Shares at most ``(prompt_len - 1) // block_size`` blocks, so the child computes its own
        last prompt token (and samples its own first token) in a block of its own.
        num_computed: the parent's tokens whose K/V is in its blocks, when the forward pass is
        ahead of ``parent.num_computed_tokens`` (the engine forks between the forward pass and
        :meth:`Scheduler.update_from_output`, which may finish the parent and free its blocks).
        Behind a sliding window, when the parent has already released a block the child's first
        query would read, the child shares nothing and is admitted as a new request (its prompt
        blocks mostly found again by :meth:`match_prefix`).
        """
        computed = parent.num_computed_tokens if num_computed is None else num_computed
        shared = min((child.num_tokens - 1) // self.block_size, computed // self.block_size)
        if self.sliding_window is not None and parent.num_released_blocks:
            first_needed = max(0, shared * self.block_size - self.sliding_window + 1) // self.block_size
            if first_needed < parent.num_released_blocks:
                return  # the child's first query would see a released block: it starts fresh (prefix cache)
        for block in parent.block_table[parent.num_released_blocks:shared]:
            self._ref(block)
        child.block_table = parent.block_table[:shared]
        child.block_hashes = parent.block_hashes[:shared]
        child.num_computed_tokens = shared * self.block_size
        child.num_released_blocks = min(parent.num_released_blocks, shared)

    def cache_full_blocks(self, req: Request) -> None:
        """Name the request's newly computed full blocks by hash so later requests can share them."""
        if not self.enable_prefix_caching:
            return
        self._extend_hashes(req)
        full = min(req.num_computed_tokens // self.block_size, len(req.block_table))
        for i in range(req.num_released_blocks, full):  # released ones were named before they went
            block, h = req.block_table[i], req.block_hashes[i]
            if self.hash_of[block] is None and h not in self.cached:
                self.hash_of[block] = h
                self.cached[h] = block
                if self.events is not None:
                    self._emit(STORED, h)

    def free_out_of_window(self, req: Request) -> int:
        """Release the request's leading blocks that its next query can no longer see.

        The next step's first query sits at ``num_computed_tokens`` and reads keys after
        ``num_computed_tokens - sliding_window``; blocks wholly before that are dropped (as in
        :meth:`free_request`) and their table entries become :data:`NULL_BLOCK`, so positions
        and the slot mapping of later tokens keep their meaning. Returns the blocks released
        now; 0 without a sliding window.
        """
        if self.sliding_window is None:
            return 0
        first_needed = req.num_computed_tokens - self.sliding_window + 1
        stop = min(max(0, first_needed) // self.block_size, len(req.block_table))
        start = req.num_released_blocks
        if stop <= start:
            return 0
        table = req.block_table
        for i in range(start, stop):
            self._unref(table[i])
            table[i] = NULL_BLOCK
        req.num_released_blocks = stop
        return stop - start

    def free_request(self, req: Request) -> None:
        """Drop the request's references; blocks reaching zero go to the free queue.

        Tail blocks are freed first so they are evicted first (a later request is likelier
        to share the head of a prompt than its tail); unhashed blocks go to the front.
        """
        for block in reversed(req.block_table[req.num_released_blocks:]):
            self._unref(block)
        req.block_table = []
        req.num_computed_tokens = 0
        req.num_released_blocks = 0

    # --- internals ----------------------------------------------------------------------------
    def _ref(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self.free[block]
        self.ref_counts[block] += 1

    def _unref(self, block: int) -> None:
        self.ref_counts[block] -= 1
        assert self.ref_counts[block] >= 0, f"block {block} freed twice"
        if self.ref_counts[block] == 0:
            self.free[block] = None
            if self.hash_of[block] is None:
                self.free.move_to_end(block, last=False)

    def _evict(self, block: int) -> None:
        h = self.hash_of[block]
        if h is not None:
            self.hash_of[block] = None
            if self.cached.get(h) == block:
                del self.cached[h]
                if self.events is not None:
                    self._emit(REMOVED, h)

    def _extend_hashes(self, req: Request) -> None:
        bs = self.block_size
        for i in range(len(req.block_hashes), req.num_tokens // bs):
            parent = req.block_hashes[i - 1] if i else None
            req.block_hashes.append(block_hash(parent, req.token_ids[i * bs:(i + 1) * bs]))
