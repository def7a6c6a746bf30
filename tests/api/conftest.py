"""Serving the real engine (built-in model, CPU) from a background event loop, on 127.0.0.1.

One engine per test session, loaded once; each test module serves it through its own app (with
its own options) on an ephemeral port. Tests talk to it over loopback with real clients (the
``openai`` package, requests, aiohttp), from their own thread or event loop.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from slipstream.server.engine.config import EngineConfig

from .harness import TEST_ENGINE, LoopThread, Served, serve_app


@pytest.fixture(scope="session")
def loop_thread() -> Iterator[LoopThread]:
    loop = LoopThread()
    yield loop
    loop.close()


@pytest.fixture(scope="session")
def engine(loop_thread: LoopThread) -> Iterator[Any]:
    from slipstream.server.engine.async_llm import AsyncLLM

    async def load() -> Any:
        llm = AsyncLLM(EngineConfig(**TEST_ENGINE))
        await llm.start()
        await llm.warmup()
        return llm

    llm = loop_thread.run(load(), timeout=300)
    yield llm
    loop_thread.run(llm.shutdown())


@pytest.fixture(scope="module")
def server(loop_thread: LoopThread, engine: Any) -> Iterator[Served]:
    with serve_app(loop_thread, engine) as served:
        yield served
