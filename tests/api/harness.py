"""Helpers of the API tests: serve the real engine from a background event loop on 127.0.0.1,
talk to it, and check what it leaves behind."""
from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import requests
from aiohttp import web

from slipstream.server.api.app import build_app
from slipstream.server.api.state import STATE, ServerOptions, ServerState

# Small enough to be quick on two cores, large enough for 32 concurrent short requests.
TEST_ENGINE = dict(model="builtin", device="cpu", max_num_seqs=8, max_num_batched_tokens=256,
                   kv_cache_memory_bytes=96 << 20, max_model_len=512, seed=0)


class LoopThread:
    """An asyncio loop running in a daemon thread; ``run`` executes a coroutine there and waits."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="server-loop", daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout: float = 120.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@dataclass
class Served:
    """One app serving the shared engine."""

    url: str
    app: web.Application
    llm: Any
    loop: LoopThread

    @property
    def state(self) -> ServerState:
        return self.app[STATE]

    @property
    def v1(self) -> str:
        return self.url + "/v1"


@contextlib.contextmanager
def serve_app(loop: LoopThread, llm: Any, **options: Any) -> Iterator[Served]:
    """Serve ``llm`` with ``ServerOptions(**options)`` on 127.0.0.1 at an ephemeral port."""

    async def start() -> tuple[web.AppRunner, web.Application, int]:
        app = build_app(ServerOptions(log_interval=0, **options), llm)
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return runner, app, runner.addresses[0][1]

    runner, app, port = loop.run(start())
    try:
        yield Served(f"http://127.0.0.1:{port}", app, llm, loop)
    finally:
        loop.run(runner.cleanup())


class Http(requests.Session):
    """``requests`` with a base URL and a default timeout: ``http.post("/v1/completions", json=...)``."""

    def __init__(self, base_url: str, timeout: float = 60.0) -> None:
        super().__init__()
        self.base_url, self.timeout = base_url, timeout

    def request(self, method: str, url: str, *args: Any, **kwargs: Any) -> requests.Response:
        kwargs.setdefault("timeout", self.timeout)
        return super().request(method, self.base_url + url, *args, **kwargs)


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def engine_idle(llm: Any) -> bool:
    """No request running or waiting, and every KV block back in the pool."""
    s = llm.stats()
    return s.num_running == 0 and s.num_waiting == 0 and s.num_free_blocks == s.num_blocks


def assert_engine_idle(llm: Any, timeout: float = 10.0) -> None:
    assert wait_until(lambda: engine_idle(llm), timeout), f"engine not idle / blocks leaked: {llm.stats()}"


def assert_error(response: Any, status: int, *, param: str | None = "any", code: str | None = "any") -> dict:
    """The response has ``status`` and OpenAI's JSON error body; returns the ``error`` object."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json"), response.headers
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param != "any":
        assert error["param"] == param, error
    if code != "any":
        assert error["code"] == code, error
    return error
