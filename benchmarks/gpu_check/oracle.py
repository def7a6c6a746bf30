"""GPU oracle: the engine's greedy tokens against transformers' on the same random-weight Llama.

For each model directory (see ``models.py``) and dtype, transformers' ``generate`` (one prompt at
a time, greedy, exactly ``--max-tokens`` new tokens) is the reference; the engine (``LLM`` over
the same directory, ``ignore_eos``) runs the same prompts in six ways:

- ``alone``: one prompt at a time;
- ``batched``: all in one batch;
- ``chunked``: a step budget (``max_num_batched_tokens``) below the longest prompt, so prompts
  are prefilled in chunks beside decode rows;
- ``preempted``: a KV cache of a few blocks more than the longest request, so requests are
  preempted and recomputed (asserted from the engine's ``num_preemptions_total``);
- ``prefix``: half the prompts share a 64-token prefix; one runs first, the others then hit the
  prefix cache (asserted from ``prefix_cache_hits_total``);
- ``graphs``: the default engine (CUDA graphs for decode) against ``enforce_eager=True``, both
  batched (on CPU both are eager).

The other engines run with ``enforce_eager=True``. In fp32 every comparison must be equal (exit
status 1 otherwise); in bf16 the near-tied logits of random weights flip early, so each result
gives the first diverging token index per prompt and their median instead.

Usage: ``python oracle.py --models DIR[,DIR] [--device cuda] [--dtypes float32,bfloat16] [--json F]``.
"""
from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from pathlib import Path

import torch

from common import Recorder, compare

PREFIX_TOKENS = 64  # four 16-token blocks
FIRST_ID = 17  # below are the tokenizer's special tokens


def make_prompts(n: int, vocab: int, long_len: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """``n`` prompts of random token ids and the indices of those sharing a prefix.

    The first half has lengths around block boundaries and one of ``long_len`` tokens; the second
    half is a common :data:`PREFIX_TOKENS`-token prefix plus 3–40 tokens of its own.
    """
    rng = random.Random(seed)
    ids = lambda k: [rng.randrange(FIRST_ID, vocab) for _ in range(k)]  # noqa: E731
    lengths = [long_len, 5, 16, 17, 33, 100, 250, 47]
    half = max(1, n // 2)
    prompts = [ids(lengths[i % len(lengths)]) for i in range(half)]
    prefix = ids(PREFIX_TOKENS)
    prompts += [prefix + ids(rng.randint(3, 40)) for _ in range(n - half)]
    return prompts, list(range(half, n))


def hf_reference(path: str, prompts: list[list[int]], max_tokens: int, device: str, dtype: torch.dtype) -> list[list[int]]:
    """transformers' greedy ``generate``, one prompt at a time: ``max_tokens`` ids per prompt."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                              min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
            out.append(gen[0, len(p):].tolist())
    del hf
    return out


def free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def run_model(path: str, args, rec: Recorder, key: str) -> bool:
    """All comparisons for one model directory and dtype; returns whether the required ones held."""
    from slipstream.server.engine import LLM, SamplingParams
    from slipstream.server.models.loader import load_model

    dtype = getattr(torch, args.dtype_name)
    required = args.dtype_name == "float32"
    t0 = time.perf_counter()
    loaded = load_model(path, torch.device(args.device), dtype)
    cfg = loaded.config
    prompts, shared = make_prompts(args.prompts, cfg.vocab_size, args.long_prompt)
    want = hf_reference(path, prompts, args.max_tokens, args.device, dtype)
    free(args.device)
    result = {"required_equal": required, "prompts": len(prompts), "max_tokens": args.max_tokens,
              "reference_seconds": round(time.perf_counter() - t0, 1)}
    rec.set(key, result)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    elem = torch.finfo(dtype).bits // 8
    longest = max(map(len, prompts)) + args.max_tokens
    base = dict(device=args.device, dtype=args.dtype_name, enforce_eager=True, max_num_seqs=len(prompts),
                max_num_batched_tokens=4096, kv_cache_memory_bytes=args.kv_mib << 20)

    def engine(**overrides):
        return LLM(model=path, loaded=loaded, **{**base, **overrides})

    def tokens(outs):
        return [o.outputs[0].token_ids for o in outs]

    ok = True

    def record(mode: str, got, want_, **extra):
        nonlocal ok
        res = {**compare(got, want_, args.max_tokens), **extra}
        ok &= res["equal"] or not required
        result[mode] = res
        rec.set(key, result)
        print(f"{key} {mode}: equal={res['equal']} median first divergence {res['median_first_divergence']} {extra}",
              flush=True)

    llm = engine()
    record("alone", [tokens(llm.generate(p, greedy))[0] for p in prompts], want)
    del llm
    llm = engine()
    batched = tokens(llm.generate(prompts, greedy))
    record("batched", batched, want)
    del llm
    budget = max(16, args.long_prompt // 4)
    llm = engine(max_num_batched_tokens=budget)
    record("chunked", tokens(llm.generate(prompts, greedy)), want, max_num_batched_tokens=budget)
    del llm
    blocks = -(-longest // 16) + args.preempt_spare_blocks
    llm = engine(kv_cache_memory_bytes=blocks * 16 * cfg.kv_bytes_per_token(elem))
    got = tokens(llm.generate(prompts, greedy))
    preemptions = llm.engine.stats().num_preemptions_total
    record("preempted", got, want, num_blocks=llm.engine.kv.num_blocks, preemptions=preemptions)
    if preemptions == 0:
        ok = False
        result["preempted"]["error"] = "no preemption happened: the cache was meant to be too small"
    del llm
    llm = engine()
    first = tokens(llm.generate(prompts[shared[0]], greedy))
    rest = [i for i in range(len(prompts)) if i != shared[0]]
    others = dict(zip(rest, tokens(llm.generate([prompts[i] for i in rest], greedy))))
    hits = llm.engine.stats().prefix_cache_hits_total
    record("prefix", [first[0] if i == shared[0] else others[i] for i in range(len(prompts))], want,
           prefix_cache_hits_tokens=hits)
    if hits == 0:
        ok = False
        result["prefix"]["error"] = "no prefix-cache hit: the shared prefix was meant to be cached"
    del llm
    free(args.device)
    t1 = time.perf_counter()
    llm = engine(enforce_eager=False)
    graphs = tokens(llm.generate(prompts, greedy))
    record("graphs", graphs, batched, vs="eager batched", seconds_with_capture=round(time.perf_counter() - t1, 1))
    del llm
    loaded = None  # the weights go before the next model is loaded
    free(args.device)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    result["ok"] = ok
    rec.set(key, result)
    return ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", required=True, help="comma-separated model directories")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--long-prompt", type=int, default=300, help="tokens of the longest prompt")
    p.add_argument("--kv-mib", type=int, default=2048, help="KV cache of each engine but the preempted one, MiB")
    p.add_argument("--preempt-spare-blocks", type=int, default=2,
                   help="KV blocks beyond the longest request's in the preempted engine")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    rec = Recorder(args.json, device=args.device)
    ok = True
    for path in args.models.split(","):
        for dtype_name in args.dtypes.split(","):
            args.dtype_name = dtype_name
            ok &= run_model(path, args, rec, f"{Path(path).name}/{dtype_name}")
    rec.set("ok", ok)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
