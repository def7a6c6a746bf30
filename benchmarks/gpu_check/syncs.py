"""Host syncs per decode step, counted with torch's CUDA sync debug mode.

``torch.cuda.set_sync_debug_mode("warn")`` makes every synchronizing CUDA call (``.item()``,
``.tolist()``, a device→host copy, ``nonzero``, …) warn with the Python line that made it. With it
on around ``--steps`` engine steps in which every running request decodes (no prefill), the
warnings per step are the engine's host syncs per decode step; the target (issue 14) is one: the
device→host copy of the sampled ids. Lines are reported with their counts. Eager and CUDA-graph
engines are counted separately. CUDA only.

Usage: ``python syncs.py --model DIR [--requests 32] [--steps 8] [--json F]``.
"""
from __future__ import annotations

import argparse
import collections
import sys
import warnings
from pathlib import Path

import torch

from common import Recorder


def count_syncs(args, enforce_eager: bool) -> dict:
    from slipstream.server.engine import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(EngineConfig(model=str(args.model), device="cuda", dtype=args.dtype, max_num_seqs=args.requests,
                                    kv_cache_memory_bytes=args.kv_mib << 20, enforce_eager=enforce_eager))
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 64, ignore_eos=True)
    for i in range(args.requests):
        engine.add_request([17 + (i * 7 + j) % 1000 for j in range(48)], params)
    for _ in range(32):  # until every request decodes (prompts prefilled, nothing waiting)
        engine.step()
        if not engine.scheduler.waiting and all(r.num_output_tokens for r in engine.scheduler.running):
            break
    engine.step()  # one decode step before counting: any first-decode set-up stays out
    torch.cuda.synchronize()
    sites: collections.Counter = collections.Counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(args.steps):
                engine.step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    for w in caught:
        if "synchroniz" in str(w.message):
            sites[f"{Path(w.filename).name}:{w.lineno}: {str(w.message).splitlines()[0][:80]}"] += 1
    for rid in list(engine.groups):
        engine.abort(rid)
    total = sum(sites.values())
    return {"steps": args.steps, "syncs": total, "syncs_per_step": total / args.steps,
            "sites": dict(sites.most_common())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--kv-mib", type=int, default=2048)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    rec = Recorder(args.json, requests=args.requests, target_syncs_per_step=1)
    if not torch.cuda.is_available():
        rec.set("skipped", "no CUDA")
        return 0
    for name, eager in (("eager", True), ("graphs", False)):
        res = count_syncs(args, eager)
        rec.set(name, res)
        print(f"{name}: {res['syncs_per_step']:.1f} syncs per decode step", flush=True)
        for site, n in res["sites"].items():
            print(f"  {n:4d}  {site}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
