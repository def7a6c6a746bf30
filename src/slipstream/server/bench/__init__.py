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
    from .options import check_writable

    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="slipstream bench", formatter_class=HelpFormatter,
                                description="Measure slipstream on its own: offline engine throughput, or a running "
                                            "server's latency and throughput under load.")
    sub = p.add_subparsers(dest="command", metavar="{throughput,serve}", required=True)
    throughput.add_parser(sub)
    serve.add_parser(sub)
    args, unknown = p.parse_known_args(argv)
    if unknown:  # reported by the subcommand's parser, with its usage
        args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        check_writable(args.output_json)
    except OSError as exc:
        args.parser.error(f"cannot write --output-json {args.output_json}: {exc.strerror or exc}")
    try:
        return args.run(args)
    except KeyboardInterrupt:
        print(f"slipstream bench {args.command}: interrupted", file=sys.stderr)
        return 130
