"""Following the pods' KV-cache events (``GET /v1/kv_events``) into the router's :class:`BlockIndex`.

One task per endpoint reads the pod's NDJSON stream (schema: :mod:`slipstream.server.api.kv_events`):
the snapshot replaces what the index knew of the pod, then each event batch applies in order
(``stored`` → :meth:`BlockIndex.stored`, ``removed`` → :meth:`BlockIndex.removed`, ``cleared``
→ :meth:`BlockIndex.forget`). A stream that ends, fails, skips a sequence number or stays silent
past ``silence_seconds`` (the pod sends a heartbeat line every 2 s) makes the index forget the
pod — routing must not trust blocks it can no longer see evicted — and the task reconnects with
exponential backoff; the next snapshot rebuilds the pod's entries. Every gateway replica does
the same, so all replicas share one view (llm-d's precise prefix-cache scorer works this way).
"""
from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import AsyncIterator, Mapping

import aiohttp

from slipstream.server.gateway.routing import BlockIndex

log = logging.getLogger("slipstream.gateway")

PATH = "/v1/kv_events"


class StreamError(Exception):
    """The stream broke the protocol (a gap in ``seq``, events before the snapshot, a bad line)."""


class KVEventSubscriber:
    """Keeps ``index`` in step with the KV caches of the watched endpoints.

    Args:
        index: the router's block index; only this object writes an endpoint's entries.
        session: the HTTP session to connect with (not closed by :meth:`close`).
        reconnect_seconds: first wait before reconnecting; doubles per failed try up to
            ``max_reconnect_seconds``, back to the first after a stream that delivered its snapshot.
        silence_seconds: a stream without a byte for this long counts as dead.
        headers: sent with every request (e.g. ``{"Authorization": "Bearer KEY"}`` for pods
            started with ``--api-key``).
        max_line_bytes: longest line accepted (a longer one is a protocol error).

    ``block_sizes`` maps each endpoint to the block size its last snapshot named (the size the
    gateway must hash prompts with for it).
    """

    def __init__(self, index: BlockIndex, session: aiohttp.ClientSession, *, reconnect_seconds: float = 1.0,
                 max_reconnect_seconds: float = 30.0, silence_seconds: float = 10.0,
                 headers: Mapping[str, str] | None = None, max_line_bytes: int = 16 << 20):
        if reconnect_seconds <= 0 or silence_seconds <= 0:
            raise ValueError(f"reconnect_seconds and silence_seconds must be > 0, got {reconnect_seconds} "
                             f"and {silence_seconds}")
        self.index = index
        self.session = session
        self.reconnect_seconds = reconnect_seconds
        self.max_reconnect_seconds = max(max_reconnect_seconds, reconnect_seconds)
        self._wake: dict[str, asyncio.Event] = {}
        self.silence_seconds = silence_seconds
        self.headers = dict(headers or {})
        self.max_line_bytes = max_line_bytes
        self.block_sizes: dict[str, int] = {}
        self.connects: dict[str, int] = {}  # endpoint → streams that delivered a snapshot (for metrics, tests)
        self._tasks: dict[str, tuple[str, asyncio.Task]] = {}

    def watch(self, endpoint: str, base_url: str) -> None:
        """Follow ``GET {base_url}/v1/kv_events`` for ``endpoint`` (a name the index uses) until
        :meth:`unwatch`. Watching an endpoint again with the same URL does nothing; with another
        URL restarts it. Must be called on the event loop."""
        base_url = base_url.rstrip("/")
        current = self._tasks.get(endpoint)
        if current is not None and current[0] == base_url and not current[1].done():
            return
        if current is not None:
            current[1].cancel()
        task = asyncio.get_running_loop().create_task(self._follow(endpoint, base_url),
                                                       name=f"kv-events {endpoint}")
        self._tasks[endpoint] = (base_url, task)

    def nudge(self, endpoint: str) -> None:
        """``endpoint`` just became ready: reconnect now if waiting out a backoff (a pod that was
        loading for minutes would otherwise wait up to ``max_reconnect_seconds`` more)."""
        wake = self._wake.get(endpoint)
        if wake is not None:
            wake.set()

    def unwatch(self, endpoint: str) -> None:
        """Stop following ``endpoint`` and drop its blocks from the index."""
        current = self._tasks.pop(endpoint, None)
        if current is not None:
            current[1].cancel()
        self.index.forget(endpoint)
        self.block_sizes.pop(endpoint, None)
        self._wake.pop(endpoint, None)

    def watching(self) -> list[str]:
        return list(self._tasks)

    async def close(self) -> None:
        """Stop every task and forget every watched endpoint."""
        tasks = [task for _, task in self._tasks.values()]
        for endpoint in list(self._tasks):
            self.unwatch(endpoint)
        await asyncio.gather(*tasks, return_exceptions=True)

    # --- one endpoint -----------------------------------------------------------------------
    async def _follow(self, endpoint: str, base_url: str) -> None:
        delay = self.reconnect_seconds
        while True:
            synced = False
            try:
                async for _ in self._stream(endpoint, base_url + PATH):
                    synced = True
                reason = "stream ended"
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # connection, timeout, protocol: all mean the view is stale
                reason = f"{type(exc).__name__}: {exc}"
            finally:
                current = self._tasks.get(endpoint)
                if current is not None and current[1] is asyncio.current_task():  # not replaced meanwhile
                    self.index.forget(endpoint)
            if synced:
                delay = self.reconnect_seconds
            log.info("KV events of %s: %s; reconnecting in %.1fs", endpoint, reason, delay)
            wake = self._wake.setdefault(endpoint, asyncio.Event())
            wake.clear()
            try:  # jitter: replicas do not reconnect in step
                await asyncio.wait_for(wake.wait(), delay * random.uniform(0.8, 1.2))
            except asyncio.TimeoutError:
                pass
            delay = min(delay * 2, self.max_reconnect_seconds)

    async def _stream(self, endpoint: str, url: str) -> AsyncIterator[None]:
        """Apply one connection's stream to the index; yields once the snapshot is in."""
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.silence_seconds,
                                        sock_read=self.silence_seconds)
        async with self.session.get(url, headers=self.headers, timeout=timeout) as resp:
            if resp.status != 200:
                body = (await resp.text())[:200]
                raise StreamError(f"GET {url} answered {resp.status}: {body}")
            snapshot: list[bytes] = []
            expected: int | None = None  # the next batch's seq, once the snapshot is complete
            async for line in _lines(resp.content, self.max_line_bytes):
                if not line.strip():
                    continue  # heartbeat
                msg = json.loads(line)
                kind = msg.get("type")
                if kind == "snapshot":
                    if expected is not None:
                        raise StreamError("a second snapshot in one stream")
                    snapshot.extend(bytes.fromhex(h) for h in msg["blocks"])
                    if msg.get("last", True):
                        self.index.replace(endpoint, snapshot)
                        self.block_sizes[endpoint] = int(msg["block_size"])
                        self.connects[endpoint] = self.connects.get(endpoint, 0) + 1
                        expected = int(msg["seq"]) + 1
                        snapshot = []
                        yield
                elif kind == "events":
                    if expected is None:
                        raise StreamError("events before the snapshot")
                    if msg["seq"] != expected:
                        raise StreamError(f"expected event batch {expected}, got {msg['seq']}")
                    self._apply(endpoint, msg["events"])
                    expected += 1

    def _apply(self, endpoint: str, events: list[dict]) -> None:
        for event in events:
            kind = event.get("type")
            if kind == "stored":
                self.index.stored(endpoint, [bytes.fromhex(h) for h in event["blocks"]])
            elif kind == "removed":
                self.index.removed(endpoint, [bytes.fromhex(h) for h in event["blocks"]])
            elif kind == "cleared":
                self.index.forget(endpoint)


async def _lines(content: aiohttp.StreamReader, max_line_bytes: int) -> AsyncIterator[bytes]:
    """The ``\\n``-terminated lines of a body (a partial last line is dropped: the stream broke).
    Raises StreamError for a line longer than ``max_line_bytes``."""
    buffer = bytearray()
    async for chunk in content.iter_any():
        buffer += chunk
        start = 0
        while (end := buffer.find(b"\n", start)) >= 0:
            yield bytes(buffer[start:end])
            start = end + 1
        del buffer[:start]
        if len(buffer) > max_line_bytes:
            raise StreamError(f"a line longer than {max_line_bytes} bytes")
