"""Decode attention against the memory-bandwidth roofline, and engine throughput, on a CUDA device.

Decode attention is memory-bound: each step reads every request's whole KV context once. Its
roofline time is ``(bytes of K/V and Q read + bytes of O written) / device bandwidth``; the table
prints the Triton kernel's time, the torch reference's, and the fraction of that roofline the
kernel reaches (issue 4's target: ≥ 70% at batch ≥ 32 and context ≥ 4k). Bandwidth is measured
with a large device-to-device copy (what the memory system sustains) and shown next to the
datasheet figure where the device is known.

The engine part builds a random-weight, Llama-3.2-1B-shaped model on the device (with the
built-in model's tokenizer) and times ``LLM.generate`` with attention through Triton and
through the torch reference.

Usage: ``python benchmarks/kernels.py [--batches 1,32,256] [--contexts 512,4096,32768] [--no-engine]``.
Without a CUDA device it prints ``no CUDA device: skipped`` and exits 0.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

# Datasheet HBM bandwidth, bytes/s, by a substring of torch.cuda.get_device_name().
SPEC_BANDWIDTH = {
    "H200": 4.8e12, "H100 NVL": 3.9e12, "H100 PCIe": 2.0e12, "H100": 3.35e12,
    "A100-SXM4-80GB": 2.039e12, "A100 80GB PCIe": 1.935e12, "A100": 1.555e12,
    "L40S": 0.864e12, "L4": 0.3e12, "A10": 0.6e12, "RTX 4090": 1.008e12, "RTX 3090": 0.936e12,
    "V100": 0.9e12, "T4": 0.32e12,
}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# What --json writes: the decode table's rows (times µs, bandwidth TB/s, fraction of the roofline 0..1).
RESULT: dict = {"rows": []}


def spec_bandwidth(name: str) -> float | None:
    for key, bw in SPEC_BANDWIDTH.items():
        if key in name:
            return bw
    return None


def measured_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes/s of a device-to-device copy (read + write), best of several."""
    from triton.testing import do_bench
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=10, rep=100, return_mode="min")
    return 2 * nbytes / (ms * 1e-3)


def decode_batch(batch: int, context: int, args, device: torch.device):
    """Caches, queries and metadata for ``batch`` decode rows of ``context`` tokens each, with
    shuffled block tables (a fragmented pool, as after hours of serving)."""
    from slipstream.kernels import AttentionMetadata
    dtype = DTYPES[args.dtype]
    blocks_per_seq = -(-context // args.block_size)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, args.block_size, args.num_kv_heads, args.head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn(shape, dtype=dtype, device=device)
    tables = torch.randperm(num_blocks, device=device, dtype=torch.int32).view(batch, blocks_per_seq)
    last = context - 1
    meta = AttentionMetadata(
        slot_mapping=tables[:, last // args.block_size].long() * args.block_size + last % args.block_size,
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
        block_tables=tables, max_query_len=1, max_seq_len=context)
    query = torch.randn(batch, args.num_heads, args.head_dim, dtype=dtype, device=device)
    return query, k_cache, v_cache, meta


def bench_decode(args, device: torch.device) -> None:
    from triton.testing import do_bench

    from slipstream.kernels import reference, triton_attention

    name = torch.cuda.get_device_name(device)
    measured, spec = measured_bandwidth(device), spec_bandwidth(name)
    bandwidth = spec if args.bandwidth == "spec" and spec else measured
    elem = torch.finfo(DTYPES[args.dtype]).bits // 8
    RESULT.update(device=name, copy_bandwidth_tbps=measured / 1e12, roofline_bandwidth_tbps=bandwidth / 1e12,
                  header_line=f"device: {name}; copy bandwidth {measured / 1e12:.2f} TB/s, roofline at {bandwidth / 1e12:.2f} TB/s")
    print(f"device: {name}; copy bandwidth {measured / 1e12:.2f} TB/s"
          + (f", datasheet {spec / 1e12:.2f} TB/s" if spec else "")
          + f"; roofline uses {'datasheet' if bandwidth == spec else 'measured'} {bandwidth / 1e12:.2f} TB/s")
    print(f"decode: {args.num_heads} query heads, {args.num_kv_heads} KV heads, head_dim {args.head_dim}, "
          f"{args.dtype}, block size {args.block_size}; times are medians, L2 flushed between runs\n")
    print("| batch | context | KV+Q+O MiB | Triton µs | Triton TB/s | of roofline | torch µs | speedup |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    target = []
    for batch in args.batches:
        for context in args.contexts:
            kv_bytes = 2 * batch * context * args.num_kv_heads * args.head_dim * elem
            qo_bytes = 2 * batch * args.num_heads * args.head_dim * elem
            free = torch.cuda.mem_get_info(device)[0]
            if kv_bytes * 1.1 > free:
                print(f"| {batch} | {context} | {(kv_bytes + qo_bytes) / 2**20:.0f} | skipped: needs "
                      f"{kv_bytes / 2**30:.1f} GiB | | | | |")
                continue
            query, k_cache, v_cache, meta = decode_batch(batch, context, args, device)
            scale = args.head_dim ** -0.5
            ms = do_bench(lambda: triton_attention.paged_attention(query, k_cache, v_cache, meta, scale),
                          warmup=10, rep=args.rep)
            frac = (kv_bytes + qo_bytes) / bandwidth / (ms * 1e-3)
            if batch >= 32 and context >= 4096:
                target.append(frac)
            # The reference gathers the context and upcasts it to fp32: ~6x the cache's bytes.
            ref_cell, speedup = "skipped (memory)", ""
            if not args.no_reference and kv_bytes * 7 < torch.cuda.mem_get_info(device)[0]:
                ref_ms = do_bench(lambda: reference.paged_attention(query, k_cache, v_cache, meta, scale),
                                  warmup=3, rep=args.rep)
                ref_cell, speedup = f"{ref_ms * 1e3:.0f}", f"{ref_ms / ms:.1f}x"
            RESULT["rows"].append(dict(batch=batch, context=context, mib=round((kv_bytes + qo_bytes) / 2**20),
                                       us=round(ms * 1e3, 1), tbps=round((kv_bytes + qo_bytes) / (ms * 1e-3) / 1e12, 2),
                                       fraction=round(frac, 3), ref_us=ref_cell, speedup=speedup))
            print(f"| {batch} | {context} | {(kv_bytes + qo_bytes) / 2**20:.0f} | {ms * 1e3:.1f} | "
                  f"{(kv_bytes + qo_bytes) / (ms * 1e-3) / 1e12:.2f} | {frac:.0%} | {ref_cell} | {speedup} |")
            del query, k_cache, v_cache, meta
            torch.cuda.empty_cache()
    if target:
        verdict = "met" if min(target) >= 0.7 else "NOT met"
        RESULT.update(target_fraction=0.7, lowest_fraction_at_target=min(target), target_met=min(target) >= 0.7,
                      target_line=f"target ≥ 70% of roofline at batch ≥ 32, context ≥ 4k: {verdict} (lowest {min(target):.0%})")
        print(f"\ntarget ≥ 70% of roofline at batch ≥ 32, context ≥ 4k: {verdict} (lowest {min(target):.0%})")


def random_llama_1b(device: torch.device, dtype: torch.dtype):
    """A Llama-3.2-1B-shaped model with random weights, sized to the built-in tokenizer's vocabulary."""
    from slipstream.server.models.config import ModelConfig
    from slipstream.server.models.llama import LlamaModel
    from slipstream.server.models.loader import LoadedModel, load_model

    if os.environ.get("SLIPSTREAM_TOKENIZER_DIR"):  # the GPU machine has no GGUF: gpu_check carries the files
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(os.environ["SLIPSTREAM_TOKENIZER_DIR"])
    else:
        tokenizer = load_model("builtin", torch.device("cpu"), torch.float32).tokenizer
    cfg = ModelConfig(architecture="llama", vocab_size=len(tokenizer), hidden_size=2048,
                      intermediate_size=8192, num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
                      rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192,
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    with torch.device(device):
        net = LlamaModel(cfg)
    net.to(dtype).eval()
    params = sum(p.numel() for p in net.parameters())
    return LoadedModel(net, cfg, tokenizer, f"random-llama-{params / 1e9:.2f}B", "random"), params


def bench_engine(args, device: torch.device) -> None:
    try:
        from slipstream.server.engine import LLM, SamplingParams
    except ImportError as exc:
        sys.exit(f"engine benchmark needs slipstream.server.engine.LLM, which is missing ({exc}); "
                 "run with --no-engine")
    loaded, params = random_llama_1b(device, DTYPES[args.dtype])
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, loaded.config.vocab_size, (args.prompt_len,), generator=gen).tolist()
               for _ in range(args.requests)]
    sampling = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    print(f"\nengine: {loaded.name} ({params / 1e9:.2f}B parameters, random weights, {args.dtype}), "
          f"{args.requests} requests x {args.prompt_len} prompt + {args.output_len} output tokens\n")
    print("| attention | wall s | output tok/s | total tok/s |")
    print("|---|---:|---:|---:|")
    for mode in ("triton", "torch"):
        os.environ["SLIPSTREAM_ATTENTION"] = mode
        llm = LLM(loaded=loaded, device=device.type, dtype=args.dtype, max_num_seqs=args.requests,
                  max_num_batched_tokens=8192, kv_cache_memory_bytes=args.kv_gib << 30,
                  enable_prefix_caching=False)
        llm.generate(prompts[:4], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))  # compile
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        outs = llm.generate(prompts, sampling)
        torch.cuda.synchronize(device)
        wall = time.perf_counter() - start
        out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        print(f"| {mode} | {wall:.1f} | {out_tokens / wall:.0f} | "
              f"{(out_tokens + args.requests * args.prompt_len) / wall:.0f} |")
        del llm
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=ints, default=[1, 32, 256])
    p.add_argument("--contexts", type=ints, default=[512, 4096, 32768])
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    p.add_argument("--bandwidth", choices=["measured", "spec"], default="measured",
                   help="roofline bandwidth: a device copy's, or the datasheet's (when the device is known)")
    p.add_argument("--rep", type=int, default=100, help="milliseconds of repetitions per timing")
    p.add_argument("--no-reference", action="store_true", help="skip timing the torch reference")
    p.add_argument("--no-engine", action="store_true", help="skip the engine throughput part")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--kv-gib", type=int, default=32, help="GiB for the engine's KV cache")
    p.add_argument("--json", default=None, help="also write the decode table as JSON to this file")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: skipped")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"skipped": "no CUDA"}, f)
        return 0
    device = torch.device("cuda", torch.cuda.current_device())
    bench_decode(args, device)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(RESULT, f, indent=1)
    if not args.no_engine:
        bench_engine(args, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
