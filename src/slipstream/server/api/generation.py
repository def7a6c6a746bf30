"""The engine requests behind one API call, merged into one stream; closing it aborts them all.

A completions call with several prompts becomes one engine request per prompt; their outputs
arrive interleaved. Every request is started (the first output awaited, or its rejection raised)
before the caller commits to a status code, so a streaming request that the engine refuses still
gets a real 400, not a 200 with an error inside the stream.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from slipstream.api_types.tenancy import DEFAULT_TENANT
from slipstream.server.engine.outputs import RequestOutput


def engine_request_ids(request_id: str, num_prompts: int) -> list[str]:
    """The engine's id for each prompt of one API call."""
    return [request_id] if num_prompts == 1 else [f"{request_id}-{i}" for i in range(num_prompts)]


class GenerationGroup:
    """Runs ``llm.generate`` for each prompt; iterate for ``(prompt_index, RequestOutput)`` pairs.

    Use as ``async with GenerationGroup(...) as group: await group.start(); async for ...``.
    Leaving the block early (client gone, error, cancellation) aborts every unfinished request.
    """

    def __init__(self, llm: Any, prompts: list, params: Any, request_id: str, tenant: str = DEFAULT_TENANT,
                 priority: int = 0) -> None:
        self._llm = llm
        self._ids = engine_request_ids(request_id, len(prompts))
        self._gens = [llm.generate(p, params, request_id=rid, tenant=tenant, priority=priority)
                      for p, rid in zip(prompts, self._ids)]
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._first: list[RequestOutput] = []
        self._finished = [False] * len(prompts)

    @property
    def request_ids(self) -> list[str]:
        return self._ids

    @property
    def first_outputs(self) -> list[RequestOutput]:
        """Each request's first output, once :meth:`start` returned."""
        return self._first

    async def start(self) -> None:
        """Submit every request and wait for its first output.

        Raises:
            RequestRejected / ValueError: the engine refused a request (all others are aborted).
        """
        results = await asyncio.gather(*(anext(g) for g in self._gens), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await self.close()
            raise errors[0]
        self._first = list(results)
        for i, gen in enumerate(self._gens):
            if not self._first[i].finished:
                self._tasks.append(asyncio.create_task(self._pump(i, gen)))

    async def _pump(self, index: int, gen: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in gen:
                await self._queue.put((index, out))
        except Exception as exc:  # handed to the consumer, who decides; cancellation is not
            await self._queue.put((index, exc))

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        remaining = len(self._gens)
        for i, out in enumerate(self._first):
            yield i, out
            if out.finished:
                self._finished[i] = True
                remaining -= 1
        while remaining:
            index, item = await self._queue.get()
            if isinstance(item, BaseException):
                self._finished[index] = True
                raise item
            yield index, item
            if item.finished:
                self._finished[index] = True
                remaining -= 1

    async def close(self) -> None:
        """Abort whatever has not finished; safe to call more than once.

        The aborts are queued first, before anything here can be suspended: a handler cancelled
        again while it cleans up (the client went away) must still free the engine's blocks.
        """
        for rid, done in zip(self._ids, self._finished):
            if not done:
                self._llm.abort_nowait(rid)
        self._finished = [True] * len(self._finished)
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        for gen in self._gens:
            await gen.aclose()

    async def __aenter__(self) -> GenerationGroup:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
