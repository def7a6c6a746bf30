"""A pod's KV-cache events (``GET /v1/kv_events``) and the gateway's subscriber that follows them.

Pods are the real server and engine in-process (``sim:tiny``: the real scheduler and KV cache, a
cost model in place of the forward pass) on 127.0.0.1; the gateway's :class:`KVEventSubscriber`
keeps a :class:`BlockIndex` from their streams. The index must mirror the pod's cache exactly.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from slipstream.api_types.metrics import read_pod_load
from slipstream.server.api.app import build_app
from slipstream.server.api.kv_events import KV_EVENTS, KVEventsAPI
from slipstream.server.api.state import STATE, ServerOptions
from slipstream.server.engine.async_llm import AsyncLLM, KVEventBatch
from slipstream.server.engine.config import EngineConfig
from slipstream.server.engine.kv_cache import KVEvent
from slipstream.server.gateway.kv_events import KVEventSubscriber
from slipstream.server.gateway.routing import BlockIndex
from slipstream.server.kv_hash import prompt_block_hashes

BLOCK = 16
NUM_BLOCKS = 64  # 8 MiB of sim:tiny's 8 KiB-per-token KV: small enough to evict


@dataclass
class Pod:
    url: str
    app: web.Application
    llm: AsyncLLM

    @property
    def kv_events(self) -> KVEventsAPI:
        return self.app[KV_EVENTS]

    async def cached(self) -> set[bytes]:
        return set((await self.llm.kv_snapshot()).block_hashes)


@contextlib.asynccontextmanager
async def serve_pod(tokenizer, heartbeat: float = 2.0, queue_size: int = 1024, **options) -> AsyncIterator[Pod]:
    """A ``sim:tiny`` pod with a pool of :data:`NUM_BLOCKS` blocks on 127.0.0.1 (ephemeral port)."""
    from slipstream.server.sim.backend import build_engine

    engine = build_engine(EngineConfig(model="sim:tiny,time_scale=0.001", block_size=BLOCK, max_num_seqs=4,
                                       max_num_batched_tokens=256, kv_cache_memory_bytes=NUM_BLOCKS * BLOCK * 8192,
                                       max_model_len=512), tokenizer=tokenizer)
    assert engine.kv.num_blocks == NUM_BLOCKS
    llm = AsyncLLM(engine=engine)
    await llm.start()
    app = build_app(ServerOptions(log_interval=0, **options), llm)
    app[KV_EVENTS].heartbeat, app[KV_EVENTS].queue_size = heartbeat, queue_size
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield Pod(f"http://127.0.0.1:{runner.addresses[0][1]}", app, llm)
    finally:
        await runner.cleanup()
        await llm.shutdown()


async def until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def complete(session: aiohttp.ClientSession, pod: Pod, prompt: list[int], **headers: str) -> None:
    async with session.post(pod.url + "/v1/completions", headers=headers,
                            json={"prompt": prompt, "max_tokens": 1, "temperature": 0}) as resp:
        assert resp.status == 200, await resp.text()


def ids(start: int, n: int) -> list[int]:
    """``n`` distinct token ids (the sim vocabulary is the built-in model's)."""
    return [(start + i) % 1000 + 10 for i in range(n)]


async def test_stream_starts_with_a_snapshot_then_numbered_event_batches_and_heartbeats(tokenizer):
    async with serve_pod(tokenizer, heartbeat=0.1) as pod, aiohttp.ClientSession() as session:
        first = ids(0, 40)
        await complete(session, pod, first)  # 2 full blocks cached before anyone listens
        async with session.get(pod.url + "/v1/kv_events") as resp:
            assert resp.status == 200 and resp.headers["Content-Type"] == "application/x-ndjson"
            snapshot = json.loads(await resp.content.readline())
            assert snapshot == {"type": "snapshot", "seq": 0, "block_size": BLOCK, "model": "sim-tiny",
                                "blocks": [h.hex() for h in prompt_block_hashes(first, BLOCK)], "last": True}
            assert await asyncio.wait_for(resp.content.readline(), 2) == b"\n"  # heartbeat while idle
            second = ids(100, 50)
            await complete(session, pod, second)
            line = b"\n"
            while line == b"\n":
                line = await asyncio.wait_for(resp.content.readline(), 2)
            assert json.loads(line) == {"type": "events", "seq": 1, "block_size": BLOCK, "events": [
                {"type": "stored", "blocks": [h.hex() for h in prompt_block_hashes(second, BLOCK)]}]}
            pod.app[STATE].draining = True  # a draining pod ends the stream (its blocks will go)
            assert (await asyncio.wait_for(resp.content.read(), 2)).strip() == b""  # heartbeats, then the end
        await until(lambda: pod.kv_events.num_subscribers == 0, 2)


async def test_index_mirrors_the_pods_cache_through_stores_and_evictions(tokenizer):
    async with serve_pod(tokenizer) as pod, aiohttp.ClientSession() as session:
        index = BlockIndex()
        subscriber = KVEventSubscriber(index, session, reconnect_seconds=0.05)
        subscriber.watch("pod-a", pod.url)
        await until(lambda: subscriber.connects.get("pod-a") == 1)
        assert subscriber.block_sizes == {"pod-a": BLOCK}
        early = ids(0, 160)  # 10 blocks
        await complete(session, pod, early)
        early_hashes = prompt_block_hashes(early, BLOCK)
        await until(lambda: index.match(early_hashes) == {"pod-a": 10})
        for k in range(1, 4):  # 3 × 25 blocks through a 64-block pool: the early prompt's blocks are evicted
            await complete(session, pod, ids(200 * k, 400))
        cached = await pod.cached()
        # A full pool keeps its count while blocks turn over, so the count alone cannot say the index has
        # caught up with the last step's events: wait for the same set, block for block.
        await until(lambda: index.blocks_of("pod-a") == len(cached)
                    and all(index.match([h]) == {"pod-a": 1} for h in cached))
        assert index.match(early_hashes) == {} and not cached & set(early_hashes)
        await subscriber.close()
        assert index.blocks_of("pod-a") == 0 and len(index) == 0


async def test_a_reconnecting_subscriber_rebuilds_its_view_from_the_snapshot(tokenizer):
    async with serve_pod(tokenizer) as pod, aiohttp.ClientSession() as session:
        prompt = ids(0, 100)
        await complete(session, pod, prompt)
        index = BlockIndex()
        subscriber = KVEventSubscriber(index, session, reconnect_seconds=0.05)
        subscriber.watch("pod-a", pod.url)  # joins after the blocks were stored: only the snapshot has them
        await until(lambda: index.blocks_of("pod-a") == 6)
        assert index.match(prompt_block_hashes(prompt, BLOCK)) == {"pod-a": 6}
        subscriber.unwatch("pod-a")
        assert len(index) == 0 and subscriber.watching() == []
        await until(lambda: pod.kv_events.num_subscribers == 0)
        subscriber.watch("pod-a", pod.url)
        await until(lambda: index.blocks_of("pod-a") == 6)
        await subscriber.close()


async def test_a_subscriber_that_falls_behind_is_disconnected_and_resyncs(tokenizer):
    async with serve_pod(tokenizer, queue_size=2) as pod, aiohttp.ClientSession() as session:
        prompt = ids(0, 64)
        await complete(session, pod, prompt)
        index = BlockIndex()
        subscriber = KVEventSubscriber(index, session, reconnect_seconds=0.05)
        subscriber.watch("pod-a", pod.url)
        await until(lambda: subscriber.connects.get("pod-a") == 1 and pod.kv_events.num_subscribers == 1)
        bogus = bytes(16)
        for seq in range(1, 4):  # a burst faster than the stream drains: 3 batches queued, room for 2
            pod.kv_events.publish(KVEventBatch(seq, [KVEvent("stored", [bogus])]))
        await until(lambda: subscriber.connects.get("pod-a") == 2)  # dropped, reconnected, fresh snapshot
        assert index.blocks_of("pod-a") == 4 and index.match([bogus]) == {}
        assert pod.kv_events.num_subscribers == 1
        await subscriber.close()


async def test_kv_events_need_the_api_key_like_every_v1_route(tokenizer):
    async with serve_pod(tokenizer, api_key="sesame") as pod, aiohttp.ClientSession() as session:
        async with session.get(pod.url + "/v1/kv_events") as resp:
            assert resp.status == 401 and (await resp.json())["error"]["code"] == "invalid_api_key"
        index = BlockIndex()
        subscriber = KVEventSubscriber(index, session, reconnect_seconds=0.05,
                                       headers={"Authorization": "Bearer sesame"})
        subscriber.watch("pod-a", pod.url)
        await complete(session, pod, ids(0, 32), Authorization="Bearer sesame")
        await until(lambda: index.blocks_of("pod-a") == 2)
        await subscriber.close()


class ScriptedPod:
    """A fake pod whose /v1/kv_events sends the given lines, then holds the connection silent."""

    def __init__(self, lines: list[dict]) -> None:
        self.lines = lines
        self.connects = 0

    async def handler(self, request: web.Request) -> web.StreamResponse:
        self.connects += 1
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        for line in self.lines:
            await resp.write(json.dumps(line).encode() + b"\n")
        await asyncio.sleep(3600)
        return resp


@contextlib.asynccontextmanager
async def serve_scripted(pod: ScriptedPod) -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_get("/v1/kv_events", pod.handler)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.5)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def snapshot(blocks: list[bytes], seq: int = 0) -> dict:
    return {"type": "snapshot", "seq": seq, "block_size": BLOCK, "blocks": [b.hex() for b in blocks], "last": True}


async def test_a_silent_pod_is_forgotten_and_reconnected():
    blocks = [bytes([i]) * 16 for i in range(3)]
    pod = ScriptedPod([snapshot(blocks)])
    async with serve_scripted(pod) as url, aiohttp.ClientSession() as session:
        index = BlockIndex()
        subscriber = KVEventSubscriber(index, session, reconnect_seconds=0.5, silence_seconds=0.3)
        subscriber.watch("pod-a", url)
        await until(lambda: index.blocks_of("pod-a") == 3)
        await until(lambda: index.blocks_of("pod-a") == 0, 2)  # no heartbeat within 0.3 s
        await until(lambda: pod.connects == 2 and index.blocks_of("pod-a") == 3, 3)
        await subscriber.close()


async def test_events_apply_in_order_and_a_gap_in_the_sequence_drops_the_pods_blocks():
    a, b, c = (bytes([i]) * 16 for i in range(3))
    script = [{**snapshot([a]), "last": False}, snapshot([b]),  # one snapshot in two lines
              {"type": "events", "seq": 1, "block_size": BLOCK,
               "events": [{"type": "stored", "blocks": [c.hex()]}, {"type": "removed", "blocks": [a.hex()]}]}]
    good, gapped = ScriptedPod(script), ScriptedPod(script + [{"type": "events", "seq": 3, "block_size": BLOCK,
                                                               "events": []}])
    async with serve_scripted(good) as good_url, serve_scripted(gapped) as gapped_url, \
            aiohttp.ClientSession() as session:
        index = BlockIndex()
        subscriber = KVEventSubscriber(index, session, reconnect_seconds=0.3, silence_seconds=5)
        subscriber.watch("good", good_url)
        await until(lambda: index.match([a]) == {} and index.match([b, c]) == {"good": 2})
        subscriber.watch("gapped", gapped_url)
        await until(lambda: gapped.connects == 2)
        assert index.blocks_of("gapped") in (0, 2)  # forgotten after the gap; maybe re-synced since
        assert index.endpoints() == ["good"] or index.blocks_of("gapped") == 2
        await subscriber.close()


async def test_a_pod_exports_the_settings_a_gateway_hashes_and_limits_with(tokenizer):
    async with serve_pod(tokenizer) as pod, aiohttp.ClientSession() as session:
        async with session.get(pod.url + "/metrics") as resp:
            text = await resp.text()
        info = [line for line in text.splitlines() if line.startswith("slipstream:engine_config_info{")]
        assert info == ['slipstream:engine_config_info{block_size="16",enable_prefix_caching="true",'
                        'long_prefill_token_threshold="0",max_num_batched_tokens="256",max_num_seqs="4",max_waiting="128",'
                        'model_name="sim-tiny"} 1.0']
        load = read_pod_load(text)
        assert (load.block_size, load.max_num_seqs, load.max_waiting) == (16, 4, 128)


class LoadingPod(ScriptedPod):
    """Answers 503 (the model is loading) until ``loaded``, then streams like a ScriptedPod."""

    loaded = False

    async def handler(self, request: web.Request) -> web.StreamResponse:
        if not self.loaded:
            self.connects += 1
            return web.json_response({"error": {"message": "loading"}}, status=503)
        return await super().handler(request)


async def test_a_pod_that_becomes_ready_is_followed_at_once_not_after_the_backoff():
    pod = LoadingPod([snapshot([bytes([7]) * 16])])
    async with serve_scripted(pod) as url, aiohttp.ClientSession() as session:
        index = BlockIndex()
        subscriber = KVEventSubscriber(index, session, reconnect_seconds=60, silence_seconds=5)
        subscriber.watch("pod-a", url)
        await until(lambda: pod.connects == 1)  # refused; now backing off for a minute
        pod.loaded = True
        await asyncio.sleep(0.2)
        assert index.blocks_of("pod-a") == 0
        subscriber.nudge("pod-a")  # the gateway saw the pod turn ready
        await until(lambda: index.blocks_of("pod-a") == 1, 3)
        await subscriber.close()
