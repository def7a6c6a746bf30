"""Routing policies side by side: four sim pods behind a real ``slipstream gateway``, one run.

Four ``slipstream serve --model sim:PROFILE,time_scale=S`` processes on 127.0.0.2–.5 (the real
engine, scheduler and prefix cache, a cost model for the GPU; prefix caching on, so a step pays
only for uncached prefill), each with a KV cache of a third of the prefix working set (all four
hold all of it), behind one ``slipstream gateway --routing POLICY`` per policy. Pods and gateway
start fresh for every policy, so each starts from cold caches.

Workload: ``slipstream.server.sim.workloads.prefix_groups`` (32 groups sharing a 4k-token system
prompt, 64-token user turns, 4-turn sessions, 32 output tokens), sent as streaming token-id
``POST /v1/completions`` with ``user`` = the session key, Poisson session starts. Every policy
gets the same arrivals: first a warm-up (one request per group, not measured), then rate points
in increasing order, each a fresh set of sessions over the same system prompts (the caches stay
warm from point to point, as in a service that keeps running). A policy's sweep stops at the
first point whose p90 TTFT misses the threshold; its goodput is the highest rate before it.

Time: the pods sleep ``S`` wall seconds per modelled second, so the CPU keeps up with their
bookkeeping on a small machine; every time and rate here is in modelled seconds (wall ÷ S,
rates × S), the units ``slipstream simulate`` reports, which this script also runs on the same
arrivals (in process, virtual time) for comparison. Capacity: round-robin's saturation
throughput in the simulator (requests finished per modelled second while overloaded); the rate
points are multiples of it.

Usage: ``python benchmarks/routing.py [--policies all] [--loads 0.8,1,1.25,1.6,2,2.5]
[--time-scale 8] [--duration 6] [--threshold 0.5] [--no-real]``. Loopback addresses only;
not part of ``make test``.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import aiohttp

from slipstream.api_types import metrics as names
from slipstream.api_types.routing import POLICIES
from slipstream.api_types.autoscaling import AutoscalingSpec
from slipstream.server.sim.cluster import Cluster, ReplicaConfig
from slipstream.server.sim.cost_model import get_profile
from slipstream.server.sim.trace import Arrival, Phase
from slipstream.server.sim.workloads import PrefixGroups, Turn

HERE = Path(__file__).resolve().parent
OUT = HERE / "out"  # cwd of the subprocesses
POD_HOSTS = ("127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5")
POD_PORT, GATEWAY = 8100, ("127.0.0.1", 8199)
WARMUP_SESSION = 10**6  # session numbers of the warm-up requests (never reused by a point)
POINT_SESSIONS = 10**5  # each rate point's sessions start at k × this


# --- the workload -------------------------------------------------------------------------------

@dataclass
class Point:
    """One rate point: its arrivals (modelled seconds from the point's start)."""

    load: float   # × capacity
    rate: float   # requests per modelled second
    arrivals: list[Arrival]


def make_points(workload: PrefixGroups, capacity: float, loads: list[float], duration: float,
                seed: int) -> tuple[list[Arrival], list[Point]]:
    """The warm-up (one request per group, 0.1 s apart) and one Point per load; point k's
    sessions are numbered from (k+1) × POINT_SESSIONS so no two points share a session."""
    warmup = [Arrival(0.1 * g, workload.prompt_tokens(0), workload.output_tokens,
                      Turn(workload, seed, g, WARMUP_SESSION + g, 0)) for g in range(workload.groups)]
    points = []
    for k, load in enumerate(loads):
        rate = load * capacity
        arrivals = workload.arrivals([Phase(rate, duration)], seed=seed * 1000 + k)
        offset = (k + 1) * POINT_SESSIONS
        arrivals = [replace(a, content=replace(a.content, session=a.content.session + offset)) for a in arrivals]
        points.append(Point(load, rate, arrivals))
    return warmup, points


# --- stats --------------------------------------------------------------------------------------

def pct(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (None for no values)."""
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]


@dataclass
class PointResult:
    policy: str
    load: float
    rate: float
    sent: int = 0
    failed: int = 0
    ttft: list[float] = field(default_factory=list)   # modelled seconds
    itl: list[float] = field(default_factory=list)    # modelled seconds
    output_tokens: int = 0
    span: float = 0.0            # modelled seconds from the first send to the last token
    pod_hits: float = 0.0        # prompt tokens found in the pods' prefix caches
    pod_queries: float = 0.0
    gw_matched: float = 0.0      # prompt blocks the gateway's index said the chosen pod held
    gw_requested: float = 0.0
    errors: list[str] = field(default_factory=list)

    def p(self, q: float) -> float | None:
        return pct(self.ttft, q)

    @property
    def hit_ratio(self) -> float | None:
        return self.pod_hits / self.pod_queries if self.pod_queries else None

    @property
    def gw_ratio(self) -> float | None:
        return self.gw_matched / self.gw_requested if self.gw_requested else None


# --- processes ----------------------------------------------------------------------------------

def spawn(cmd: list[str], log: Path) -> subprocess.Popen:
    with open(log, "w") as f:
        return subprocess.Popen(cmd, cwd=OUT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


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


async def wait_ready(session: aiohttp.ClientSession, url: str, procs: list[subprocess.Popen],
                     timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"a process exited while waiting for {url}; see {OUT}/routing-*.log")
        try:
            async with session.get(url + "/ready") as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.25)
    raise RuntimeError(f"{url} not ready after {timeout:.0f}s")


def pod_command(args: argparse.Namespace, host: str) -> list[str]:
    return [sys.executable, "-m", "slipstream.server", "serve",
            "--model", f"sim:{args.profile},time_scale={args.time_scale:g}", "--host", host, "--port", str(POD_PORT),
            "--kv-cache-memory-bytes", str(args.kv_bytes), "--max-num-seqs", str(args.max_num_seqs),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--max-waiting", "100000",
            "--log-interval", "0", "--log-level", "WARNING"]


def gateway_command(policy: str) -> list[str]:
    cmd = [sys.executable, "-m", "slipstream.server", "gateway", "--routing", policy,
           "--host", GATEWAY[0], "--port", str(GATEWAY[1]), "--log-level", "WARNING"]
    for host in POD_HOSTS:
        cmd += ["--endpoint", f"http://{host}:{POD_PORT}"]
    return cmd


_SAMPLE = re.compile(r"^([a-zA-Z_:]+)(?:\{[^}]*\})?\s+([-+0-9.eE]+|NaN)$")


async def counters(session: aiohttp.ClientSession, url: str, names: tuple[str, ...]) -> dict[str, float]:
    """Sums of the named samples (over label sets) in ``url``'s /metrics."""
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    totals = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and m.group(1) in totals:
            totals[m.group(1)] += float(m.group(2))
    return totals


POD_COUNTERS = (names.PREFIX_CACHE_HITS + "_total", names.PREFIX_CACHE_QUERIES + "_total")
GW_COUNTERS = (names.GATEWAY_PREFIX_BLOCKS_MATCHED + "_total", names.GATEWAY_PREFIX_BLOCKS_REQUESTED + "_total")


async def snapshot(session: aiohttp.ClientSession) -> dict[str, float]:
    total = dict.fromkeys(POD_COUNTERS + GW_COUNTERS, 0.0)
    for host in POD_HOSTS:
        for k, v in (await counters(session, f"http://{host}:{POD_PORT}", POD_COUNTERS)).items():
            total[k] += v
    total.update(await counters(session, f"http://{GATEWAY[0]}:{GATEWAY[1]}", GW_COUNTERS))
    return total


# --- the client ---------------------------------------------------------------------------------

async def one(session: aiohttp.ClientSession, url: str, arrival: Arrival, scale: float, result: PointResult,
              ends: list[float]) -> None:
    body = {"prompt": arrival.content.prompt_ids(), "max_tokens": arrival.output_tokens, "ignore_eos": True,
            "temperature": 0, "stream": True, "user": arrival.content.session_key}
    start = time.perf_counter()
    first = last = None
    tokens = 0
    try:
        async with session.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:200]}")
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                payload = json.loads(line[6:])
                if "error" in payload:
                    raise RuntimeError(f"in-band error: {payload['error']}")
                if not (payload.get("choices") or [{}])[0].get("text"):
                    continue
                now = time.perf_counter()
                if first is None:
                    first = now
                else:
                    result.itl.append((now - last) / scale)
                last = now
                tokens += 1
    except Exception as exc:  # noqa: BLE001 — every failure counts as a failed request
        result.failed += 1
        result.errors.append(f"{type(exc).__name__}: {exc}"[:200])
        return
    if first is None:
        result.failed += 1
        result.errors.append("no token")
        return
    result.ttft.append((first - start) / scale)
    result.output_tokens += tokens
    ends.append(last)


async def play(session: aiohttp.ClientSession, arrivals: list[Arrival], scale: float,
               result: PointResult) -> None:
    """Send ``arrivals`` at their times (× scale wall seconds) and wait for all to finish."""
    url = f"http://{GATEWAY[0]}:{GATEWAY[1]}"
    ends: list[float] = []
    tasks = []
    t0 = time.perf_counter()
    for a in arrivals:
        delay = t0 + a.time * scale - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(session, url, a, scale, result, ends)))
    await asyncio.gather(*tasks)
    result.sent = len(arrivals)
    result.span = ((max(ends) - t0) / scale) if ends else 0.0


async def run_policy(args: argparse.Namespace, policy: str, warmup: list[Arrival], points: list[Point]
                     ) -> list[PointResult]:
    procs = [spawn(pod_command(args, h), OUT / f"routing-pod-{h}.log") for h in POD_HOSTS]
    results: list[PointResult] = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        try:
            t = time.monotonic()
            for h in POD_HOSTS:
                await wait_ready(session, f"http://{h}:{POD_PORT}", procs)
            gw = spawn(gateway_command(policy), OUT / f"routing-gateway-{policy}.log")
            procs.append(gw)
            await wait_ready(session, f"http://{GATEWAY[0]}:{GATEWAY[1]}", procs)
            await asyncio.sleep(1.0)  # a scrape of every pod and (kv-events) every event stream's snapshot
            print(f"[{policy}] pods and gateway up in {time.monotonic() - t:.0f}s", flush=True)
            await play(session, warmup, args.time_scale, PointResult(policy, 0, 0))
            for point in points:
                before = await snapshot(session)
                r = PointResult(policy, point.load, point.rate)
                await play(session, point.arrivals, args.time_scale, r)
                after = await snapshot(session)
                d = {k: after[k] - before[k] for k in after}
                r.pod_hits, r.pod_queries = d[POD_COUNTERS[0]], d[POD_COUNTERS[1]]
                r.gw_matched, r.gw_requested = d[GW_COUNTERS[0]], d[GW_COUNTERS[1]]
                results.append(r)
                print(f"[{policy}] {row(r)}", flush=True)
                if r.failed or (r.p(0.9) or math.inf) > args.threshold:
                    break
        finally:
            stop(procs)
    overruns = sum("longer than modelled" in (OUT / f"routing-pod-{h}.log").read_text() for h in POD_HOSTS)
    if overruns:
        print(f"[{policy}] warning: {overruns} pod(s) logged steps slower than modelled (CPU-bound)", flush=True)
    return results


# --- the simulator on the same arrivals -----------------------------------------------------------

def sim_config(args: argparse.Namespace) -> tuple:
    profile = get_profile(args.profile)
    config = ReplicaConfig.for_profile(profile, max_num_seqs=args.max_num_seqs,
                                       max_num_batched_tokens=args.max_num_batched_tokens,
                                       kv_cache_bytes=args.kv_bytes)
    return profile, config


def sim_cluster(args: argparse.Namespace, policy: str) -> Cluster:
    profile, config = sim_config(args)
    return Cluster(profile, config, AutoscalingSpec(enabled=False), initial=len(POD_HOSTS), routing=policy,
                   tick=0.5)


def sim_capacity(args: argparse.Namespace, workload: PrefixGroups) -> float:
    """Round-robin's saturation throughput in the simulator: requests finished per second over
    the second half of a run at a rate no replica set keeps up with."""
    arrivals = workload.arrivals([Phase(args.overload_rate, 20.0)], seed=args.seed * 1000 + 999)
    result = sim_cluster(args, "round-robin").run(arrivals, 20.0)
    done = [r.finished for r in result.requests if r.finished is not None and 10.0 <= r.finished < 20.0]
    return len(done) / 10.0


def sim_policy(args: argparse.Namespace, policy: str, warmup: list[Arrival], points: list[Point]
               ) -> list[PointResult]:
    """The same warm-up and points through the simulator, back to back with a drain gap."""
    gap = 4.0
    played: list[Arrival] = list(warmup)
    starts = []
    t = warmup[-1].time + gap
    for point in points:
        starts.append(t)
        played += [replace(a, time=a.time + t) for a in point.arrivals]
        t += args.duration + gap
    result = sim_cluster(args, policy).run(played, t)
    results = []
    bounds = starts + [math.inf]
    for k, point in enumerate(points):
        reqs = [r for r in result.requests if bounds[k] <= r.arrival < bounds[k + 1]]
        r = PointResult(policy, point.load, point.rate, sent=len(reqs))
        r.ttft = [q.ttft for q in reqs if q.ttft is not None]
        r.failed = sum(q.finished is None for q in reqs)
        r.pod_hits = sum(q.cached_tokens for q in reqs)
        r.pod_queries = sum(q.prompt_tokens for q in reqs)
        results.append(r)
    return results


# --- reporting ----------------------------------------------------------------------------------

def fmt(v: float | None, scale: float = 1.0, digits: int = 3) -> str:
    return "-" if v is None else f"{v * scale:.{digits}f}"


def row(r: PointResult) -> str:
    tps = r.output_tokens / r.span if r.span else 0.0
    return (f"load {r.load:.2f} rate {r.rate:.1f}/s: {r.sent - r.failed}/{r.sent} ok, TTFT p50/p90/p99 "
            f"{fmt(r.p(.5))}/{fmt(r.p(.9))}/{fmt(r.p(.99))} s, ITL p50 {fmt(pct(r.itl, .5), 1000, 1)} ms, "
            f"{tps:.0f} out tok/s, pod hit {fmt(r.hit_ratio)}, gateway matched {fmt(r.gw_ratio)}")


def main_table(rows: list[PointResult], sims: dict[str, list[PointResult]], load: float) -> str:
    out = ["| policy | ok / sent | failed | TTFT p50 (s) | TTFT p90 (s) | TTFT p99 (s) | ITL p50 (ms) | "
           "output tok/s | pod prefix hit | gateway blocks matched | sim TTFT p90 (s) | sim prefix hit |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if abs(r.load - load) > 1e-9:
            continue
        s = next((x for x in sims.get(r.policy, []) if abs(x.load - load) < 1e-9), None)
        out.append(f"| {r.policy} | {r.sent - r.failed}/{r.sent} | {r.failed} | {fmt(r.p(.5))} | {fmt(r.p(.9))} | "
                   f"{fmt(r.p(.99))} | {fmt(pct(r.itl, .5), 1000, 1)} | {r.output_tokens / r.span if r.span else 0:.0f} | "
                   f"{fmt(r.hit_ratio)} | {fmt(r.gw_ratio)} | {fmt(s.p(.9) if s else None)} | "
                   f"{fmt(s.hit_ratio if s else None)} |")
    return "\n".join(out)


def goodput(results: list[PointResult], threshold: float) -> float:
    """Highest rate passing (no failures, p90 TTFT ≤ threshold) before the first that does not."""
    best = 0.0
    for r in sorted(results, key=lambda r: r.rate):
        if r.failed or not r.ttft or r.p(.9) > threshold:
            break
        best = r.rate
    return best


def sweep_table(real: dict[str, list[PointResult]], sims: dict[str, list[PointResult]], loads: list[float],
                threshold: float) -> str:
    head = "| policy | " + " | ".join(f"{l:g}× p90 (s)" for l in loads) + " | goodput (req/s) | ÷ round-robin | sim goodput | sim ÷ rr |"
    out = [head, "|---|" + "---:|" * (len(loads) + 4)]
    rr = goodput(real.get("round-robin", []), threshold)
    srr = goodput(sims.get("round-robin", []), threshold)
    for policy in real or sims:
        cells = []
        for l in loads:
            r = next((x for x in real.get(policy, []) if abs(x.load - l) < 1e-9), None)
            s = next((x for x in sims.get(policy, []) if abs(x.load - l) < 1e-9), None)
            cells.append(f"{fmt(r.p(.9)) if r else '·'} (sim {fmt(s.p(.9)) if s else '·'})")
        g, sg = goodput(real.get(policy, []), threshold), goodput(sims.get(policy, []), threshold)
        out.append(f"| {policy} | " + " | ".join(cells) + f" | {g:.1f} | {g / rr if rr else math.nan:.2f} | "
                   f"{sg:.1f} | {sg / srr if srr else math.nan:.2f} |")
    return "\n".join(out)


def plot(real: dict[str, list[PointResult]], sims: dict[str, list[PointResult]], threshold: float,
         path: Path) -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for i, policy in enumerate(real or sims):
        color = f"C{i}"
        for results, style, tag in ((real.get(policy, []), "-o", ""), (sims.get(policy, []), ":x", " (sim)")):
            pts = [(r.rate, r.p(.9)) for r in results if r.ttft]
            if pts:
                a.plot(*zip(*pts), style, color=color, label=policy + tag)
            hits = [(r.rate, r.hit_ratio) for r in results if r.hit_ratio is not None]
            if hits:
                b.plot(*zip(*hits), style, color=color, label=policy + tag)
    a.axhline(threshold, color="grey", lw=0.8, ls="--")
    a.set(xlabel="offered rate (req/s, modelled)", ylabel="TTFT p90 (s, modelled)", yscale="log",
          title="TTFT p90 vs rate (dashed: goodput threshold)")
    b.set(xlabel="offered rate (req/s, modelled)", ylabel="prompt tokens from prefix cache", ylim=(0, 1),
          title="pods' prefix-cache hit ratio")
    a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policies", default="all", help="comma-separated, or all")
    p.add_argument("--loads", default="0.8,1,1.25,1.6,2,2.5", help="rate points as multiples of capacity")
    p.add_argument("--capacity", type=float, default=None,
                   help="round-robin capacity in req/s (modelled); default: measured in the simulator")
    p.add_argument("--overload-rate", type=float, default=120.0, help="req/s of the simulated capacity probe")
    p.add_argument("--duration", type=float, default=6.0, help="modelled seconds of arrivals per point")
    p.add_argument("--threshold", type=float, default=0.5, help="goodput's p90 TTFT bound (modelled s)")
    p.add_argument("--profile", default="llama3-8b-h100")
    p.add_argument("--time-scale", type=float, default=8.0, help="wall seconds per modelled second")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--groups", type=int, default=32)
    p.add_argument("--prefix-tokens", type=int, default=4096)
    p.add_argument("--turn-tokens", type=int, default=64)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--think-time", type=float, default=0.5, help="mean modelled seconds between turns")
    p.add_argument("--cache-fraction", type=float, default=1 / 3,
                   help="one pod's KV cache as a fraction of the prefix working set (groups × prefix tokens)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-real", action="store_true", help="simulator only")
    args = p.parse_args(argv)
    policies = list(POLICIES) if args.policies == "all" else args.policies.split(",")
    loads = [float(x) for x in args.loads.split(",")]
    OUT.mkdir(exist_ok=True)
    profile = get_profile(args.profile)
    working_set = args.groups * args.prefix_tokens
    blocks = math.ceil(working_set * args.cache_fraction / 16)
    args.kv_bytes = blocks * 16 * profile.model.kv_bytes_per_token
    workload = PrefixGroups(args.groups, args.prefix_tokens, args.turn_tokens, args.turns, args.output_tokens,
                            args.think_time)
    started = time.monotonic()
    capacity = args.capacity or sim_capacity(args, workload)
    print(f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, load avg {os.getloadavg()[0]:.1f}; "
          f"python benchmarks/routing.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    print(f"profile {args.profile}, time scale {args.time_scale:g}, {len(POD_HOSTS)} pods × {blocks * 16} KV tokens "
          f"({args.kv_bytes / 2**30:.2f} GiB; working set {working_set} prefix tokens), max_num_seqs "
          f"{args.max_num_seqs}, max_num_batched_tokens {args.max_num_batched_tokens}")
    print(f"workload: {args.groups} groups × {args.prefix_tokens}-token prefix, {args.turn_tokens}-token turns, "
          f"{args.turns} turns, {args.output_tokens} output tokens, think {args.think_time:g}s, {args.duration:g}s/point")
    print(f"round-robin capacity {capacity:.1f} req/s ({'given' if args.capacity else 'simulated'}); "
          f"points {', '.join(f'{l:g}×={l * capacity:.1f}' for l in loads)} req/s (modelled)", flush=True)
    warmup, points = make_points(workload, capacity, loads, args.duration, args.seed)
    sims = {policy: sim_policy(args, policy, warmup, points) for policy in policies}
    real: dict[str, list[PointResult]] = {}
    if not args.no_real:
        for policy in policies:
            real[policy] = asyncio.run(run_policy(args, policy, warmup, points))
    print(f"\nat {loads[0]:g}× capacity ({loads[0] * capacity:.1f} req/s modelled, "
          f"{loads[0] * capacity / args.time_scale:.2f} wall):")
    print(main_table([r for rs in real.values() for r in rs] if real else [r for rs in sims.values() for r in rs],
                     sims, loads[0]))
    print(f"\np90 TTFT per point (modelled s; '·' = not run, a lower point missed the bound) and goodput "
          f"(highest rate with p90 TTFT ≤ {args.threshold:g} s and no failures):")
    print(sweep_table(real, sims, loads, args.threshold))
    for policy, rs in real.items():
        for r in rs:
            if r.errors:
                print(f"{policy} {r.load:g}×: {r.failed} failed, e.g. {r.errors[0]}")
    if real and "round-robin" in real and "kv-events" in real:
        rr, kv = real["round-robin"][0], real["kv-events"][0]
        ratio = kv.p(.9) / rr.p(.9) if kv.p(.9) and rr.p(.9) else math.nan
        g = goodput(real["kv-events"], args.threshold) / max(goodput(real["round-robin"], args.threshold), 1e-9)
        print(f"\nkv-events ÷ round-robin p90 TTFT at {loads[0]:g}×: {ratio:.3f} (target ≤ 0.25: "
              f"{'met' if ratio <= 0.25 else 'not met'}); goodput ratio {g:.2f} (target ≥ 1.3: "
              f"{'met' if g >= 1.3 else 'not met'})")
    path = OUT / "routing.png"
    print(f"plot: {path}" if plot(real, sims, args.threshold, path) else "plot: matplotlib not installed, skipped")
    print(f"total {time.monotonic() - started:.0f}s wall")
    return 0


if __name__ == "__main__":
    sys.exit(main())
