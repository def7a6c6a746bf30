"""Tenants sharing one service: two sim pods behind a real ``slipstream gateway``, closed-loop
clients of two tenants, the fair policy (the default, in the pods' engines and the gateway)
against first-come (``--scheduling-policy fcfs`` on both), in one run.

Two ``slipstream serve --model sim:PROFILE,time_scale=S`` processes on 127.0.0.2–.3 (the real
engine and scheduler, a cost model for the GPU) behind ``slipstream gateway`` with its default
flags (only the policy and weights set per scenario). Every client is a closed loop: it sends
a streamed ``POST /v1/completions`` of ``--prompt-tokens`` random token ids with ``max_tokens``
``--output-tokens`` (EOS ignored) and sends the next as soon as it ends, as tenant A or B
(``x-gateway-inference-fairness-id``). Scenarios, each on fresh pods and gateway:

- ``B alone``: B's ``--b-streams`` streams;
- ``flood``: A with ``--a-streams`` (≥ 3× the pods' running slots) beside B's, fair and fcfs:
  B's TTFT p90 against B alone, total throughput against first-come's;
- ``backlogged``: both tenants with more streams than slots, A offering ``--a-streams`` and B
  a tenth of it: Jain's index of the tokens each was served;
- ``weights 3:1``: both backlogged with ``--tenant-weights A=3,B=1``: the ratio of tokens served;
- ``sheddable``: the flood, with A's requests marked ``x-slipstream-criticality: sheddable``:
  A's are refused (429) while the pods are full, B's (standard) never.

Times are in modelled seconds (wall ÷ S). Usage: ``python benchmarks/fairness.py
[--time-scale 4] [--duration 20]``. Loopback addresses only; not part of ``make test``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from routing import OUT, spawn, stop, wait_ready  # the same process helpers as the routing benchmark

POD_HOSTS = ("127.0.0.2", "127.0.0.3")
POD_PORT, GATEWAY = 8110, ("127.0.0.1", 8198)
TENANT_HEADER = "x-gateway-inference-fairness-id"
CRITICALITY_HEADER = "x-slipstream-criticality"


@dataclass
class Tally:
    """One tenant's results in a scenario."""

    ttfts: list[float] = field(default_factory=list)
    tokens: int = 0  # prompt + output tokens of the requests that finished inside the window
    rejected: int = 0

    def p(self, q: float) -> float | None:
        if not self.ttfts:
            return None
        values = sorted(self.ttfts)
        return values[min(len(values) - 1, int(q * len(values)))]


async def client(session: aiohttp.ClientSession, tenant: str, criticality: str | None, until: float,
                 args: argparse.Namespace, tally: Tally, rng: random.Random) -> None:
    headers = {TENANT_HEADER: tenant, **({CRITICALITY_HEADER: criticality} if criticality else {})}
    url = f"http://{GATEWAY[0]}:{GATEWAY[1]}/v1/completions"
    while time.monotonic() < until:
        body = {"prompt": [rng.randrange(1000, 30000) for _ in range(args.prompt_tokens)],
                "max_tokens": args.output_tokens, "ignore_eos": True, "stream": True}
        start = time.monotonic()
        first = None
        async with session.post(url, json=body, headers=headers) as r:
            if r.status == 429:
                tally.rejected += 1
                await asyncio.sleep(float(r.headers.get("Retry-After", "1")) * 0.1)
                continue
            r.raise_for_status()
            async for _ in r.content.iter_any():
                if first is None:
                    first = time.monotonic()
        if first is not None and time.monotonic() <= until:
            tally.ttfts.append((first - start) / args.time_scale)
            tally.tokens += args.prompt_tokens + args.output_tokens


async def scenario(args: argparse.Namespace, name: str, streams: dict[str, int], policy: str,
                   weights: str | None = None, sheddable: str | None = None) -> dict:
    extra = ["--scheduling-policy", policy] + (["--tenant-weights", weights] if weights else [])
    procs = [spawn([sys.executable, "-m", "slipstream.server", "serve", "--model",
                    f"sim:{args.profile},time_scale={args.time_scale:g}", "--host", host, "--port", str(POD_PORT),
                    "--max-num-seqs", str(args.max_num_seqs), "--log-interval", "0", "--log-level", "WARNING",
                    *extra], OUT / f"fairness-pod-{host}.log") for host in POD_HOSTS]
    gateway = [sys.executable, "-m", "slipstream.server", "gateway", "--host", GATEWAY[0], "--port", str(GATEWAY[1]),
               "--log-level", "WARNING", *extra] + [a for h in POD_HOSTS for a in ("--endpoint", f"http://{h}:{POD_PORT}")]
    procs.append(spawn(gateway, OUT / "fairness-gateway.log"))
    tallies = defaultdict(Tally)
    try:
        timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
            for host in POD_HOSTS:
                await wait_ready(session, f"http://{host}:{POD_PORT}", procs)
            await wait_ready(session, f"http://{GATEWAY[0]}:{GATEWAY[1]}", procs)
            await asyncio.sleep(1.0)  # the gateway's first scrape of both pods
            until = time.monotonic() + args.duration * args.time_scale
            rng = random.Random(0)
            await asyncio.gather(*(client(session, tenant, sheddable if tenant == "A" else None, until, args,
                                          tallies[tenant], random.Random(rng.random()))
                                   for tenant, n in streams.items() for _ in range(n)))
    finally:
        stop(procs)
    row = {"scenario": name, "policy": policy, "streams": streams}
    for tenant, t in sorted(tallies.items()):
        row[tenant] = {"requests": len(t.ttfts), "ttft_p50_s": t.p(0.5), "ttft_p90_s": t.p(0.9),
                       "tokens": t.tokens, "rejected": t.rejected}
    row["tokens_per_s"] = sum(t.tokens for t in tallies.values()) / args.duration
    print(json.dumps(row), flush=True)
    return row


def jain(values: list[float]) -> float:
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values)) if any(values) else 0.0


async def main_async(args: argparse.Namespace) -> list[dict]:
    slots = args.max_num_seqs * len(POD_HOSTS)
    a, b = args.a_streams or 3 * slots, args.b_streams
    rows = [await scenario(args, "B alone", {"B": b}, "fair")]
    for policy in ("fair", "fcfs"):
        rows.append(await scenario(args, "flood", {"A": a, "B": b}, policy))
    for policy in ("fair", "fcfs"):
        rows.append(await scenario(args, "backlogged", {"A": a, "B": max(slots, a // 10)}, policy))
    rows.append(await scenario(args, "weights 3:1", {"A": 2 * slots, "B": 2 * slots}, "fair", weights="A=3,B=1"))
    rows.append(await scenario(args, "sheddable", {"A": a, "B": b}, "fair", sheddable="sheddable"))
    return rows


def table(rows: list[dict], args: argparse.Namespace) -> str:
    alone = rows[0]["B"]["ttft_p90_s"]
    fcfs_tput = {r["scenario"]: r["tokens_per_s"] for r in rows if r["policy"] == "fcfs"}
    lines = ["| scenario | policy | streams A/B | B TTFT p90 (s) | ÷ B alone | tokens/s | ÷ fcfs | "
             "served A:B | Jain | rejected A/B |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        A, B = r.get("A", {}), r["B"]
        served = [A.get("tokens", 0), B["tokens"]]
        ratio = f"{served[0] / served[1]:.2f}" if served[1] else "—"
        base = fcfs_tput.get(r["scenario"])
        lines.append(f"| {r['scenario']} | {r['policy']} | {r['streams'].get('A', 0)}/{r['streams']['B']} | "
                     f"{B['ttft_p90_s']:.3f} | {B['ttft_p90_s'] / alone:.2f} | {r['tokens_per_s']:.0f} | "
                     f"{r['tokens_per_s'] / base:.2f} | {ratio} | {jain(served) if 'A' in r else 1:.3f} | "
                     f"{A.get('rejected', 0)}/{B['rejected']} |" if base else
                     f"| {r['scenario']} | {r['policy']} | {r['streams'].get('A', 0)}/{r['streams']['B']} | "
                     f"{B['ttft_p90_s']:.3f} | {B['ttft_p90_s'] / alone:.2f} | {r['tokens_per_s']:.0f} | — | "
                     f"{ratio} | {jain(served) if 'A' in r else 1:.3f} | {A.get('rejected', 0)}/{B['rejected']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", default="tiny")
    p.add_argument("--time-scale", type=float, default=4.0, help="wall seconds per modelled second")
    p.add_argument("--duration", type=float, default=20.0, help="modelled seconds per scenario")
    p.add_argument("--max-num-seqs", type=int, default=4, help="running slots per pod")
    p.add_argument("--a-streams", type=int, default=None, help="tenant A's streams (default: 3 × the slots)")
    p.add_argument("--b-streams", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--json", type=Path, default=OUT / "fairness.json")
    args = p.parse_args(argv)
    OUT.mkdir(exist_ok=True)
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in cpu.splitlines() if line.startswith("Model name")), "?")
    rows = asyncio.run(main_async(args))
    args.json.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"\n{model}, {platform.machine()}; {sys.argv}")
    print(table(rows, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
