"""``slipstream bench serve``: a seeded workload streamed to a running OpenAI-compatible server.

Requests arrive as a Poisson process at ``--request-rate`` (``inf``: all at once), each a
streaming ``/v1/completions`` call with a token-id prompt and ``ignore_eos``. Prints the output
throughput and TTFT, inter-token latency and end-to-end percentiles.
"""
from __future__ import annotations

import argparse
import asyncio
import os

from ..cli import HelpFormatter
from .client import run_rate
from .options import add_workload_arguments, workload_settings, write_json
from .workload import FIRST_ORDINARY_ID, describe, make_workload

BUILTIN_VOCAB = 49152  # SmolLM2's


def _rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 requests/s (or inf), got {text}")
    return value


def _vocab(text: str) -> int:
    value = int(text)
    if value <= FIRST_ORDINARY_ID:
        raise argparse.ArgumentTypeError(f"must be > {FIRST_ORDINARY_ID} (ids below it are special tokens), got {value}")
    return value


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="load a running server and measure latency and throughput",
                       description=__doc__.split("\n\n")[1].replace("\n", " ").replace("``", ""),
                       formatter_class=HelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server, without /v1")
    p.add_argument("--model", default=None, help="'model' sent with each request (default: none, the server's own)")
    p.add_argument("--api-key", default=os.environ.get("SLIPSTREAM_API_KEY"),
                   help="sent as 'Authorization: Bearer KEY' (default: $SLIPSTREAM_API_KEY)")
    p.add_argument("--request-rate", type=_rate, default=float("inf"),
                   help="requests per second, Poisson arrivals; inf sends all at once (default: inf)")
    p.add_argument("--vocab-size", type=_vocab, default=BUILTIN_VOCAB,
                   help="prompt token ids are drawn below this: the served model's vocabulary size")
    add_workload_arguments(p)
    p.set_defaults(run=run, parser=p)


def run(args: argparse.Namespace) -> int:
    workload = make_workload(args.num_requests, args.workload_seed, args.vocab_size, args.max_output, args.prompt_len)
    url = args.base_url.rstrip("/")
    print(f"workload (seed {args.workload_seed}): {describe(workload)}; {args.request_rate:g} requests/s to {url}",
          flush=True)
    r = asyncio.run(run_rate(url, workload, args.request_rate, args.workload_seed, model=args.model,
                             api_key=args.api_key))
    write_json(args.output_json, {
        "requests": r["requests"], "completed": r["completed"], "output_tokens": r["output_tokens"],
        "expected_output_tokens": r["expected_tokens"], "elapsed_s": r["duration"],
        "output_tokens_per_s": r["tok_s"], "ttft_p50_s": r["ttft_p50"], "ttft_p99_s": r["ttft_p99"],
        "itl_p50_s": r["itl_p50"], "itl_p99_s": r["itl_p99"], "e2e_p50_s": r["e2e_p50"], "errors": r["errors"],
        "base_url": url, "request_rate": args.request_rate, **workload_settings(args)})
    print(f"completed: {r['completed']}/{r['requests']} requests, {r['output_tokens']}/{r['expected_tokens']} "
          f"output tokens")
    for error in r["errors"]:
        print(f"error: {error}")
    if r["completed"]:
        print(f"Throughput: {r['tok_s']:.1f} output tokens/s ({r['duration']:.1f} s from the first send to the "
              f"last token)")
        print(f"TTFT p50 {1000 * r['ttft_p50']:.1f} ms, p99 {1000 * r['ttft_p99']:.1f} ms; ITL p50 "
              f"{1000 * r['itl_p50']:.1f} ms, p99 {1000 * r['itl_p99']:.1f} ms; e2e p50 {r['e2e_p50']:.2f} s")
    return 0 if r["completed"] == r["requests"] else 1
