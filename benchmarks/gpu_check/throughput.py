"""Offline throughput of one system on a seeded workload: the engine (eager or CUDA graphs) or
transformers' own continuous batching, on the same random-weight model directory.

The workload is ``slipstream.server.bench.workload.make_workload`` (random token-id prompts,
heavy-tailed forced output lengths); every system generates exactly each request's
``max_tokens`` (the engine with ``ignore_eos``, transformers with ``eos_token_id=-1``), so output
tokens/s compare the same work. One system per process (``--system``), so a hang or a CUDA error
in one cannot lose the others' numbers; a small warm-up (kernel compilation, graph capture) runs
first and is not timed.

Usage: ``python throughput.py --system slipstream-eager|slipstream-graphs|hf-cb --model DIR [--requests 256] [--json F]``.
"""
from __future__ import annotations

import argparse
import inspect
import sys
import time
from pathlib import Path

import torch

from common import Recorder

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: offline.py's driver of transformers' CB
from offline import hf_cb_collect  # noqa: E402

SYSTEMS = ("slipstream-eager", "slipstream-graphs", "hf-cb")


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_slipstream(args, workload, warm) -> dict:
    from slipstream.server.engine import LLM, SamplingParams

    kv = dict(kv_cache_memory_bytes=args.kv_mib << 20) if args.kv_mib else {}  # None: gpu_memory_utilization
    llm = LLM(model=str(args.model), device=args.device, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, enforce_eager=args.system == "slipstream-eager", **kv)

    def generate(reqs):
        params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in reqs]
        return [len(o.outputs[0].token_ids) for o in llm.generate([r.prompt for r in reqs], params)]

    generate(warm)
    sync(args.device)
    steps0 = llm.engine.num_steps
    t0 = time.perf_counter()
    counts = generate(workload)
    sync(args.device)
    return {"wall_s": time.perf_counter() - t0, "output_tokens": sum(counts), "steps": llm.engine.num_steps - steps0,
            "kv_blocks": llm.engine.kv.num_blocks}


def run_hf_cb(args, workload, warm) -> dict:
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model = AutoModelForCausalLM.from_pretrained(str(args.model), dtype=getattr(torch, args.dtype)).to(args.device).eval()
    # Only the fields transformers 5.17 and later share (5.24 renamed block_size to page_size).
    known = inspect.signature(ContinuousBatchingConfig).parameters
    cb = ContinuousBatchingConfig(**{k: v for k, v in dict(max_batch_tokens=args.max_num_batched_tokens,
                                                           max_requests_per_batch=args.max_num_seqs).items() if k in known})
    gen = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=16)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    manager.start()

    def collect(reqs, tag):
        return hf_cb_collect(manager, reqs, tag)

    try:
        with torch.inference_mode():
            collect(warm, "warm")
            sync(args.device)
            t0 = time.perf_counter()
            counts = collect(workload, "req")
            sync(args.device)
            wall = time.perf_counter() - t0
    finally:
        manager.stop(block=True, timeout=30)
        model.destroy_cached_continuous_batching_manager()
    return {"wall_s": wall, "output_tokens": sum(counts)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--system", choices=SYSTEMS, required=True)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--kv-mib", type=int, default=0, help="engine KV cache, MiB; 0: sized from gpu_memory_utilization")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    from slipstream.server.bench.workload import make_workload

    workload = make_workload(args.requests, seed=args.seed, max_output=args.max_output)
    warm = make_workload(4, seed=args.seed + 1, max_output=8, prompt_range=(16, 32))
    rec = Recorder(args.json, system=args.system, device=args.device, dtype=args.dtype, requests=len(workload),
                   prompt_tokens=sum(len(r.prompt) for r in workload), expected_output_tokens=sum(r.max_tokens for r in workload))
    res = (run_hf_cb if args.system == "hf-cb" else run_slipstream)(args, workload, warm)
    res["output_tok_s"] = res["output_tokens"] / res["wall_s"]
    for k, v in res.items():
        rec.set(k, v)
    print(f"{args.system}: {res['output_tokens']} output tokens in {res['wall_s']:.1f} s = "
          f"{res['output_tok_s']:.0f} tok/s", flush=True)
    return 0 if res["output_tokens"] == rec.data["expected_output_tokens"] else 1


if __name__ == "__main__":
    sys.exit(main())
