"""``GET /v1/kv_events``: the KV cache's block events as a long-lived NDJSON stream, for gateways.

A gateway routing by prefix needs to know which blocks each pod holds (llm-d does it with vLLM's
``BlockStored``/``BlockRemoved``/``AllBlocksCleared`` over ZMQ; we use one HTTP stream per
gateway). Blocks are named by the engine's chained hash (:mod:`slipstream.server.kv_hash`), in
lowercase hex. The response (``application/x-ndjson``) is one JSON object per line:

1. A snapshot, in one or more lines of at most :data:`SNAPSHOT_CHUNK` blocks each::

       {"type": "snapshot", "seq": S, "block_size": B, "model": "…", "blocks": ["<hex>", …], "last": false}
       …
       {"type": "snapshot", "seq": S, "block_size": B, "model": "…", "blocks": [...], "last": true}

   Together they list every block the cache can share after event batch ``S``; a subscriber
   replaces what it knew of this pod with them.
2. Event batches, one per engine step that changed the cache, ``seq`` = S+1, S+2, … without gaps
   (a gap means the subscriber missed something: reconnect)::

       {"type": "events", "seq": N, "block_size": B,
        "events": [{"type": "stored", "blocks": [...]}, {"type": "removed", "blocks": [...]}, …]}

   ``stored``: the blocks became shareable; ``removed``: they were evicted (their hash is gone);
   ``{"type": "cleared"}``: every block is gone (reserved: the engine has no such operation yet).
   Events apply in order.
3. An empty line (``"\\n"``) every ``heartbeat`` seconds in which nothing else was sent, so a
   silent pod can be told from an idle one.

The stream ends when the server drains or shuts down, and when the subscriber falls more than
``queue_size`` batches behind (the engine thread never waits for a subscriber): reconnecting
gives a fresh snapshot. Like every ``/v1`` route it needs ``Authorization: Bearer <key>`` under
``--api-key``; 503 while the model loads or the server drains.
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections import deque

from aiohttp import web

from slipstream.server.api.errors import APIError
from slipstream.server.api.state import STATE
from slipstream.server.engine.async_llm import KVEventBatch, KVSnapshot

logger = logging.getLogger("slipstream.server")

SNAPSHOT_CHUNK = 1024  # blocks per snapshot line (~36 KiB), well under line limits of NDJSON readers
HEARTBEAT_SECONDS = 2.0
QUEUE_SIZE = 1024  # event batches a subscriber may fall behind before it is disconnected
CONTENT_TYPE = "application/x-ndjson"


def snapshot_lines(snapshot: KVSnapshot, model: str, chunk: int = SNAPSHOT_CHUNK) -> list[bytes]:
    """A snapshot as its NDJSON lines (at least one, the last with ``"last": true``)."""
    hashes = [h.hex() for h in snapshot.block_hashes]
    parts = [hashes[i:i + chunk] for i in range(0, len(hashes), chunk)] or [[]]
    return [_line({"type": "snapshot", "seq": snapshot.seq, "block_size": snapshot.block_size, "model": model,
                   "blocks": part, "last": i == len(parts) - 1}) for i, part in enumerate(parts)]


def batch_line(batch: KVEventBatch, block_size: int) -> bytes:
    """One event batch as its NDJSON line."""
    events = [{"type": e.kind, "blocks": [h.hex() for h in e.block_hashes]} for e in batch.events]
    return _line({"type": "events", "seq": batch.seq, "block_size": block_size, "events": events})


def _line(obj: dict) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


class _Subscriber:
    """One open stream: the batches not yet written, bounded."""

    __slots__ = ("limit", "batches", "wake", "overflowed", "writing", "transport")

    def __init__(self, limit: int, transport: asyncio.Transport | None) -> None:
        self.limit = limit
        self.batches: deque[KVEventBatch] = deque()
        self.wake = asyncio.Event()
        self.overflowed = False
        self.writing = False
        self.transport = transport

    def offer(self, batch: KVEventBatch) -> None:
        if self.overflowed:
            return
        if len(self.batches) >= self.limit:
            self.overflowed = True
            self.batches.clear()
            if self.writing and self.transport is not None:  # stuck in a write to a reader that stopped reading
                self.transport.abort()
        else:
            self.batches.append(batch)
        self.wake.set()


class KVEventsAPI:
    """The endpoint of one app; it listens to the engine only while some stream is open.

    heartbeat: seconds of silence before an empty keep-alive line. queue_size: event batches a
    subscriber may fall behind before its stream is closed.
    """

    def __init__(self, heartbeat: float = HEARTBEAT_SECONDS, queue_size: int = QUEUE_SIZE) -> None:
        self.heartbeat = heartbeat
        self.queue_size = queue_size
        self._subscribers: set[_Subscriber] = set()
        self._llm = None
        self._closing = False

    @property
    def num_subscribers(self) -> int:
        return len(self._subscribers)

    def publish(self, batch: KVEventBatch) -> None:
        """Engine listener (on the event loop): queue ``batch`` for every open stream."""
        for sub in self._subscribers:
            sub.offer(batch)

    async def stream(self, request: web.Request) -> web.StreamResponse:
        state = request.app[STATE]
        state.check_accepting()
        llm = state.llm
        sub = _Subscriber(self.queue_size, request.transport)
        self._subscribe(llm, sub)
        response = web.StreamResponse(headers={"Content-Type": CONTENT_TYPE, "Cache-Control": "no-store"})
        try:
            try:
                snapshot = await llm.kv_snapshot()  # batches from now on queue in sub meanwhile
            except RuntimeError:
                raise APIError(503, "The engine is stopping; retry on another replica.", code="server_shutting_down",
                               headers={"Retry-After": "1"}) from None
            await response.prepare(request)
            await self._write(sub, response, b"".join(snapshot_lines(snapshot, state.model_name)))
            while not (self._closing or state.draining):
                if sub.overflowed:
                    logger.warning("KV-event subscriber %s fell %d batches behind: disconnected", request.remote,
                                   self.queue_size)
                    break
                if not sub.batches:
                    sub.wake.clear()
                    try:
                        await asyncio.wait_for(sub.wake.wait(), self.heartbeat)
                    except asyncio.TimeoutError:
                        await self._write(sub, response, b"\n")
                    continue
                pending = [sub.batches.popleft() for _ in range(len(sub.batches))]
                lines = [batch_line(b, snapshot.block_size) for b in pending if b.seq > snapshot.seq]
                if lines:
                    await self._write(sub, response, b"".join(lines))
        except ConnectionError as exc:  # the subscriber went away
            logger.debug("KV-event stream to %s ended: %s", request.remote, exc)
        finally:
            self._unsubscribe(sub)
        return response

    async def close(self, app: web.Application) -> None:
        """``on_shutdown``: end every open stream so the server's shutdown does not wait for them."""
        self._closing = True
        for sub in self._subscribers:
            sub.wake.set()

    def _subscribe(self, llm, sub: _Subscriber) -> None:
        if self._llm is not llm and self._llm is not None:  # the app was given another engine
            self._llm.remove_kv_event_listener(self.publish)
            self._llm = None
        self._subscribers.add(sub)
        if self._llm is None:
            self._llm = llm
            llm.add_kv_event_listener(self.publish)

    def _unsubscribe(self, sub: _Subscriber) -> None:
        self._subscribers.discard(sub)
        if not self._subscribers and self._llm is not None:
            self._llm.remove_kv_event_listener(self.publish)
            self._llm = None

    @staticmethod
    async def _write(sub: _Subscriber, response: web.StreamResponse, data: bytes) -> None:
        sub.writing = True
        try:
            await response.write(data)
        finally:
            sub.writing = False


KV_EVENTS = web.AppKey("kv_events", KVEventsAPI)


def add_routes(app: web.Application) -> KVEventsAPI:
    """Serve ``GET /v1/kv_events`` on ``app``; the endpoint object is also ``app[KV_EVENTS]``."""
    api = KVEventsAPI()
    app[KV_EVENTS] = api
    app.router.add_get("/v1/kv_events", api.stream)
    app.on_shutdown.append(api.close)
    return api
