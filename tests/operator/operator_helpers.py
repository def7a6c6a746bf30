"""Helpers shared by the operator tests (a uniquely named module: tests/ has other conftests)."""
from __future__ import annotations

import asyncio
import pathlib
from typing import Any, Awaitable, Callable

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
CRD_PATH = ROOT / "crds" / "inferenceservice.yaml"
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
NAMESPACE = "ml"


async def eventually(check: Callable[[], Awaitable[Any] | Any], timeout: float = 10.0,
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
