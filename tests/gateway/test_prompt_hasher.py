"""The gateway's prompt hashes against the pod's own: what :class:`PromptHasher` computes for a
request body must be, byte for byte, the block hashes the pod reports as stored over
``/v1/kv_events`` when it serves that body — else precise prefix routing routes blind.

The pod is the real server and engine in-process (``sim:tiny``, the built-in model's tokenizer
and chat template) on 127.0.0.1; the hasher fetches the tokenizer from it over HTTP.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from slipstream.server.api.app import build_app
from slipstream.server.api.state import ServerOptions
from slipstream.server.engine.async_llm import AsyncLLM
from slipstream.server.engine.config import EngineConfig
from slipstream.server.gateway.kv_events import KVEventSubscriber
from slipstream.server.gateway.routing import BlockIndex
from slipstream.server.gateway.tokenize import CHAT_PATH, COMPLETIONS_PATH, PromptHasher
from slipstream.server.kv_hash import prompt_block_hashes

BLOCK = 16
SYSTEM = ("You are the routing oracle's assistant. Answer in one short sentence, cite nothing, and never "
          "apologise. ") * 8
UNREACHABLE = "http://127.0.0.1:9"  # the discard port: nothing listens there


@dataclass
class Pod:
    url: str
    llm: AsyncLLM


@contextlib.asynccontextmanager
async def serve_pod(tokenizer, **options) -> AsyncIterator[Pod]:
    """A ``sim:tiny`` pod on 127.0.0.1 (ephemeral port) with the built-in model's tokenizer."""
    from slipstream.server.sim.backend import build_engine

    engine = build_engine(EngineConfig(model="sim:tiny,time_scale=0.001", block_size=BLOCK, max_num_seqs=4,
                                       max_num_batched_tokens=256, kv_cache_memory_bytes=16 << 20,
                                       max_model_len=1024), tokenizer=tokenizer)
    llm = AsyncLLM(engine=engine)
    await llm.start()
    runner = web.AppRunner(build_app(ServerOptions(log_interval=0, **options), llm), handler_cancellation=True,
                           access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield Pod(f"http://127.0.0.1:{runner.addresses[0][1]}", llm)
    finally:
        await runner.cleanup()
        await llm.shutdown()


class RecordingIndex(BlockIndex):
    """A block index that also keeps every stored hash in arrival order."""

    def __init__(self) -> None:
        super().__init__()
        self.stored_log: list[bytes] = []

    def stored(self, endpoint, block_hashes) -> None:
        block_hashes = list(block_hashes)
        self.stored_log.extend(block_hashes)
        super().stored(endpoint, block_hashes)


async def until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def send(session: aiohttp.ClientSession, pod: Pod, path: str, body: dict) -> None:
    async with session.post(pod.url + path, json={**body, "max_tokens": 1, "temperature": 0}) as resp:
        assert resp.status == 200, await resp.text()


async def test_gateway_hashes_are_the_blocks_the_pod_stores_byte_for_byte(tokenizer):
    async with serve_pod(tokenizer) as pod, aiohttp.ClientSession() as session:
        index = RecordingIndex()
        subscriber = KVEventSubscriber(index, session, reconnect_seconds=0.05)
        subscriber.watch("pod", pod.url)
        hasher = PromptHasher(session)
        await until(lambda: subscriber.connects.get("pod") == 1)

        async def served(path: str, body: dict) -> tuple[bytes, ...]:
            """Hash ``body`` as the gateway would, serve it, and check the pod stored exactly the
            hashes it did not hold already, in order; returns the gateway's hashes."""
            hashes = await hasher.block_hashes(path, body, pod.url, BLOCK)
            held = {h for h in hashes if index.match([h])}
            before = len(index.stored_log)
            await send(session, pod, path, body)
            await until(lambda: index.match(hashes) == {"pod": len(hashes)})
            assert index.stored_log[before:] == [h for h in hashes if h not in held]
            return hashes

        chat = await served(CHAT_PATH, {"messages": [{"role": "system", "content": SYSTEM},
                                                      {"role": "user", "content": "What is the capital of France?"}]})
        assert len(chat) >= 10
        # developer read as system, text parts joined: the same system prompt, so the same leading blocks
        follow_up = await served(CHAT_PATH, {"messages": [
            {"role": "developer", "content": [{"type": "text", "text": SYSTEM}]},
            {"role": "user", "content": [{"type": "text", "text": "And of Spain?"},
                                         {"type": "text", "text": "Briefly."}]}]})
        shared = next(i for i, (a, b) in enumerate(zip(chat, follow_up)) if a != b)
        assert shared >= 8
        continued = await served(CHAT_PATH, {"messages": [{"role": "system", "content": SYSTEM},
                                                          {"role": "user", "content": "Name a river."},
                                                          {"role": "assistant", "content": "The Loire, which"}],
                                             "continue_final_message": True, "add_generation_prompt": False})
        assert continued[:shared] == chat[:shared]
        text = await served(COMPLETIONS_PATH, {"prompt": SYSTEM + "Question: what is two plus two? Answer:"})
        assert len(text) >= 10
        ids = tokenizer.encode(SYSTEM + "Question: what is two plus two? Answer: four. Question:",
                               add_special_tokens=True)
        token_ids = await served(COMPLETIONS_PATH, {"prompt": ids})
        assert token_ids == tuple(prompt_block_hashes(ids, BLOCK))
        batch = await hasher.block_hashes(COMPLETIONS_PATH, {"prompt": [SYSTEM + "Question: what is two plus two? "
                                                                        "Answer:", "another prompt"]}, pod.url, BLOCK)
        assert batch == text  # a batch of prompts hashes as its first
        await subscriber.close()


async def test_tokenizer_files_are_listed_and_served_by_name_only(tokenizer):
    async with serve_pod(tokenizer) as pod, aiohttp.ClientSession() as session:
        async with session.get(pod.url + "/v1/tokenizer/files") as resp:
            files = (await resp.json())["files"]
        assert "tokenizer.json" in files and "tokenizer_config.json" in files
        for name in files:
            async with session.get(f"{pod.url}/v1/tokenizer/files/{name}") as resp:
                assert resp.status == 200 and len(await resp.read()) > 0
        for name in ("secrets.txt", "..%2F..%2Fetc%2Fpasswd", "%2E%2E"):
            async with session.get(f"{pod.url}/v1/tokenizer/files/{name}") as resp:
                assert resp.status == 404
                assert (await resp.json())["error"]["code"] in ("not_found", None)


async def test_tokenizer_files_need_the_api_key_and_the_hasher_can_send_it(tokenizer):
    async with serve_pod(tokenizer, api_key="sesame") as pod, aiohttp.ClientSession() as session:
        body = {"prompt": "Hello there, general routing."}
        assert await PromptHasher(session).block_hashes(COMPLETIONS_PATH, body, pod.url, 4) == ()
        keyed = PromptHasher(session, headers={"Authorization": "Bearer sesame"})
        expected = prompt_block_hashes(tokenizer.encode(body["prompt"], add_special_tokens=True), 4)
        assert await keyed.block_hashes(COMPLETIONS_PATH, body, pod.url, 4) == tuple(expected) != ()


async def test_concurrent_callers_share_one_tokenizer_load(tokenizer):
    async with serve_pod(tokenizer) as pod:
        listed: list[str] = []
        trace = aiohttp.TraceConfig()

        async def on_start(session, context, params) -> None:
            if params.url.path == "/v1/tokenizer/files":
                listed.append(str(params.url))

        trace.on_request_start.append(on_start)
        async with aiohttp.ClientSession(trace_configs=[trace]) as session:
            hasher = PromptHasher(session)
            bodies = [{"prompt": f"Prompt number {i} " * 10} for i in range(6)]
            results = await asyncio.gather(*(hasher.block_hashes(COMPLETIONS_PATH, b, pod.url, BLOCK) for b in bodies))
            assert len(listed) == 1 and all(results) and len(set(results)) == 6
            await hasher.close()


async def test_bodies_the_server_renders_differently_or_rejects_hash_to_nothing(tokenizer):
    async with serve_pod(tokenizer) as pod, aiohttp.ClientSession() as session:
        hasher = PromptHasher(session)
        user = {"role": "user", "content": "hi " * 40}
        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        unhashable = [
            (CHAT_PATH, {"messages": [user], "tools": [tool]}),  # the server teaches tools in the prompt
            (CHAT_PATH, {"messages": [user, {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}),
            (CHAT_PATH, {"messages": "hello"}),
            (CHAT_PATH, {"messages": [{"content": "no role"}]}),
            (CHAT_PATH, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
            (COMPLETIONS_PATH, {"prompt": ""}),
            (COMPLETIONS_PATH, {"prompt": [1, "mixed"]}),
            (COMPLETIONS_PATH, {}),
            ("/v1/responses", {"input": "hi"}),
        ]
        for path, body in unhashable:
            assert await hasher.block_hashes(path, body, pod.url, BLOCK) == (), body
        assert await hasher.block_hashes(COMPLETIONS_PATH, {"prompt": "x " * 40}, pod.url, 0) == ()
        # tools the server keeps out of the prompt (tool_choice none) change nothing
        plain = await hasher.block_hashes(CHAT_PATH, {"messages": [user]}, pod.url, BLOCK)
        assert plain and await hasher.block_hashes(CHAT_PATH, {"messages": [user], "tools": [tool],
                                                               "tool_choice": "none"}, pod.url, BLOCK) == plain


async def test_token_ids_hash_without_a_tokenizer_and_a_failed_load_gives_nothing():
    async with aiohttp.ClientSession() as session:
        hasher = PromptHasher(session, max_blocks=3, timeout=2)
        ids = list(range(100, 180))
        assert await hasher.block_hashes(COMPLETIONS_PATH, {"prompt": ids}, UNREACHABLE, 16) == \
            tuple(prompt_block_hashes(ids, 16)[:3])
        assert await hasher.block_hashes(COMPLETIONS_PATH, {"prompt": [ids, [1, 2]]}, UNREACHABLE, 8) == \
            tuple(prompt_block_hashes(ids, 8)[:3])
        assert await hasher.block_hashes(COMPLETIONS_PATH, {"prompt": "text needs the tokenizer"}, UNREACHABLE,
                                         4) == ()
        assert await hasher.block_hashes(CHAT_PATH, {"messages": [{"role": "user", "content": "hi"}]}, UNREACHABLE,
                                         4) == ()
