"""One quantized product per GGML type, side by side with the fp32 product it replaces.

``kernels/ggml_cpu.c``'s ``ggml_matmul`` for each type it serves as stored (Q4_0, Q4_1, Q8_0,
Q4_K, Q5_K, Q6_K) against ``torch.nn.functional.linear`` on the same weights dequantized to fp32
(what ``--quantization none`` runs), on one [N, K] weight of random normal values quantized by the
gguf package (32-weight types) or by ``tests/kquants.py`` (K-quants; gguf cannot quantize those).
Each product reads its weight from memory (copies of it, 1 GiB in all, more than the last-level cache, cycled through, as a decode
step streams a model's layers). Per type and number of activation rows: µs per product (best of
5 passes), GB/s of weight bytes read, and the time relative to Q4_1 (the built-in model's type) and to fp32.

Usage: ``python benchmarks/quant_kernels.py [--n 2048] [--k 1024] [--rows 1,8] [--threads 1]
[--stream-mib 1024] [--runs 5]``.
K must be a multiple of 256 for the K-quants. Not part of ``make test``.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(_HERE), "tests"))  # the K-quant encoder

import gguf  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from kquants import quantize as quantize_k  # noqa: E402

from slipstream.kernels import cpu_native, ggml_cpu  # noqa: E402

TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


def blocks(w: np.ndarray, qtype: str) -> torch.Tensor:
    """w [N, K] fp32 quantized to ``qtype``: uint8 [N, row_bytes]."""
    if qtype.endswith("_K"):
        q = np.ascontiguousarray(quantize_k(w, qtype))
    else:
        q = gguf.quantize(w, getattr(gguf.GGMLQuantizationType, qtype))
    return torch.from_numpy(q).view(torch.uint8).reshape(w.shape[0], -1)


STREAM_BYTES = 1 << 30  # copies of a weight cycled through, so each product reads from memory, not cache


def copies(t: torch.Tensor, total: int = STREAM_BYTES) -> list[torch.Tensor]:
    """Enough copies of ``t`` to fill ``total`` bytes (at least 2)."""
    n = max(2, -(-total // (t.numel() * t.element_size())))
    return [t.clone() for _ in range(n)]


def best_of(fn, weights: list[torch.Tensor], runs: int = 5) -> float:
    """Seconds per ``fn(weight)``: the best of ``runs`` passes over every copy in ``weights``."""
    fn(weights[0])
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        for wt in weights:
            fn(wt)
        best = min(best, (time.perf_counter() - t0) / len(weights))
    return best


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=2048, help="weight rows (output features)")
    p.add_argument("--k", type=int, default=1024, help="weight columns (input features), a multiple of 256")
    p.add_argument("--rows", default="1,8", help="activation rows per product, comma-separated")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--stream-mib", type=float, default=STREAM_BYTES / 2**20,
                   help="MiB of weight copies cycled through (default 1024: from memory; e.g. 8: from cache, "
                        "the kernel's own work)")
    p.add_argument("--runs", type=int, default=5, help="passes over the copies; the best one counts")
    args = p.parse_args()
    total = int(args.stream_mib * 2**20)
    torch.set_num_threads(args.threads)
    w = (np.random.default_rng(0).standard_normal((args.n, args.k)) * 0.02).astype(np.float32)
    cpu_native.require()  # the path in use, for the header (SLIPSTREAM_CPU_ISA forces one)
    print(f"{cpu_native.cpu_model()}, the {cpu_native.loaded_isa()} path; weight [{args.n}, {args.k}], "
          f"{args.threads} thread(s), {args.stream_mib:g} MiB of copies, best of {args.runs} passes, "
          f"torch {torch.__version__}")
    print("| type | bits/weight | rows | µs/product | weight GB/s | ÷ Q4_1 | ÷ fp32 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    dense = torch.from_numpy(w)
    stored = {qtype: blocks(w, qtype) for qtype in TYPES}  # quantized once, for every row count
    for m in (int(r) for r in args.rows.split(",")):
        x = torch.randn(m, args.k)
        fp32 = best_of(lambda d: torch.nn.functional.linear(x, d), copies(dense, total), args.runs)
        times = {qtype: best_of(lambda q: ggml_cpu.matmul(x, q, qtype, args.k), copies(b, total), args.runs)
                 for qtype, b in stored.items()}
        nbytes = {qtype: b.numel() for qtype, b in stored.items()}
        for qtype in TYPES:
            bits = 8 * nbytes[qtype] / w.size
            print(f"| {qtype} | {bits:.2f} | {m} | {1e6 * times[qtype]:.0f} | {nbytes[qtype] / times[qtype] / 1e9:.2f} | "
                  f"{times[qtype] / times['Q4_1']:.2f} | {times[qtype] / fp32:.2f} |")
        print(f"| fp32 (torch) | 32 | {m} | {1e6 * fp32:.0f} | {w.nbytes / fp32 / 1e9:.2f} | "
              f"{fp32 / times['Q4_1']:.2f} | 1.00 |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
