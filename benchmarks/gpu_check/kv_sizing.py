"""KV-cache sizing with the defaults: what the engine logs about its KV cache, captured.

Builds ``LLM(model=DIR)`` with no ``kv_cache_memory_bytes`` (so on CUDA the pool is what
``gpu_memory_utilization`` 0.9 leaves after weights, activations and CUDA-graph pools), and
records every ``slipstream.*`` log line at INFO or above, the pool's block count and size, and
the device's memory (bytes) before and after. Run it last: the engine keeps 90% of the GPU.

Usage: ``python kv_sizing.py --model DIR [--json F]``.
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

from common import Recorder


class ListHandler(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.name}: {record.getMessage()}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    from slipstream.server.engine import LLM

    handler = ListHandler()
    root = logging.getLogger("slipstream")
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    cuda = args.device == "cuda"
    rec = Recorder(args.json, device=args.device, model=args.model.name)
    if cuda:
        free, total = torch.cuda.mem_get_info()
        rec.set("device_memory_before", {"free": free, "total": total})
    llm = LLM(model=str(args.model), device=args.device)
    kv = llm.engine.kv
    cfg = llm.engine.config
    rec.set("gpu_memory_utilization", cfg.gpu_memory_utilization)
    rec.set("num_blocks", kv.num_blocks)
    rec.set("block_size", kv.block_size)
    rec.set("kv_cache_bytes", llm.engine.runner.kv_cache.numel() * llm.engine.runner.kv_cache.element_size())
    rec.set("max_model_len", llm.engine.max_model_len)
    if cuda:
        free, total = torch.cuda.mem_get_info()
        rec.set("device_memory_after", {"free": free, "total": total,
                                        "used_fraction": round(1 - free / total, 3),
                                        "max_allocated": torch.cuda.max_memory_allocated()})
    rec.set("log", handler.lines)
    rec.set("kv_log_line", next((line for line in handler.lines if "KV cache" in line), None))
    print("\n".join(handler.lines))
    return 0 if rec.data["kv_log_line"] else 1


if __name__ == "__main__":
    sys.exit(main())
