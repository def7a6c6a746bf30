"""Helpers shared by the operator tests (a uniquely named module: tests/ has other conftests)."""
from __future__ import annotations

import asyncio
import contextlib
import pathlib
import threading
from typing import Any, AsyncIterator, Awaitable, Callable

import kopf
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
CRD_PATH = ROOT / "crds" / "inferenceservice.yaml"
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
NAMESPACE = "ml"


async def eventually(check: Callable[[], Awaitable[Any] | Any], timeout: float = 20.0,
                     what: str = "condition") -> Any:
    """Poll ``check`` (sync or async) until it returns a truthy value; fail after ``timeout`` s."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            result = check()
            if asyncio.iscoroutine(result):
                result = await result
            if result:
                return result
            last: Any = result
        except (KeyError, ValueError, AssertionError) as exc:
            last = exc
        if asyncio.get_running_loop().time() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}; last: {last!r}")
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def running_operator(**operator_arguments: Any) -> AsyncIterator[None]:
    """``kopf.operator(**operator_arguments)`` in a thread with its own event loop, as in
    production: on exit kopf cancels every task it did not start in its loop, which would
    include the test's own."""
    stop, ready = threading.Event(), threading.Event()
    thread = threading.Thread(name="kopf", daemon=True, target=asyncio.run, args=(
        kopf.operator(**operator_arguments, stop_flag=stop, ready_flag=ready),))
    thread.start()
    try:
        await eventually(ready.is_set, what="the operator to start")
        yield
    finally:
        stop.set()
        await asyncio.to_thread(thread.join, 15)
        assert not thread.is_alive(), "the operator did not stop within 15 s"
