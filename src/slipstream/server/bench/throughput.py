"""``slipstream bench throughput``: a seeded workload through the offline engine to completion.

All requests are queued at once and run greedily with EOS ignored, so each one generates exactly
its drawn length; throughput is tokens over the wall time of ``LLM.generate`` after a small
warm-up. The engine's step trace gives the step count, preemptions and KV-cache utilization.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, replace

from ..cli import HelpFormatter, add_engine_arguments, engine_config
from .options import add_workload_arguments, workload_settings, write_json
from .workload import describe, make_workload


def add_parser(sub) -> None:
    p = sub.add_parser("throughput", help="offline engine throughput on a seeded workload",
                       description=__doc__.split("\n\n")[1].replace("\n", " ").replace("``", ""),
                       formatter_class=HelpFormatter)
    add_workload_arguments(p)
    add_engine_arguments(p)
    p.set_defaults(run=run, parser=p)


def summarize(trace: list, elapsed: float, num_requests: int, prompt_tokens: int, output_tokens: int) -> dict:
    """Throughput and step statistics from the engine's :class:`StepRecord` trace of one run.

    Returns seconds, tokens/s and requests/s; ``kv_utilization_*`` (tokens held / slots
    allocated by the running requests) over the steps after which nothing was waiting, or NaN.
    """
    steps = len(trace)
    step_time = sum(r.step_time for r in trace)
    admitted = [r.kv_utilization for r in trace if r.num_waiting == 0 and r.kv_utilization is not None]
    return {
        "elapsed_s": elapsed, "requests": num_requests, "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "requests_per_s": num_requests / elapsed,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed,
        "output_tokens_per_s": output_tokens / elapsed,
        "steps": steps,
        "prefill_steps": sum(1 for r in trace if r.num_prefill_tokens),
        "preemptions": sum(r.num_preemptions for r in trace),
        "peak_running": max((r.num_running for r in trace), default=0),
        "mean_step_ms": 1000 * step_time / steps if steps else float("nan"),
        "forward_share": sum(r.forward_time for r in trace) / step_time if step_time else float("nan"),
        "kv_utilization_mean": sum(admitted) / len(admitted) if admitted else float("nan"),
        "kv_utilization_min": min(admitted) if admitted else float("nan"),
    }


def run(args: argparse.Namespace) -> int:
    try:
        llm, workload, outputs, elapsed = _generate(args)
    except ValueError as exc:  # ModelLoadError, settings that cannot work, a workload that does not fit
        print(f"error: {exc}", file=sys.stderr)
        return 1
    engine = llm.engine
    produced = sum(len(c.token_ids) for out in outputs for c in out.outputs)
    result = summarize(engine.trace, elapsed, len(workload), sum(len(r.prompt) for r in workload), produced)
    print(f"Throughput: {result['requests_per_s']:.2f} requests/s, {result['total_tokens_per_s']:.1f} total "
          f"tokens/s, {result['output_tokens_per_s']:.1f} output tokens/s ({elapsed:.1f} s)")
    print(f"steps: {result['steps']} ({result['prefill_steps']} with prefill), {result['preemptions']} preemptions, "
          f"peak {result['peak_running']} running; {result['mean_step_ms']:.1f} ms/step, "
          f"{100 * result['forward_share']:.1f}% of it in the forward pass and sampler")
    print(f"KV-cache utilization (tokens held / slots allocated) after each step with nothing waiting: "
          f"mean {result['kv_utilization_mean']:.3f}, min {result['kv_utilization_min']:.3f}")
    write_json(args.output_json, {**result, "model": engine.model_name, "engine": asdict(engine.config),
                                  **workload_settings(args)})
    expected = sum(r.max_tokens for r in workload)
    if produced != expected:
        print(f"error: generated {produced} tokens, the workload asks for {expected}", file=sys.stderr)
        return 1
    return 0


def _generate(args: argparse.Namespace):
    """Load, warm up, run the workload; returns ``(llm, workload, outputs, seconds)``.

    Raises:
        ValueError: the model cannot load, the settings cannot work, or a request cannot fit
            (checked for every request before any runs).
    """
    from ..engine.llm import LLM
    from ..engine.sampling_params import SamplingParams

    t0 = time.perf_counter()
    llm = LLM(**asdict(replace(engine_config(args), trace=True)))
    engine = llm.engine
    print(f"model: {engine.model_name} ({engine.device.type}, {str(engine.dtype).removeprefix('torch.')}); "
          f"loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    vocab = engine.model_config.vocab_size
    workload = make_workload(args.num_requests, args.workload_seed, vocab, args.max_output, args.prompt_len)
    print(f"workload (seed {args.workload_seed}): {describe(workload)}", flush=True)

    def generate(batch):
        return llm.generate([r.prompt for r in batch],
                            [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in batch])

    generate(make_workload(2, args.workload_seed + 1, vocab, 2, (1, 4)))  # first-call costs out of the measurement
    engine.trace.clear()
    start = time.perf_counter()
    outputs = generate(workload)
    return llm, workload, outputs, time.perf_counter() - start
