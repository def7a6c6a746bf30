"""Where prompt blocks are cached, as two indexes the prefix scorers read (the data layer,
apart from the plugins that score with it).

:class:`PrefixTable` is approximate: block hash → the endpoints this router sent it to, a bounded
LRU, this router's own view (another gateway replica has another). :class:`BlockIndex` is
precise: block hash → the endpoints whose KV cache holds it, kept by the pods' own KV-cache events
(blocks stored and evicted, by the engine's chained block hash from
:mod:`slipstream.server.kv_hash`), so every gateway replica sees what the pods hold.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Protocol, Sequence


class PrefixIndex(Protocol):
    def match(self, block_hashes: Sequence[bytes]) -> dict[str, int]:
        """Endpoint name → how many leading blocks of ``block_hashes`` it holds (only > 0)."""
        ...


def _leading_matches(block_hashes: Sequence[bytes], holders) -> dict[str, int]:
    """Walk the chain from the first block; an endpoint's count stops at its first missing block
    (a chained hash names the whole prefix, so a later hit after a miss cannot be used)."""
    matched: dict[str, int] = {}
    alive: set[str] | None = None
    for i, h in enumerate(block_hashes):
        have = holders(h)
        if not have:
            break
        alive = set(have) if alive is None else alive & set(have)
        if not alive:
            break
        for endpoint in alive:
            matched[endpoint] = i + 1
    return matched


class PrefixTable:
    """Approximate index: block hash → the endpoints this router sent it to, LRU-bounded.

    capacity: most block hashes remembered (each costs ~200 bytes); the least recently routed
    go first. Raises ValueError for a capacity below 1.
    """

    def __init__(self, capacity: int = 200_000):
        if capacity < 1:
            raise ValueError(f"prefix table capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._blocks: OrderedDict[bytes, set[str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, block_hashes: Sequence[bytes]) -> dict[str, int]:
        return _leading_matches(block_hashes, lambda h: self._blocks.get(h))

    def record(self, block_hashes: Iterable[bytes], endpoint: str) -> None:
        """Remember that ``endpoint`` got (and will cache) these blocks."""
        for h in block_hashes:
            holders = self._blocks.get(h)
            if holders is None:
                self._blocks[h] = {endpoint}
            else:
                holders.add(endpoint)
                self._blocks.move_to_end(h)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)

    def forget(self, endpoint: str) -> None:
        """Drop an endpoint that went away (its cache went with it)."""
        for h in [h for h, holders in self._blocks.items() if endpoint in holders]:
            holders = self._blocks[h]
            holders.discard(endpoint)
            if not holders:
                del self._blocks[h]


class BlockIndex:
    """Precise index: block hash → endpoints whose KV cache holds it, kept by their KV events.

    capacity: most (block, endpoint) entries kept; past it an endpoint's oldest entries go
    (a pod's cache is bounded, so this only guards against a runaway stream).
    """

    def __init__(self, capacity: int = 2_000_000):
        if capacity < 1:
            raise ValueError(f"block index capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._holders: dict[bytes, set[str]] = {}
        self._blocks: dict[str, OrderedDict[bytes, None]] = {}
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def endpoints(self) -> list[str]:
        return list(self._blocks)

    def blocks_of(self, endpoint: str) -> int:
        return len(self._blocks.get(endpoint, ()))

    def match(self, block_hashes: Sequence[bytes]) -> dict[str, int]:
        return _leading_matches(block_hashes, lambda h: self._holders.get(h))

    def stored(self, endpoint: str, block_hashes: Iterable[bytes]) -> None:
        """``endpoint`` cached these blocks."""
        mine = self._blocks.setdefault(endpoint, OrderedDict())
        for h in block_hashes:
            if h in mine:
                mine.move_to_end(h)
                continue
            mine[h] = None
            self._holders.setdefault(h, set()).add(endpoint)
            self._size += 1
        while self._size > self.capacity and mine:
            self._drop(endpoint, next(iter(mine)))

    def removed(self, endpoint: str, block_hashes: Iterable[bytes]) -> None:
        """``endpoint`` evicted these blocks."""
        for h in block_hashes:
            self._drop(endpoint, h)

    def replace(self, endpoint: str, block_hashes: Iterable[bytes]) -> None:
        """``endpoint`` holds exactly these blocks (a snapshot, e.g. after a reconnect)."""
        self.forget(endpoint)
        self.stored(endpoint, block_hashes)

    def forget(self, endpoint: str) -> None:
        """``endpoint`` is gone or its cache was cleared."""
        for h in list(self._blocks.get(endpoint, ())):
            self._drop(endpoint, h)
        self._blocks.pop(endpoint, None)

    def _drop(self, endpoint: str, h: bytes) -> None:
        mine = self._blocks.get(endpoint)
        if mine is None or h not in mine:
            return
        del mine[h]
        self._size -= 1
        holders = self._holders.get(h)
        if holders is not None:
            holders.discard(endpoint)
            if not holders:
                del self._holders[h]
