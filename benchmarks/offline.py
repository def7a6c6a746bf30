"""Offline throughput: slipstream vs transformers static batching vs transformers continuous batching vs llama.cpp.

One seeded workload (``slipstream.server.bench.workload``: random prompts of 32–256 tokens, forced output
lengths from {16, …, 512} with a heavy tail, EOS ignored so every system does the same work),
the built-in model's weights (SmolLM2-135M-Instruct GGUF, dequantized to fp32) in all three,
greedy decoding, run one system after the other in this process:

- ``slipstream``: ``LLM.generate`` with ``ignore_eos=True``.
- ``hf-static``: ``model.generate`` over batches of 8 in arrival order, left-padded, each batch
  running to its longest request (``min_new_tokens = max_new_tokens``).
- ``hf-cb``: transformers' continuous batching manager (``init_continuous_batching``), one
  ``add_request`` per request with its own ``max_new_tokens`` and no EOS.
- ``llama.cpp``: llama-server (online.py's build, ``--parallel`` = ``--max-num-seqs`` slots,
  ``--threads`` = ``--threads``) on the same GGUF as stored, the whole workload sent at once as
  streaming token-id completions on loopback (llama.cpp's server at full load, since its batched
  mode is not a library call); wall time from the first send to the last token, CPU seconds the
  server's own.

Throughput counts only the workload's output tokens (a static batch's padding steps are waste);
it is printed per wall second and per CPU second of this process (the latter is steadier when
other work shares the CPU). Every system runs with ``--threads`` torch threads. For slipstream it also prints KV-cache utilization (tokens held / slots allocated, against a
contiguous reservation per request) and the time each step spends outside the forward pass.
``--profile N`` then runs cProfile and the torch profiler over N decode steps with the batch full.

Usage: ``python benchmarks/offline.py [--num-requests 32] [--seed 0] [--max-output 512]
[--systems slipstream,hf-static,hf-cb,llama.cpp] [--max-num-seqs 32] [--threads 1] [--profile 20]``.
"""
from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import math
import os
import platform
import pstats
import sys
import time
from dataclasses import dataclass, field


import torch

from slipstream.server.bench.workload import WorkloadRequest, describe, make_workload

SYSTEMS = ("slipstream", "hf-static", "hf-cb", "llama.cpp")


@dataclass
class Result:
    system: str
    wall_s: float
    cpu_s: float
    output_tokens: int
    prompt_tokens: int
    load_before: float
    load_after: float
    extra: dict = field(default_factory=dict)
    threads: int = 0  # torch intra-op threads in the thread that ran the model

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.wall_s


def measured(system: str, workload: list[WorkloadRequest], run) -> Result:
    """Time ``run()`` (wall and this process's CPU seconds) and check it produced every token."""
    load0 = os.getloadavg()[0]
    w0, c0 = time.perf_counter(), time.process_time()
    lengths = run()
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    want = [r.max_tokens for r in workload]
    if lengths != want:
        bad = next(i for i, (a, b) in enumerate(zip(lengths, want)) if a != b)
        raise RuntimeError(f"{system}: request {bad} produced {lengths[bad]} tokens, expected {want[bad]}")
    return Result(system, wall, cpu, sum(want), sum(len(r.prompt) for r in workload), load0,
                  os.getloadavg()[0], threads=torch.get_num_threads())


# --- slipstream -----------------------------------------------------------------------------------
class StepTimers:
    """Wraps the engine's parts on the instance (engine code untouched) to split each step's time:
    ``schedule``, ``model`` (decoder forward + LM head), ``sample``; the rest of ``step_time`` is
    input preparation and postprocessing (append, detokenize, stop checks, retire)."""

    def __init__(self, engine):
        self.times = {"schedule": 0.0, "model": 0.0, "sample": 0.0}
        self.per_step: list[dict[str, float]] = []
        self.ctx = 0.0  # mean context (tokens) the step's requests attend over
        model = engine.runner.model
        schedule = self._wrap("schedule", engine.scheduler.schedule)

        def schedule_and_note_context():
            batch = schedule()
            if batch:
                self.ctx = sum(r.num_computed_tokens + n for r, n in zip(batch.requests, batch.num_new_tokens)) \
                    / len(batch.requests)
            return batch

        engine.scheduler.schedule = schedule_and_note_context
        model.forward = self._wrap("model", model.forward)
        model.logits = self._wrap("model", model.logits)
        engine.sampler = self._wrap("sample", engine.sampler)
        engine.step_listeners.append(self._on_step)

    def _wrap(self, key, fn):
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.times[key] += time.perf_counter() - t
        return timed

    def _on_step(self, record) -> None:
        self.per_step.append(dict(self.times, ctx=self.ctx))
        for k in self.times:
            self.times[k] = 0.0


class KVSampler:
    """After each step: paged utilization of the running requests' blocks, and what a contiguous
    reservation would hold for the same tokens."""

    def __init__(self, engine, reserve_len: int):
        self.engine = engine
        self.reserve_len = reserve_len
        self.samples: list[dict] = []
        engine.step_listeners.append(self._on_step)

    def _on_step(self, record) -> None:
        running = self.engine.scheduler.running
        if not running:
            return
        held = sum(r.num_computed_tokens for r in running)
        self.samples.append({
            "step": record.step, "waiting": self.engine.scheduler.num_waiting, "running": len(running),
            "paged": self.engine.kv.utilization(running),
            "max_model_len": held / (len(running) * self.engine.max_model_len),
            "workload_max": held / (len(running) * self.reserve_len),
            "per_request": held / sum(r.num_prompt_tokens + r.params.max_tokens for r in running),
        })


def run_slipstream(workload, loaded, args) -> Result:
    from slipstream.server.engine import LLM, SamplingParams
    llm = LLM(loaded=loaded, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              kv_cache_memory_bytes=args.kv_cache_memory_bytes, trace=True)
    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in workload]
    warm = make_workload(2, seed=args.seed + 1, max_output=8, prompt_range=(16, 32))
    llm.generate([r.prompt for r in warm], [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)] * 2)
    engine = llm.engine
    engine.trace.clear()
    timers = StepTimers(engine)
    kv = KVSampler(engine, max(len(r.prompt) + r.max_tokens for r in workload))

    def run():
        return [len(o.outputs[0].token_ids) for o in llm.generate([r.prompt for r in workload], params)]

    res = measured("slipstream", workload, run)
    res.extra = {"trace": list(engine.trace), "timers": timers.per_step, "kv": kv.samples,
                 "max_model_len": engine.max_model_len, "weight_bytes": weight_bytes(loaded.model)}
    return res


# --- llama.cpp ------------------------------------------------------------------------------------

def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _online():
    """online.py beside this file (a script's folder is first on sys.path)."""
    import online
    return online


def run_llama_cpp(workload, args) -> Result:
    import argparse as _argparse
    import asyncio

    from slipstream.server.bench.client import run_rate

    online = _online()  # starts llama-server
    longest = max(len(r.prompt) + r.max_tokens for r in workload)
    opts = _argparse.Namespace(max_num_seqs=args.max_num_seqs, max_model_len=max(1024, longest),
                               llama_threads=args.threads, slipstream_threads=None)
    server = asyncio.run(online.start_server("llama.cpp", opts, online.builtin_gguf()))
    try:
        asyncio.run(run_rate(server.url, make_workload(2, seed=args.seed + 1, max_output=8), math.inf, args.seed))
        load0, cpu0 = os.getloadavg()[0], _cpu_seconds(server.proc.pid)
        row = asyncio.run(run_rate(server.url, workload, math.inf, args.seed))
        cpu = _cpu_seconds(server.proc.pid) - cpu0
    finally:
        server.stop()
    if row["completed"] != len(workload) or row["output_tokens"] != row["expected_tokens"]:
        raise RuntimeError(f"llama.cpp: {row['completed']}/{len(workload)} requests, {row['output_tokens']} of "
                           f"{row['expected_tokens']} tokens; errors {row['errors']}")
    return Result("llama.cpp", row["duration"], cpu, row["output_tokens"], sum(len(r.prompt) for r in workload), load0,
                  os.getloadavg()[0], threads=args.threads)


# --- transformers ---------------------------------------------------------------------------------
def load_hf():
    from transformers import AutoModelForCausalLM
    from slipstream.server.models.loader import builtin_model_path
    path = builtin_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()


def run_hf_static(workload, model, args) -> Result:
    pad = model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0

    def generate(batch: list[WorkloadRequest]) -> list[int]:
        width = max(len(r.prompt) for r in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(batch):  # left padding: every row's last prompt token lines up
            ids[i, width - len(r.prompt):] = torch.tensor(r.prompt)
            mask[i, width - len(r.prompt):] = 1
        n = max(r.max_tokens for r in batch)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=pad)
        assert out.shape[1] - width == n, f"static batch made {out.shape[1] - width} tokens, expected {n}"
        return [r.max_tokens for r in batch]  # each request keeps its first max_tokens; the rest is waste

    generate(make_workload(2, seed=args.seed + 1, max_output=8, prompt_range=(16, 32)))

    bs = args.static_batch_size
    batches = [workload[i:i + bs] for i in range(0, len(workload), bs)]
    res = measured("hf-static", workload, lambda: [n for b in batches for n in generate(b)])
    res.extra["steps"] = sum(max(r.max_tokens for r in b) for b in batches)
    res.extra["padded_fraction"] = 1 - res.output_tokens / sum(max(r.max_tokens for r in b) * len(b) for b in batches)
    return res


def hf_cb_collect(manager, reqs: list[WorkloadRequest], tag: str) -> list[int]:
    """Send ``reqs`` to a started transformers continuous-batching manager and wait for them all;
    returns each request's generated token count, in order. Raises RuntimeError when a request
    fails or the manager's generation thread dies."""
    ids = [manager.add_request(r.prompt, request_id=f"{tag}{i}", max_new_tokens=r.max_tokens, eos_token_id=-1)
           for i, r in enumerate(reqs)]
    done: dict[str, int] = {}
    while len(done) < len(ids):
        out = manager.get_result(timeout=1)
        if out is None:
            if not manager.is_running():
                raise RuntimeError("hf-cb: the generation thread died")
            continue
        if out.error:
            raise RuntimeError(f"hf-cb: request {out.request_id} failed: {out.error}")
        if out.is_finished():
            done[out.request_id] = len(out.generated_tokens)
    return [done[i] for i in ids]


def run_hf_cb(workload, model, args) -> Result:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    blocks = sum(-(-(len(r.prompt) + r.max_tokens) // args.block_size) for r in workload) + len(workload)
    cb = ContinuousBatchingConfig(page_size=args.block_size, num_blocks=blocks,
                                  max_batch_tokens=args.max_num_batched_tokens,
                                  max_requests_per_batch=args.max_num_seqs)
    gen = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=16)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    loop = manager._run_generation_loop
    seen = {}

    def loop_with_threads(*a, **kw):  # a new Python thread does not inherit torch.set_num_threads
        torch.set_num_threads(args.threads)
        seen["threads"] = torch.get_num_threads()
        return loop(*a, **kw)

    manager._run_generation_loop = loop_with_threads
    manager.start()

    def collect(reqs: list[WorkloadRequest], tag: str) -> list[int]:
        return hf_cb_collect(manager, reqs, tag)

    try:
        with torch.inference_mode():
            collect(make_workload(2, seed=args.seed + 1, max_output=8, prompt_range=(16, 32)), "warm")
            res = measured("hf-cb", workload, lambda: collect(workload, "req"))
        res.threads = seen.get("threads", 0)
    finally:
        manager.stop(block=True, timeout=30)
        model.destroy_cached_continuous_batching_manager()
    return res


# --- report ---------------------------------------------------------------------------------------
def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import subprocess
    import transformers
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        git = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--", "../server", "../kernels"],
                               capture_output=True, text=True, check=True).stdout.split("\n")
        dirty = [line[3:] for line in dirty if line.strip()]
        git += f" + uncommitted changes in {', '.join(dirty)}" if dirty else " (engine clean)"
    except (OSError, subprocess.CalledProcessError):
        git = "unknown"
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"date: {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}\n"
            f"machine: {cpu}; {os.cpu_count()} CPUs ({len(os.sched_getaffinity(0))} usable); "
            f"torch {torch.__version__}, {torch.get_num_threads()} threads; transformers {transformers.__version__}; "
            f"Python {platform.python_version()}\n{_online().cpu_line()}\nslipstream commit: {git}\n"
            f"load average at start (1, 5, 15 min): {load}")


def print_table(results: list[Result]) -> None:
    print("\n| system | threads | wall s | output tok/s | total tok/s | CPU s | output tok per CPU s "
          "| load avg 1m (start→end) |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for r in results:
        print(f"| {r.system} | {r.threads} | {r.wall_s:.1f} | {r.tok_s:.1f} | {(r.output_tokens + r.prompt_tokens) / r.wall_s:.1f} "
              f"| {r.cpu_s:.1f} | {r.output_tokens / r.cpu_s:.1f} | {r.load_before:.1f}→{r.load_after:.1f} |")
    by = {r.system: r for r in results}
    if "hf-static" in by:
        print(f"\nhf-static: {by['hf-static'].extra['steps']} decode steps; "
              f"{by['hf-static'].extra['padded_fraction']:.0%} of the tokens it generated were padding waste")
    if "slipstream" not in by:
        return
    s = by["slipstream"]
    if "hf-static" in by:
        st = by["hf-static"].extra
        print(f"bounds on slipstream / hf-static: {st['steps'] / len(s.extra['trace']):.2f}× if a step cost the same "
              f"at any batch size ({st['steps']} vs {len(s.extra['trace'])} steps), "
              f"{1 / (1 - st['padded_fraction']):.2f}× if it cost the same per token")
    for other, target in (("hf-static", 3.0), ("hf-cb", 1.5), ("llama.cpp", 1.0)):
        if other in by:
            ratio = s.tok_s / by[other].tok_s
            cpu_ratio = (s.output_tokens / s.cpu_s) / (by[other].output_tokens / by[other].cpu_s)
            print(f"slipstream / {other}: {ratio:.2f}× output tok/s (target ≥ {target}×: "
                  f"{'met' if ratio >= target else 'NOT met'}); {cpu_ratio:.2f}× per CPU second")


def weight_bytes(model) -> int:
    """Bytes of weights one decode step reads: every parameter and quantized block, tied ones once."""
    seen: dict[int, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        if t.dim() >= 1 and t.numel() > 1 and t is not getattr(model, "inv_freq", None):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def copy_bandwidth(nbytes: int = 512 << 20, repeats: int = 5) -> float:
    """GB/s copied by ``Tensor.copy_`` (bytes copied per second, each read once and written once)
    at the current torch thread count: the machine's streaming limit for a weight read."""
    a = torch.ones(nbytes // 4)
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def report_slipstream(res: Result, max_num_seqs: int) -> None:
    trace, timers, kv = res.extra["trace"], res.extra["timers"], res.extra["kv"]
    print(f"\nslipstream: {len(trace)} steps, {sum(r.num_preemptions for r in trace)} preemptions, "
          f"peak {max(r.num_running for r in trace)} running")

    admitted = [s for s in kv if s["waiting"] == 0]
    if admitted:
        first = admitted[0]
        mean = {k: sum(s[k] for s in admitted) / len(admitted)
                for k in ("paged", "max_model_len", "workload_max", "per_request")}
        print(f"\nKV utilization = tokens held / slots allocated, running requests, after each step once all "
              f"requests are admitted ({len(admitted)} steps; first at step {first['step']} with "
              f"{first['running']} running):")
        print("| allocation | at all-admitted | mean | min |")
        print("|---|---:|---:|---:|")
        rows = (("paged (slipstream, 16-token blocks)", "paged"),
                (f"contiguous, max_model_len ({res.extra['max_model_len']}) per request", "max_model_len"),
                ("contiguous, workload's longest prompt+output per request", "workload_max"),
                ("contiguous, own prompt + max_tokens per request", "per_request"))
        for label, k in rows:
            print(f"| {label} | {first[k]:.3f} | {mean[k]:.3f} | {min(s[k] for s in admitted):.3f} |")
        ok = first["paged"] >= 0.95 and mean["paged"] >= 0.95
        print(f"target paged ≥ 0.95 once all are admitted: {'met' if ok else 'NOT met'}")

    def overhead(steps, label):
        if not steps:
            print(f"{label}: no such steps")
            return
        idx = [i for i, _ in steps]
        recs = [r for _, r in steps]
        total = sum(r.step_time for r in recs)
        rec_over = sum(r.step_time - r.forward_time for r in recs) / total
        parts = {k: sum(timers[i][k] for i in idx) / total for k in ("schedule", "model", "sample")}
        rest = 1 - sum(parts.values())
        print(f"| {label} | {len(recs)} | {total / len(recs) * 1e3:.1f} | {rec_over:.1%} | {parts['schedule']:.1%} "
              f"| {parts['model']:.1%} | {parts['sample']:.1%} | {rest:.1%} | {1 - parts['model']:.1%} |")

    print("\nStep time split (fractions of step_time). 'StepRecord' = (step_time − forward_time)/step_time, where "
          "forward_time starts before schedule(); 'outside model' = 1 − model share:")
    print("| steps | n | ms/step | StepRecord outside fwd | schedule | model fwd+lm_head | sample "
          "| prepare+postprocess | outside model |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    steps = list(enumerate(trace))
    full = [(i, r) for i, r in steps if r.num_running >= max_num_seqs]
    overhead(full, f"≥{max_num_seqs} running")
    overhead([(i, r) for i, r in full if r.num_prefill_tokens == 0], f"≥{max_num_seqs} running, decode only")
    overhead([(i, r) for i, r in steps if r.num_prefill_tokens == 0], "all decode-only steps")
    overhead(steps, "all steps")
    print()
    wbytes, copy_gbs = res.extra["weight_bytes"], copy_bandwidth()
    print(f"roofline: a decode step reads {wbytes / 1e6:.0f} MB of weights; this machine copies "
          f"{copy_gbs:.1f} GB/s ({torch.get_num_threads()} thread(s), Tensor.copy_ of 512 MiB)")
    print("| decode steps with this many running | steps | ms/step | ms per token | mean context tokens "
          "| weight GB/s (÷ copy) |")
    print("|---|---:|---:|---:|---:|---:|")
    lo = 1
    while lo <= max_num_seqs:
        hi = min(lo * 2 - 1, max_num_seqs)
        sel = [(i, r) for i, r in steps if r.num_prefill_tokens == 0 and lo <= r.num_running <= hi]
        if sel:
            ms = sum(r.step_time for _, r in sel) / len(sel) * 1e3
            ctx = [timers[i]["ctx"] for i, _ in sel]
            gbs = wbytes / (ms / 1e3) / 1e9
            print(f"| {lo if lo == hi else f'{lo}–{hi}'} | {len(sel)} | {ms:.1f} | {ms * len(sel) / sum(r.num_running for _, r in sel):.1f} "
                  f"| {sum(ctx) / len(ctx):.0f} | {gbs:.1f} ({gbs / copy_gbs:.2f}) |")
        lo *= 2
    if full:
        ratio = sum(r.step_time - r.forward_time for _, r in full) / sum(r.step_time for _, r in full)
        print(f"target StepRecord overhead < 10% with ≥{max_num_seqs} running: {'met' if ratio < 0.10 else 'NOT met'}")


def profile_slipstream(loaded, args, steps: int) -> None:
    """cProfile and the torch profiler over ``steps`` engine steps with ``max_num_seqs`` decoding."""
    from slipstream.server.engine import LLM, SamplingParams
    llm = LLM(loaded=loaded, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              kv_cache_memory_bytes=args.kv_cache_memory_bytes)
    engine = llm.engine
    reqs = make_workload(args.max_num_seqs, seed=args.seed + 2, max_output=args.max_output)
    for r in reqs:
        engine.add_request(r.prompt, SamplingParams(temperature=0.0, max_tokens=steps * 3 + 64, ignore_eos=True))
    while engine.scheduler.num_waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                              for r in engine.scheduler.running):
        engine.step()
    for _ in range(3):
        engine.step()
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    for _ in range(steps):
        engine.step()
    prof.disable()
    wall = time.perf_counter() - t
    print(f"\ncProfile: {steps} decode steps with {engine.scheduler.num_running} running, "
          f"{wall / steps * 1e3:.1f} ms/step under the profiler; top 25 by own time:")
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
    print(buf.getvalue())
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as tp:
        for _ in range(steps):
            engine.step()
    print(f"torch profiler: {steps} more decode steps; top 20 ops by self CPU time:")
    print(tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=40))
    for gid in list(engine.groups):
        engine.abort(gid)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-output", type=int, default=512, help="cap on the drawn output lengths (quick runs)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    p.add_argument("--max-num-seqs", type=int, default=32, help="slipstream and hf-cb: most requests running; llama.cpp: its slots")
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="slipstream and hf-cb: tokens per step")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=1 << 30)
    p.add_argument("--block-size", type=int, default=16, help="hf-cb page size (slipstream uses its default, 16)")
    p.add_argument("--static-batch-size", type=int, default=8)
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads for every system (default 1: on a shared, oversubscribed CPU "
                        "OpenMP's barriers make 2 threads several times slower; use the core count on an idle machine)")
    p.add_argument("--quantization", default="auto", choices=["auto", "none"],
                   help="slipstream's weights: 'auto' serves the GGUF's Q4_1/Q8_0 blocks as stored, 'none' "
                        "dequantizes to fp32 (transformers always dequantizes)")
    p.add_argument("--profile", type=int, default=0, metavar="STEPS",
                   help="after the run, profile this many slipstream decode steps with the batch full")
    args = p.parse_args(argv)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        p.error(f"unknown systems {sorted(unknown)}; choose from {','.join(SYSTEMS)}")

    torch.set_num_threads(args.threads)
    from slipstream.server.models.loader import load_model
    print(machine())
    loaded = load_model("builtin", torch.device("cpu"), torch.float32, args.quantization)
    workload = make_workload(args.num_requests, args.seed, loaded.config.vocab_size, args.max_output)
    served = "Q4_1/Q8_0 as stored" if args.quantization == "auto" else "dequantized to fp32"
    print(f"model: {loaded.name} (GGUF; slipstream: {served}; transformers: dequantized to fp32), greedy, EOS ignored")
    print(f"workload (seed {args.seed}): {describe(workload)}")
    print(f"slipstream/hf-cb: max_num_seqs {args.max_num_seqs}, {args.max_num_batched_tokens} tokens per step; "
          f"hf-static: batches of {args.static_batch_size}, left-padded", flush=True)

    results: list[Result] = []
    hf = load_hf() if {"hf-static", "hf-cb"} & set(systems) else None
    for system in systems:
        t = time.perf_counter()
        if system == "slipstream":
            results.append(run_slipstream(workload, loaded, args))
        elif system == "hf-static":
            results.append(run_hf_static(workload, hf, args))
        elif system == "llama.cpp":
            results.append(run_llama_cpp(workload, args))
        else:
            results.append(run_hf_cb(workload, hf, args))
        print(f"{system}: done in {time.perf_counter() - t:.0f} s ({results[-1].tok_s:.1f} output tok/s)",
              file=sys.stderr, flush=True)
    print_table(results)
    for r in results:
        if r.system == "slipstream":
            report_slipstream(r, args.max_num_seqs)
    print(f"\nload average at end (1, 5, 15 min): {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    if args.profile:
        profile_slipstream(loaded, args, args.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
