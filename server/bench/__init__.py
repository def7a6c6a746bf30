"""``slipstream bench``: measure slipstream on its own, as ``vllm bench`` does.

- ``slipstream bench throughput``: a seeded workload (:mod:`.workload`) through the offline
  engine to completion; requests/s, tokens/s, steps, preemptions, KV-cache utilization.
- ``slipstream bench serve``: the same workload streamed to a running server (slipstream or any
  OpenAI-compatible one that honours ``ignore_eos``) at a Poisson request rate; throughput,
  TTFT, ITL and end-to-end latency percentiles.

Side-by-side runs against transformers and llama.cpp live in the repository's ``benchmarks/``.
"""
from __future__ import annotations

import argparse
import sys

from ..cli import HelpFormatter


def main(argv: list[str] | None = None) -> int:
    from . import serve, throughput

    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="slipstream bench", description="Measure slipstream on its own: offline engine throughput, or a running "
                                            "server's latency and throughput under load.",
                                formatter_class=HelpFormatter)
    sub = p.add_subparsers(dest="command", metavar="{throughput,serve}", required=True)
    throughput.add_parser(sub)
    serve.add_parser(sub)
    args = p.parse_args(argv)
    return args.run(args)
