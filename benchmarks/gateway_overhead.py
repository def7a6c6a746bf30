"""What the gateway costs: latency it adds, and 2,000 concurrent streams through it.

The backend is a tiny aiohttp server (started by this script as its own process on 127.0.0.2)
that answers ``POST /v1/completions`` with a canned completion (JSON, or an event stream of
``--chunks`` chunks ``--chunk-interval`` seconds apart when ``stream`` is set) and serves
``/ready`` and the ``/metrics`` gauges the gateway scrapes (``num_requests_waiting/running``,
``kv_cache_usage_perc``, ``engine_config_info`` with ``max_num_seqs`` 100000 so the gateway never
holds requests back). No engine: what is measured is HTTP and the gateway.

1. Added latency: the same seeded Poisson load (``--rate`` req/s, non-streaming, a token-id prompt
   of ``--prompt-tokens`` tokens) sent straight to the backend and through ``slipstream gateway``
   with each ``--policies`` (round-robin routes blind; prefix also hashes the prompt's blocks),
   one after the other in one run; end-to-end latency p50/p99 per path and the difference.
2. Concurrency: ``--streams`` streaming requests opened at once through the gateway
   (round-robin), each held open ~``chunks × chunk_interval`` seconds by the backend; errors
   counted; the gateway process's peak RSS (``VmHWM``) and its RSS before and after.

The client is one aiohttp process. Loopback addresses only; not part of ``make test``.

Usage: ``python benchmarks/gateway_overhead.py [--rate 200] [--duration 20] [--streams 2000]``
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from slipstream.api_types.metrics import GATEWAY_ENDPOINT_IN_FLIGHT

HERE = Path(__file__).resolve().parent
OUT = HERE / "out"
BACKEND = ("127.0.0.2", 8301)
GATEWAY = ("127.0.0.1", 8302)

BACKEND_CODE = r'''
import asyncio, json, sys
from aiohttp import web
from slipstream.api_types import metrics as m
chunks, interval = int(sys.argv[3]), float(sys.argv[4])
state = {"running": 0}
BODY = json.dumps({"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "canned",
    "choices": [{"index": 0, "text": " hello world", "finish_reason": "length", "logprobs": None}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}}).encode()
async def complete(request):
    body = await request.json()
    if not body.get("stream"):
        return web.Response(body=BODY, content_type="application/json")
    state["running"] += 1
    try:
        r = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await r.prepare(request)
        for i in range(chunks):
            await asyncio.sleep(interval)
            event = {"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "text": f" w{i}"}]}
            await r.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        await r.write(b"data: [DONE]\n\n")
        await r.write_eof()
        return r
    finally:
        state["running"] -= 1
async def ready(request):
    return web.json_response({"status": "ready"})
async def metrics(request):
    text = (f"{m.NUM_REQUESTS_WAITING} 0\n{m.NUM_REQUESTS_RUNNING} {state['running']}\n"
            f"{m.KV_CACHE_USAGE_PERC} 0.0\n"
            f'{m.ENGINE_CONFIG_INFO}{{block_size="16",max_num_seqs="100000"}} 1\n')
    return web.Response(text=text, content_type="text/plain")
app = web.Application()
app.router.add_post("/v1/completions", complete)
app.router.add_get("/ready", ready)
app.router.add_get("/health", ready)
app.router.add_get("/metrics", metrics)
web.run_app(app, host=sys.argv[1], port=int(sys.argv[2]), access_log=None, print=None, backlog=4096)
'''


def raise_nofile() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def spawn(cmd: list[str], log: Path) -> subprocess.Popen:
    with open(log, "w") as f:
        return subprocess.Popen(cmd, cwd=OUT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=raise_nofile)


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def rss_kib(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0])
    return fields


async def wait_ready(session: aiohttp.ClientSession, url: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            async with session.get(url + "/ready") as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} not ready after {timeout:.0f}s")


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))] if values else math.nan


async def latency_run(session: aiohttp.ClientSession, url: str, rate: float, duration: float, prompt: list[int],
                      seed: int) -> tuple[list[float], int, float]:
    """Poisson arrivals at ``rate`` for ``duration`` s; returns (latencies, failures, achieved rate)."""
    rng = random.Random(seed)
    latencies: list[float] = []
    failures = 0
    body = json.dumps({"prompt": prompt, "max_tokens": 2, "stream": False}).encode()
    headers = {"Content-Type": "application/json"}

    async def one() -> None:
        nonlocal failures
        start = time.perf_counter()
        try:
            async with session.post(url + "/v1/completions", data=body, headers=headers) as r:
                await r.read()
                if r.status != 200:
                    failures += 1
                    return
        except aiohttp.ClientError:
            failures += 1
            return
        latencies.append(time.perf_counter() - start)

    tasks, t0, t = [], time.perf_counter(), 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            break
        delay = t0 + t - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one()))
    sent_in = time.perf_counter() - t0
    await asyncio.gather(*tasks)
    return latencies, failures, len(tasks) / sent_in


async def stream_run(url: str, streams: int, chunks: int) -> tuple[int, list[str], float]:
    """``streams`` streaming requests at once; returns (completed, errors, seconds)."""
    errors: list[str] = []
    done = 0
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=300)) as session:
        async def one() -> None:
            nonlocal done
            body = {"prompt": [1000 + i for i in range(64)], "max_tokens": chunks, "stream": True}
            try:
                async with session.post(url + "/v1/completions", json=body) as r:
                    if r.status != 200:
                        errors.append(f"HTTP {r.status}: {(await r.text())[:200]}")
                        return
                    got = 0
                    async for raw in r.content:
                        line = raw.strip()
                        if line.startswith(b"data: {"):
                            if b'"error"' in line:
                                errors.append(line.decode()[:200])
                                return
                            got += 1
                    if got != chunks:
                        errors.append(f"{got} of {chunks} chunks")
                        return
                    done += 1
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                errors.append(f"{type(exc).__name__}: {exc}"[:200])

        start = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(streams)))
        return done, errors, time.perf_counter() - start


async def main_async(args: argparse.Namespace) -> int:
    raise_nofile()
    OUT.mkdir(exist_ok=True)
    backend = spawn([sys.executable, "-c", BACKEND_CODE, BACKEND[0], str(BACKEND[1]), str(args.chunks),
                     str(args.chunk_interval)], OUT / "overhead-backend.log")
    procs = [backend]
    backend_url = f"http://{BACKEND[0]}:{BACKEND[1]}"
    gateway_url = f"http://{GATEWAY[0]}:{GATEWAY[1]}"
    prompt = [1000 + (i * 7919) % 20000 for i in range(args.prompt_tokens)]
    rows = []
    try:
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:
            await wait_ready(session, backend_url)
            # warm the backend's and the client's code paths and connections
            await latency_run(session, backend_url, args.rate, 2.0, prompt, seed=99)
            lat, failed, achieved = await latency_run(session, backend_url, args.rate, args.duration, prompt, args.seed)
            rows.append(("direct", lat, failed, achieved))
            for policy in args.policies.split(","):
                gw = spawn([sys.executable, "-m", "slipstream.server", "gateway", "--routing", policy,
                            "--endpoint", backend_url, "--host", GATEWAY[0], "--port", str(GATEWAY[1]),
                            "--log-level", "WARNING"], OUT / f"overhead-gateway-{policy}.log")
                try:
                    await wait_ready(session, gateway_url)
                    await asyncio.sleep(1.0)
                    await latency_run(session, gateway_url, args.rate, 2.0, prompt, seed=99)
                    lat, failed, achieved = await latency_run(session, gateway_url, args.rate, args.duration, prompt,
                                                              args.seed)
                    rows.append((f"gateway ({policy})", lat, failed, achieved))
                finally:
                    stop([gw])
        print(f"\n{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, load avg {os.getloadavg()[0]:.1f}; "
              f"{args.rate:g} req/s Poisson for {args.duration:g}s per path, non-streaming, "
              f"{args.prompt_tokens}-token token-id prompt:")
        print("| path | requests | failed | achieved req/s | p50 (ms) | p99 (ms) | added p50 (ms) | added p99 (ms) |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        base = rows[0][1]
        for name, lat, failed, achieved in rows:
            print(f"| {name} | {len(lat) + failed} | {failed} | {achieved:.0f} | {pct(lat, .5) * 1e3:.2f} | "
                  f"{pct(lat, .99) * 1e3:.2f} | {(pct(lat, .5) - pct(base, .5)) * 1e3:.2f} | "
                  f"{(pct(lat, .99) - pct(base, .99)) * 1e3:.2f} |", flush=True)

        gw = spawn([sys.executable, "-m", "slipstream.server", "gateway", "--routing", "round-robin",
                    "--endpoint", backend_url, "--host", GATEWAY[0], "--port", str(GATEWAY[1]),
                    "--log-level", "WARNING"], OUT / "overhead-gateway-streams.log")
        procs.append(gw)
        async with aiohttp.ClientSession() as session:
            await wait_ready(session, gateway_url)
        await asyncio.sleep(1.0)
        idle = rss_kib(gw.pid)
        peak_in_flight = 0

        async def watch() -> None:
            nonlocal peak_in_flight
            async with aiohttp.ClientSession() as s:
                while True:
                    try:
                        async with s.get(gateway_url + "/metrics") as r:
                            for line in (await r.text()).splitlines():
                                if line.startswith(GATEWAY_ENDPOINT_IN_FLIGHT):
                                    peak_in_flight = max(peak_in_flight, int(float(line.split()[-1])))
                    except aiohttp.ClientError:
                        pass
                    await asyncio.sleep(0.5)

        watcher = asyncio.create_task(watch())
        done, errors, seconds = await stream_run(gateway_url, args.streams, args.chunks)
        watcher.cancel()
        after = rss_kib(gw.pid)
        await asyncio.sleep(3.0)
        settled = rss_kib(gw.pid)
        print(f"\n{args.streams} concurrent streams through the gateway (round-robin), {args.chunks} chunks each "
              f"{args.chunk_interval:g}s apart:")
        print("| streams | completed | errors | seconds | peak in flight (gateway metric) | gateway RSS idle (MiB) | "
              "peak RSS VmHWM (MiB) | RSS after (MiB) | RSS 3 s later (MiB) |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        print(f"| {args.streams} | {done} | {len(errors)} | {seconds:.1f} | {peak_in_flight} | {idle['VmRSS'] / 1024:.0f} | "
              f"{after['VmHWM'] / 1024:.0f} | {after['VmRSS'] / 1024:.0f} | {settled['VmRSS'] / 1024:.0f} |")
        for e in sorted(set(errors))[:10]:
            print(f"  error ({errors.count(e)}×): {e}")
    finally:
        stop(procs)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=float, default=200.0)
    p.add_argument("--duration", type=float, default=20.0, help="seconds per path")
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--policies", default="round-robin,prefix")
    p.add_argument("--streams", type=int, default=2000)
    p.add_argument("--chunks", type=int, default=20)
    p.add_argument("--chunk-interval", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(f"python benchmarks/gateway_overhead.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
