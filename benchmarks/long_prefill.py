"""Short chats behind long prompts: ``slipstream serve`` without and with
``--long-prefill-token-threshold``, in one run, each on a fresh process.

One server at a time on 127.0.0.1 (the built-in model on CPU unless ``--model`` says otherwise,
``--max-num-batched-tokens`` 512, the default). Per threshold: a short chat alone (its TTFT is
the floor), then ``--long-prompts`` completions of ``--long-tokens`` random token ids each
(``max_tokens`` 1, sent together; the second one waits while the first is prefilled), sent while
``--decoders`` streams are decoding (completions that ignore EOS, started ``--gap`` s before),
and while their prefill runs, ``--shorts`` streamed chats, one every ``--gap`` seconds from ``--gap`` after it
was sent. Reported per threshold: the chats' TTFT (p50 and max, and ÷ the chat alone), the
decoding streams' inter-token latency before the long prompts and while they run, the last long
prompt's TTFT (÷ the same round's run without a threshold), the wall time until the last answer ended, and
every chat's tokens against the run without a threshold (greedy: the cap moves where chunks are
cut, never what is computed).

Usage: ``python benchmarks/long_prefill.py [--thresholds 0,256,128] [--rounds 2]``; results
in benchmarks/out/long_prefill.json. Loopback only; not part of ``make test``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import aiohttp

from routing import OUT, spawn, stop, wait_ready  # the same process helpers as the routing benchmark

HOST, PORT = "127.0.0.1", 8131
MODEL = "builtin"  # replaced by the name /v1/models gives
QUESTIONS = ["What is the capital of France?", "Name three primary colours.", "What is 7 times 8?",
             "Say hello in Spanish.", "What is the boiling point of water?", "Name a planet.",
             "What colour is the sky?", "Spell 'cat' backwards."]


async def chat(session: aiohttp.ClientSession, url: str, question: str, max_tokens: int) -> dict:
    """One streamed greedy chat: its TTFT (s) and text."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": question}], "temperature": 0,
            "max_tokens": max_tokens, "stream": True}
    start, first, text = time.monotonic(), None, []
    async with session.post(url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"].get("content")
            if delta:
                first = first or time.monotonic()
                text.append(delta)
    return {"ttft_s": first - start, "text": "".join(text), "ended": time.monotonic()}


async def decoder(session: aiohttp.ClientSession, url: str, seed: int, times: list[float],
                  started: asyncio.Event) -> None:
    """A stream already decoding when the long prompt arrives: a completion that ignores EOS,
    appending each token's arrival time to ``times`` until it is cancelled."""
    body = {"model": MODEL, "prompt": f"Story {seed}: once upon a time", "max_tokens": 4000, "ignore_eos": True,
            "temperature": 0, "stream": True}
    async with session.post(url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.content:
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                times.append(time.monotonic())
                started.set()


def gaps_within(times: list[float], start: float, end: float) -> list[float]:
    """Inter-token gaps (s) of one stream whose later token arrived within [start, end]."""
    return [b - a for a, b in zip(times, times[1:]) if start <= b <= end]


async def long_prompt(session: aiohttp.ClientSession, url: str, tokens: list[int]) -> dict:
    body = {"model": MODEL, "prompt": tokens, "max_tokens": 1, "temperature": 0}
    start = time.monotonic()
    async with session.post(url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=3600)) as r:
        r.raise_for_status()
        await r.json()
    return {"ttft_s": time.monotonic() - start, "ended": time.monotonic()}


async def scenario(args: argparse.Namespace, threshold: int, prompts: list[list[int]]) -> dict:
    cmd = [sys.executable, "-m", "slipstream.server", "serve", "--model", args.model, "--host", HOST,
           "--port", str(PORT), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
           "--long-prefill-token-threshold", str(threshold), "--log-interval", "0"]
    proc = spawn(cmd, OUT / f"long_prefill-{threshold}.log")
    url = f"http://{HOST}:{PORT}"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
            await wait_ready(session, url, [proc])
            global MODEL
            async with session.get(url + "/v1/models") as r:
                MODEL = (await r.json())["data"][0]["id"]
            await chat(session, url, QUESTIONS[0], args.max_tokens)  # warm-up
            alone = [(await chat(session, url, q, args.max_tokens))["ttft_s"] for q in QUESTIONS[:3]]
            streams = [[] for _ in range(args.decoders)]
            events = [asyncio.Event() for _ in streams]
            decoders = [asyncio.create_task(decoder(session, url, i, t, e))
                        for i, (t, e) in enumerate(zip(streams, events))]
            await asyncio.gather(*(e.wait() for e in events))
            await asyncio.sleep(args.gap)  # their steady ITL, alone
            began = time.monotonic()
            long_task = asyncio.gather(*(long_prompt(session, url, tokens) for tokens in prompts))
            chats = []
            for i in range(args.shorts):
                await asyncio.sleep(args.gap)
                chats.append(asyncio.create_task(chat(session, url, QUESTIONS[i % len(QUESTIONS)], args.max_tokens)))
            long = max(await long_task, key=lambda r: r["ended"])  # the last to be answered
            done = await asyncio.gather(*chats)
            for task in decoders:
                task.cancel()
            await asyncio.gather(*decoders, return_exceptions=True)
    finally:
        stop([proc])
    ttfts = [c["ttft_s"] for c in done]
    before = [g for t in streams for g in gaps_within(t, 0, began)]
    during = sorted(g for t in streams for g in gaps_within(t, began, long["ended"]))
    return {"threshold": threshold, "alone_ttft_s": statistics.median(alone),
            "chat_ttft_s": ttfts, "chat_ttft_p50_s": statistics.median(ttfts), "chat_ttft_max_s": max(ttfts),
            "itl_alone_p50_s": statistics.median(before) if before else None,
            "itl_during_p50_s": statistics.median(during) if during else None,
            "itl_during_max_s": during[-1] if during else None,
            "long_ttft_s": long["ttft_s"], "wall_s": max([long["ended"]] + [c["ended"] for c in done]) - began,
            "texts": [c["text"] for c in done]}


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def table(results: list[dict], per_round: int) -> str:
    lines = ["| round | threshold | chat alone TTFT (s) | chats' TTFT p50 (s) | max (s) | p50 ÷ alone | long prompt's TTFT (s) "
             "| ÷ no threshold | streams' ITL alone p50 (ms) | beside it p50 (ms) | max (ms) "
             "| wall until the last answer (s) | chats' text = no threshold's |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(results):
        base = results[i - i % per_round]
        lines.append(f"| {i // per_round + 1} | {r['threshold'] or 'none'} | {r['alone_ttft_s']:.3f} | {r['chat_ttft_p50_s']:.2f} "
                     f"| {r['chat_ttft_max_s']:.2f} | {r['chat_ttft_p50_s'] / r['alone_ttft_s']:.1f}× "
                     f"| {r['long_ttft_s']:.2f} | {r['long_ttft_s'] / base['long_ttft_s']:.2f} "
                     f"| {ms(r['itl_alone_p50_s'])} | {ms(r['itl_during_p50_s'])} | {ms(r['itl_during_max_s'])} "
                     f"| {r['wall_s']:.2f} "
                     f"| {'yes' if r['texts'] == base['texts'] else 'NO'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin")
    p.add_argument("--thresholds", default="0,256,128", help="comma-separated; the first is the baseline")
    p.add_argument("--rounds", type=int, default=2, help="times the thresholds are run in turn (noise on a shared CPU)")
    p.add_argument("--long-tokens", type=int, default=8000, help="tokens of each long prompt")
    p.add_argument("--long-prompts", type=int, default=1, help="long prompts sent together")
    p.add_argument("--shorts", type=int, default=6, help="chats sent while it is prefilled")
    p.add_argument("--gap", type=float, default=2.0, help="seconds between them (the first this long after it)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens of each chat's answer")
    p.add_argument("--decoders", type=int, default=2,
                   help="streams already decoding when the long prompt arrives (their inter-token latency)")
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(1000, 40000) for _ in range(args.long_tokens)] for _ in range(args.long_prompts)]
    thresholds = [int(t) for t in args.thresholds.split(",")]
    results = [asyncio.run(scenario(args, t, prompts)) for _ in range(args.rounds) for t in thresholds]
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    (OUT / "long_prefill.json").write_text(json.dumps({"cpu": cpu, "args": vars(args), "results": results}, indent=1))
    print(f"{cpu}, {args.long_prompts} × {args.long_tokens}-token prompt, {args.shorts} chats every {args.gap} s, "
          f"budget {args.max_num_batched_tokens}")
    print(table(results, len(thresholds)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
