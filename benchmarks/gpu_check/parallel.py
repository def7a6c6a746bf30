"""Tensor parallelism on the GPU machine: the engine over ``--tensor`` ranks (NCCL, one GPU each)
against one process on the same weights, greedy, token by token per prompt.

With fewer GPUs than ranks (the lent machines have one) it records why it did not run and exits
0: the stage is ready for a multi-GPU machine. Without CUDA it rehearses over gloo on the CPU in
fp32, where the tokens must be equal (exit 1 otherwise); on GPUs in bf16 a difference in
summation order may flip a near-tied token, so the first divergence is recorded, not failed.

Usage: ``python parallel.py --model DIR [--tensor 2] [--json F]``.
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

from common import Recorder, first_divergence

PROMPTS = [[17 + (i * 31 + j * 7) % 900 for j in range(12 + 9 * i)] for i in range(6)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--tensor", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--kv-mib", type=int, default=256)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", "bfloat16") if cuda else ("cpu", "float32")
    rec = Recorder(args.json, device=device, dtype=dtype, tensor=args.tensor, model=args.model.name)
    if cuda and torch.cuda.device_count() < args.tensor:
        rec.set("skipped", f"needs {args.tensor} GPUs, found {torch.cuda.device_count()}")
        print(rec.data["skipped"])
        return 0
    from slipstream.server.engine import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    settings = dict(model=str(args.model), device=device, dtype=dtype, kv_cache_memory_bytes=args.kv_mib << 20)
    one = LLM(**settings)
    want = [o.outputs[0].token_ids for o in one.generate(PROMPTS, params)]
    del one
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    started = time.perf_counter()
    many = LLM(tensor_parallel_size=args.tensor, **settings)
    rec.set("start_s", round(time.perf_counter() - started, 1))
    try:
        got = [o.outputs[0].token_ids for o in many.generate(PROMPTS, params)]
    finally:
        many.engine.close()
    diverge = [first_divergence(g, w) for g, w in zip(got, want)]
    rec.set("prompts", len(PROMPTS))
    rec.set("equal", sum(d is None for d in diverge))
    rec.set("first_divergence", diverge)
    print(f"tensor {args.tensor} on {device} in {dtype}: {rec.data['equal']}/{len(PROMPTS)} prompts token-equal "
          f"to one process")
    return 0 if cuda or rec.data["equal"] == len(PROMPTS) else 1


if __name__ == "__main__":
    sys.exit(main())
