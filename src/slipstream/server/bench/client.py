"""A streaming OpenAI-completions load generator: Poisson arrivals, TTFT, ITL, throughput.

``slipstream bench serve`` and the repository's ``benchmarks/online.py`` both use it. Every
request is ``POST /v1/completions`` with ``stream: true`` and ``ignore_eos`` (a vLLM extension
that slipstream and llama.cpp's server accept), so a server generates exactly ``max_tokens``.
"""
from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field

import aiohttp

from .workload import WorkloadRequest


@dataclass
class RequestResult:
    """One request as the client saw it; times in seconds (``end`` on ``perf_counter``'s clock)."""

    ok: bool
    output_tokens: int = 0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)  # gaps between streamed chunks
    e2e: float = 0.0
    end: float = 0.0
    error: str = ""


async def one_request(session: aiohttp.ClientSession, url: str, req: WorkloadRequest,
                      model: str | None = None) -> RequestResult:
    """Stream one completion from ``url`` (the server's base URL); never raises for HTTP or
    connection errors, which come back as ``ok=False`` with ``error`` set."""
    body = {"prompt": req.prompt, "max_tokens": req.max_tokens, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    start = time.perf_counter()
    result = RequestResult(ok=False)
    last = None
    usage_tokens = None
    try:
        async with session.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                result.error = f"HTTP {r.status}: {(await r.text())[:200]}"
                return result
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                payload = json.loads(line[6:])
                if payload.get("usage"):
                    usage_tokens = payload["usage"].get("completion_tokens")
                choices = payload.get("choices") or []
                if not choices or not choices[0].get("text"):
                    continue
                now = time.perf_counter()
                if last is None:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
                result.output_tokens += 1
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.end = time.perf_counter()
    result.e2e = result.end - start
    # The server's count: a token whose text is held back (part of a UTF-8 character) sends no chunk.
    if usage_tokens is not None:
        result.output_tokens = usage_tokens
    result.ok = True
    return result


def arrival_offsets(count: int, rate: float, seed: int | str) -> list[float]:
    """Send times, seconds from the start, of ``count`` Poisson arrivals at ``rate`` per second;
    ``rate`` ``inf`` sends everything at once.

    Raises:
        ValueError: ``rate`` is not > 0.
    """
    if not rate > 0:
        raise ValueError(f"request rate must be > 0 (or inf), got {rate}")
    if math.isinf(rate):
        return [0.0] * count
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for _ in range(count):
        offsets.append(t)
        t += rng.expovariate(rate)
    return offsets


async def run_rate(url: str, workload: list[WorkloadRequest], rate: float, seed: int, *,
                   model: str | None = None, api_key: str | None = None) -> dict:
    """Send the workload with Poisson arrivals at ``rate`` requests/s and summarize it.

    Returns a dict: ``rate``, ``completed``/``requests``, ``output_tokens`` (the servers'
    ``usage``) vs ``expected_tokens``, ``tok_s`` (output tokens / seconds from the first send to
    the last token), ``duration`` (those seconds), ``ttft_p50``/``ttft_p99``,
    ``itl_p50``/``itl_p99``, ``e2e_p50`` (seconds; NaN when nothing completed) and up to three
    distinct ``errors``.
    """
    offsets = arrival_offsets(len(workload), rate, f"{seed}-{rate}")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, headers=headers,
                                     timeout=aiohttp.ClientTimeout(total=3600)) as session:
        begin = time.perf_counter()

        async def scheduled(offset: float, req: WorkloadRequest) -> RequestResult:
            await asyncio.sleep(max(0.0, begin + offset - time.perf_counter()))
            return await one_request(session, url, req, model)

        results = await asyncio.gather(*(scheduled(o, r) for o, r in zip(offsets, workload)))
    done = [r for r in results if r.ok]
    span = max(r.end for r in done) - begin if done else float("nan")
    ttfts = [r.ttft for r in done if r.ttft is not None]
    itls = [g for r in done for g in r.itl]
    produced = sum(r.output_tokens for r in done)
    return {
        "rate": rate, "completed": len(done), "requests": len(workload), "output_tokens": produced,
        "expected_tokens": sum(r.max_tokens for r in workload), "duration": span,
        "tok_s": produced / span if done else 0.0,
        "ttft_p50": pct(ttfts, 50), "ttft_p99": pct(ttfts, 99), "itl_p50": pct(itls, 50), "itl_p99": pct(itls, 99),
        "e2e_p50": pct([r.e2e for r in done], 50),
        "errors": sorted({r.error for r in results if not r.ok})[:3],
    }


def pct(values: list[float], q: float) -> float:
    """The ``q``-th percentile (nearest rank) of ``values``; NaN for none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(q / 100 * (len(ordered) - 1)))))]
