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
- ``backlogged``: both tenants with at least as many streams as the pods' slots, A ten times
  B's: Jain's index of the tokens each was served;
- ``weights 3:1``: both backlogged with ``--tenant-weights A=3,B=1``: the ratio of tokens served;
- ``sheddable``: the flood, with A's requests marked ``x-slipstream-criticality: sheddable`` and
  B's ``critical``: A's are refused (429) while the pods are full, B's never.

Tokens served count each request's prompt at its first token and each streamed output token,
inside the window. A plot (``--plot``, matplotlib) shows B's TTFT per request and the tokens each
tenant was served over time.

Times are in modelled seconds (wall ÷ S). Usage: ``python benchmarks/fairness.py
[--time-scale 4] [--duration 20]``. Loopback addresses only; not part of ``make test``.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
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
    tokens: int = 0  # prompt tokens (at the first token) and output tokens streamed inside the window
    rejected: int = 0
    firsts: list[tuple[float, float]] = field(default_factory=list)  # (sent, TTFT), modelled s from the start
    served: list[tuple[float, int]] = field(default_factory=list)  # (when, tokens), modelled s from the start

    def p(self, q: float) -> float | None:
        if not self.ttfts:
            return None
        values = sorted(self.ttfts)
        return values[min(len(values) - 1, int(q * len(values)))]


async def client(session: aiohttp.ClientSession, tenant: str, criticality: str | None, until: float,
                 args: argparse.Namespace, tally: Tally, rng: random.Random) -> None:
    began = until - args.duration * args.time_scale
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
            async for line in r.content:  # one SSE event per line; each completion chunk, one token
                if not line.startswith(b"data: {"):
                    continue
                now = time.monotonic()
                if now > until:
                    break
                tokens = 1
                if first is None:
                    first = now
                    tally.ttfts.append((first - start) / args.time_scale)
                    tally.firsts.append(((start - began) / args.time_scale, tally.ttfts[-1]))
                    tokens += args.prompt_tokens
                tally.tokens += tokens
                tally.served.append(((now - began) / args.time_scale, tokens))


async def scenario(args: argparse.Namespace, name: str, streams: dict[str, int], policy: str,
                   weights: str | None = None, criticality: dict[str, str] | None = None) -> dict:
    extra = ["--scheduling-policy", policy] + (["--tenant-weights", weights] if weights else [])
    procs = [spawn([sys.executable, "-m", "slipstream.server", "serve", "--model",
                    f"sim:{args.profile},time_scale={args.time_scale:g}", "--host", host, "--port", str(POD_PORT),
                    "--max-num-seqs", str(args.max_num_seqs), "--log-interval", "0", "--log-level", "WARNING",
                    *(["--max-num-batched-tokens", str(args.max_num_batched_tokens)] if args.max_num_batched_tokens else []),
                    *extra], OUT / f"fairness-pod-{host}.log") for host in POD_HOSTS]
    gateway = [sys.executable, "-m", "slipstream.server", "gateway", "--host", GATEWAY[0], "--port", str(GATEWAY[1]),
               "--log-level", "WARNING", *extra] + [a for h in POD_HOSTS for a in ("--endpoint", f"http://{h}:{POD_PORT}")]
    procs.append(spawn(gateway, OUT / "fairness-gateway.log"))
    tallies = defaultdict(Tally)
    seats: dict[str, list[dict[str, float]]] = {}
    try:
        timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
            for host in POD_HOSTS:
                await wait_ready(session, f"http://{host}:{POD_PORT}", procs)
            await wait_ready(session, f"http://{GATEWAY[0]}:{GATEWAY[1]}", procs)
            await asyncio.sleep(1.0)  # the gateway's first scrape of both pods
            until = time.monotonic() + args.duration * args.time_scale
            rng = random.Random(0)
            sampler = asyncio.create_task(sample_seats(session, until, seats))
            await asyncio.gather(*(client(session, tenant, (criticality or {}).get(tenant), until, args,
                                          tallies[tenant], random.Random(rng.random()))
                                   for tenant, n in streams.items() for _ in range(n)))
            await sampler
            pods = [await pod_counters(session, f"http://{host}:{POD_PORT}") for host in POD_HOSTS]
    finally:
        stop(procs)
    row = {"scenario": name, "policy": policy, "streams": streams}
    for tenant, t in sorted(tallies.items()):
        row[tenant] = {"requests": len(t.ttfts), "ttft_p50_s": t.p(0.5), "ttft_p90_s": t.p(0.9),
                       "tokens": t.tokens, "rejected": t.rejected}
    row["tokens_per_s"] = sum(t.tokens for t in tallies.values()) / args.duration
    row["pods"] = {k: sum(p.get(k, 0) for p in pods) for k in pods[0]}  # the engines' own totals
    row["seats"] = {host: {k: sum(s.get(k, 0) for s in samples) / max(1, len(samples))
                           for k in sorted({k for s in samples for k in s})} for host, samples in seats.items()}
    print(json.dumps(row), flush=True)
    row["tallies"] = dict(tallies)  # for the plot; not in the JSON
    return row


async def sample_seats(session: aiohttp.ClientSession, until: float, seats: dict[str, list[dict[str, float]]]) -> None:
    """Sample each pod's running and waiting requests per tenant (its gauges) until ``until``:
    how the seats were split, pod by pod (the ``seats`` of a row: time averages)."""
    while time.monotonic() < until:
        for host in POD_HOSTS:
            async with session.get(f"http://{host}:{POD_PORT}/metrics") as r:
                text = await r.text()
            sample = {}
            for line in text.splitlines():
                for name, kind in (("slipstream:tenant_requests_running", "running"),
                                   ("slipstream:tenant_requests_waiting", "waiting")):
                    if line.startswith(name + "{") and 'tenant="' in line:
                        tenant = line.split('tenant="', 1)[1].split('"', 1)[0]
                        sample[f"{kind} {tenant}"] = float(line.rsplit(" ", 1)[1])
            seats.setdefault(host, []).append(sample)
        await asyncio.sleep(0.25)


async def pod_counters(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """A pod's engine totals: preemptions, prompt tokens admitted and those found in its prefix cache."""
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    wanted = {"slipstream:num_preemptions_total": "preemptions", "slipstream:prompt_tokens_total": "prompt_tokens",
              "slipstream:prefix_cache_hits_total": "prefix_hits"}
    out = dict.fromkeys(wanted.values(), 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in wanted:
            out[wanted[name]] += float(line.rsplit(" ", 1)[1])
    return out


def jain(values: list[float]) -> float:
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values)) if any(values) else 0.0


async def main_async(args: argparse.Namespace) -> list[dict]:
    slots = args.max_num_seqs * len(POD_HOSTS)
    a, b = args.a_streams or 3 * slots, args.b_streams
    backlogged = {"A": 10 * slots, "B": slots}  # both more streams than the pods' slots, A 10× B
    runs = [("B alone", {"B": b}, "fair", {}),
            *(("flood", {"A": a, "B": b}, policy, {}) for policy in ("fair", "fcfs")),
            *(("backlogged", backlogged, policy, {}) for policy in ("fair", "fcfs")),
            ("weights 3:1", {"A": 2 * slots, "B": 2 * slots}, "fair", {"weights": "A=3,B=1"}),
            ("sheddable", {"A": a, "B": b}, "fair", {"criticality": {"A": "sheddable", "B": "critical"}})]
    rows = []
    for name, streams, policy, extra in runs:
        if name == "B alone" or not args.only or name in args.only:  # B alone: every ratio's base
            rows.append(await scenario(args, name, streams, policy, **extra))
    return rows


def next_step_floor(rows: list[dict], args: argparse.Namespace) -> tuple[float, float]:
    """(one full step, B's TTFT p90 floor), modelled seconds: an engine that admits B at the next
    step still finishes the step in progress first, and beside the flood that is a full token
    budget of A's prompts (B's closed loop sends its next request just after a step ends, so it
    waits about a whole one). B alone finds the engine idle. Holds while B's prompt fits one
    step's budget (with a smaller budget it also spans more steps beside the flood than alone)."""
    from slipstream.api_types.engine import DEFAULT_MAX_NUM_BATCHED_TOKENS
    from slipstream.server.sim.cost_model import batch_shape, get_profile, step_time

    budget = args.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS
    chunks = [(0, args.prompt_tokens)] * (budget // args.prompt_tokens) + [(0, budget % args.prompt_tokens)]
    step = step_time(get_profile(args.profile), batch_shape(c for c in chunks if c[1]))
    return step, rows[0]["B"]["ttft_p90_s"] + step


def table(rows: list[dict], args: argparse.Namespace) -> str:
    alone = rows[0]["B"]["ttft_p90_s"]
    fcfs_tput = {r["scenario"]: r["tokens_per_s"] for r in rows if r["policy"] == "fcfs"}
    lines = ["| scenario | policy | streams A/B | B TTFT p90 (s) | ÷ B alone | tokens/s | ÷ fcfs | "
             "served A:B | Jain | rejected A/B | preemptions |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        A, B = r.get("A", {}), r["B"]
        served = [A.get("tokens", 0), B["tokens"]]
        ratio = f"{served[0] / served[1]:.2f}" if served[1] and "A" in r else "—"
        base = fcfs_tput.get(r["scenario"])
        vs_fcfs = f"{r['tokens_per_s'] / base:.2f}" if base else "—"
        lines.append(f"| {r['scenario']} | {r['policy']} | {r['streams'].get('A', 0)}/{r['streams']['B']} | "
                     f"{B['ttft_p90_s']:.3f} | {B['ttft_p90_s'] / alone:.2f} | {r['tokens_per_s']:.0f} | {vs_fcfs} | "
                     f"{ratio} | {jain(served) if 'A' in r else 1:.3f} | {A.get('rejected', 0)}/{B['rejected']} | "
                     f"{r['pods']['preemptions']:.0f} |")
    return "\n".join(lines)


def plot(rows: list[dict], tallies: list[dict[str, Tally]], path: Path) -> bool:
    """B's TTFT per request (alone, beside the flood: fair and first-come) and each tenant's
    tokens served over time (backlogged, fair and first-come; weights 3:1)."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for row, tally in zip(rows, tallies):
        label = f"{row['scenario']}, {row['policy']}"
        if row["scenario"] in ("B alone", "flood") and tally.get("B") and tally["B"].firsts:
            a.plot(*zip(*tally["B"].firsts), "o" if row["policy"] == "fair" else "x", ms=3, label=label)
        if row["scenario"] in ("backlogged", "weights 3:1"):
            style = {"fair": "-", "fcfs": ":"}[row["policy"]] if row["scenario"] == "backlogged" else "--"
            for tenant, color in (("A", "C0"), ("B", "C1")):
                if tally.get(tenant) and tally[tenant].served:
                    times, tokens = zip(*sorted(tally[tenant].served))
                    total = list(itertools.accumulate(tokens))
                    b.plot(times, total, style, color=color, label=f"{tenant}: {label}")
    a.set(xlabel="request sent (s, modelled)", ylabel="B's TTFT (s, modelled)", yscale="log",
          title="tenant B's time to first token")
    b.set(xlabel="time (s, modelled)", ylabel="tokens served (prompt + output)",
          title="tokens served per tenant, both backlogged")
    a.legend(fontsize=7)
    b.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", default="tiny")
    p.add_argument("--time-scale", type=float, default=4.0, help="wall seconds per modelled second")
    p.add_argument("--duration", type=float, default=20.0, help="modelled seconds per scenario")
    p.add_argument("--max-num-seqs", type=int, default=4, help="running slots per pod")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="the pods' token budget per step (default: the engine's)")
    p.add_argument("--a-streams", type=int, default=None, help="tenant A's streams (default: 3 × the slots)")
    p.add_argument("--b-streams", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--only", action="append", choices=["flood", "backlogged", "weights 3:1", "sheddable"],
                   help="run only this scenario (repeatable) besides B alone")
    p.add_argument("--json", type=Path, default=OUT / "fairness.json")
    p.add_argument("--plot", type=Path, default=OUT / "fairness.png")
    args = p.parse_args(argv)
    OUT.mkdir(exist_ok=True)
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in cpu.splitlines() if line.startswith("Model name")), "?")
    rows = asyncio.run(main_async(args))
    tallies = [row.pop("tallies") for row in rows]
    args.json.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"\n{model}, {platform.machine()}; {sys.argv}")
    print(table(rows, args))
    step, floor = next_step_floor(rows, args)
    if (args.max_num_batched_tokens or args.prompt_tokens) >= args.prompt_tokens:
            print(f"next-step floor of B's TTFT p90 beside the flood: B alone + one {step:.3f} s step of "
              f"{args.prompt_tokens}-token prompts = {floor:.3f} s ({floor / rows[0]['B']['ttft_p90_s']:.2f}x B alone)")
    print(f"plot: {args.plot}" if plot(rows, tallies, args.plot) else "plot: matplotlib not installed, skipped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
