"""The closed-loop tests' load generator: seeded Poisson arrivals in phases, each request a
streamed completion sent to the least-busy address of a changing endpoint list (what a gateway
does; the tests keep ``endpoints`` current from Pods or EndpointSlices)."""
from __future__ import annotations

import asyncio
import json
import random
import socket
import time
from dataclasses import dataclass, field

import aiohttp


def p99(values: list[float]) -> float:
    """The 99th percentile of ``values`` (nearest rank below)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


@dataclass
class Result:
    """One request: when it was sent (monotonic seconds), its phase and what came back."""
    sent: float
    phase: str
    ttft: float | None = None
    tokens: int = 0
    finish: str | None = None
    error: str | None = None
    address: str = ""


@dataclass
class LoadGenerator:
    """Sends ``max_tokens``-long greedy completions of 20 random token ids to ``model`` on
    ``port`` of whichever address in ``endpoints`` has the fewest requests outstanding."""
    model: str
    port: int
    output_tokens: int
    seed: int = 6
    results: list[Result] = field(default_factory=list)
    endpoints: list[str] = field(default_factory=list)
    outstanding: dict[str, int] = field(default_factory=dict)

    async def _one(self, session: aiohttp.ClientSession, result: Result, prompt: list[int]) -> None:
        while not self.endpoints:
            await asyncio.sleep(0.05)
        ip = min(self.endpoints, key=lambda a: self.outstanding.get(a, 0))
        result.address = ip
        self.outstanding[ip] = self.outstanding.get(ip, 0) + 1
        start = time.monotonic()
        try:
            async with session.post(f"http://{ip}:{self.port}/v1/completions", json={
                    "model": self.model, "prompt": prompt, "max_tokens": self.output_tokens,
                    "temperature": 0, "stream": True}) as response:
                if response.status != 200:
                    result.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                    return
                async for line in response.content:
                    if not line.startswith(b"data: {"):
                        continue
                    choice = json.loads(line[6:])["choices"][0]
                    if choice.get("text") and result.ttft is None:
                        result.ttft = time.monotonic() - start
                    result.tokens += 1 if choice.get("text") else 0
                    result.finish = choice.get("finish_reason") or result.finish
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            result.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.outstanding[ip] -= 1

    async def play(self, phases: list[tuple[str, float, float]]) -> dict[str, tuple[float, float]]:
        """Sends each phase's arrivals (name, requests/s, seconds) and waits for every answer;
        returns each phase's (start, end) on the monotonic clock."""
        rng = random.Random(self.seed)
        spans, tasks = {}, []
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=120)) as session:
            for name, rate, seconds in phases:
                start = at = time.monotonic()
                while True:
                    at += rng.expovariate(rate)
                    if at >= start + seconds:
                        break
                    await asyncio.sleep(max(0.0, at - time.monotonic()))
                    result = Result(time.monotonic(), name)
                    self.results.append(result)
                    prompt = [rng.randrange(300, 900) for _ in range(20)]
                    tasks.append(asyncio.create_task(self._one(session, result, prompt)))
                await asyncio.sleep(max(0.0, start + seconds - time.monotonic()))
                spans[name] = (start, start + seconds)
            await asyncio.gather(*tasks)
        return spans

    def failed(self) -> list[Result]:
        """Requests that errored or did not stream all their tokens to ``length``."""
        return [r for r in self.results
                if r.error or r.tokens != self.output_tokens or r.finish != "length"]


def free_port(addresses) -> int:
    """A TCP port free on every address in ``addresses`` (pods on 127.0.0.x share one port)."""
    for _ in range(50):
        port = random.randint(20000, 60000)
        try:
            for address in addresses:
                with socket.socket() as s:
                    s.bind((address, port))
            return port
        except OSError:
            continue
    raise RuntimeError(f"no port free on all of {', '.join(addresses)}")
