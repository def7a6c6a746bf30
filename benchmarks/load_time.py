"""Start-up: seconds from launching ``slipstream serve`` to ready, beside llama.cpp's llama-server.

Each system is started ``--runs`` times on the same GGUF (the built-in SmolLM2-135M-Instruct Q4_1
unless ``--model``), alternating, and timed from ``Popen`` to its readiness answering 200
(slipstream ``/ready``: model loaded and KV cache allocated; llama-server ``/health``), polled every
20 ms; imports included. slipstream runs twice per round on a fresh ``SLIPSTREAM_CACHE_DIR``
holding only the compiled CPU kernels (which ``make install`` builds): a **first load** (GGUF
index, tokenizer conversion and CPU crossovers still to do) and a **later load** (all cached).
llama-server keeps no cache. The GGUF file is in the page cache for both after the first round.
The table gives medians, and for slipstream the loader's own phase times from its log (median).

llama-server is online.py's (``benchmarks/out/llama-venv``), restarted with ``--no-repack`` where
its AMX kernels fault (see online.py). Loopback only. Not part of ``make test``.

Usage: ``python benchmarks/load_time.py [--runs 5] [--model GGUF] [--threads N]``.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

_HERE = Path(__file__).resolve().parent

PHASES = {  # slipstream log line -> phase name
    r"read \d+ GGUF tensors in ([\d.]+) s": "GGUF tensors",
    r"tokenizer converted in ([\d.]+) s": "tokenizer conversion",
    r"loaded \S+ in ([\d.]+) s": "model load (all)",
    r"crossovers .*measured in ([\d.]+) s": "CPU crossovers",
}


def _online():
    import online  # beside this file
    return online


def time_to_ready(cmd: list[str], url: str, log_path: Path, env: dict | None = None,
                  timeout: float = 300) -> tuple[float | None, int | None]:
    """Seconds from launch to ``url`` answering 200, and None with the exit code if it died first."""
    with open(log_path, "w") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=_HERE / "out")
        try:
            while time.perf_counter() - t0 < timeout:
                if proc.poll() is not None:
                    return None, proc.returncode
                try:
                    with urllib.request.urlopen(url, timeout=1) as r:
                        if r.status == 200:
                            return time.perf_counter() - t0, None
                except OSError:
                    pass
                time.sleep(0.02)
            raise TimeoutError(f"{cmd[0]} not ready after {timeout}s; see {log_path}")
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def phases(log_path: Path) -> dict[str, float]:
    text = log_path.read_text()
    found = {}
    for pattern, name in PHASES.items():
        m = re.search(pattern, text)
        if m:
            found[name] = float(m.group(1))
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=5, help="rounds (each: slipstream first + later load, llama.cpp)")
    p.add_argument("--model", default=None, help="GGUF file (default: the built-in model's)")
    p.add_argument("--threads", type=int, default=None, help="threads for both (default: each one's own)")
    args = p.parse_args(argv)
    online = _online()
    model = args.model or online.builtin_gguf()
    out = _HERE / "out"
    out.mkdir(exist_ok=True)

    from slipstream.kernels import cpu_native
    import torch  # noqa: F401  (the kernels link the OpenMP runtime torch loads)
    lib = cpu_native.library()
    if lib is None:
        print("the CPU kernels do not build here: slipstream would serve dequantized weights", file=sys.stderr)
        return 1
    kernels = Path(lib._name).parent

    llama = [online.llama_server_binary(), "-m", model, "--host", "127.0.0.1"]
    if args.threads:
        llama += ["--threads", str(args.threads)]
    times: dict[str, list[float]] = {"slipstream first load": [], "slipstream later load": [], "llama.cpp": []}
    logged: dict[str, list[float]] = {}
    for i in range(args.runs):
        cache = Path(tempfile.mkdtemp(prefix="slipstream-load-"))
        shutil.copytree(kernels, cache / "kernels")
        env = dict(os.environ, SLIPSTREAM_CACHE_DIR=str(cache))
        for label in ("slipstream first load", "slipstream later load"):
            port = online.free_port()
            cmd = [sys.executable, "-m", "slipstream.server", "serve", "--model", model, "--host", "127.0.0.1",
                   "--port", str(port)] + (["--num-threads", str(args.threads)] if args.threads else [])
            log_path = out / f"load-{label.split()[1]}.log"
            seconds, code = time_to_ready(cmd, f"http://127.0.0.1:{port}/ready", log_path, env)
            if seconds is None:
                raise RuntimeError(f"slipstream exited ({code}); see {log_path}")
            times[label].append(seconds)
            for name, value in phases(log_path).items():
                logged.setdefault(f"{label}: {name}", []).append(value)
        shutil.rmtree(cache, ignore_errors=True)
        port = online.free_port()
        log_path = out / "load-llama.log"
        cmd = llama + ["--port", str(port)]
        seconds, code = time_to_ready(cmd, f"http://127.0.0.1:{port}/health", log_path)
        if seconds is None and code in (-4, -11) and "--no-repack" not in llama:
            print(f"llama-server exited by signal {-code} while loading (its AMX kernels; see online.py): "
                  "--no-repack from now on", flush=True)
            llama.append("--no-repack")
            seconds, code = time_to_ready(llama + ["--port", str(port)], f"http://127.0.0.1:{port}/health", log_path)
        if seconds is None:
            raise RuntimeError(f"llama-server exited ({code}); see {log_path}")
        times["llama.cpp"].append(seconds)
        print(f"round {i + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()), flush=True)

    print(f"\n{Path(model).name}, {args.runs} rounds, {os.cpu_count()} CPUs"
          f"{'' if '--no-repack' not in llama else ', llama-server --no-repack'}\n")
    print("| start | median s | min s | max s | / llama.cpp |")
    print("|---|---|---|---|---|")
    ref = statistics.median(times["llama.cpp"])
    for label, values in times.items():
        med = statistics.median(values)
        print(f"| {label} | {med:.2f} | {min(values):.2f} | {max(values):.2f} | {med / ref:.2f}× |")
    print("\n| slipstream phase (from its log) | median s |\n|---|---|")
    for label, values in logged.items():
        print(f"| {label} | {statistics.median(values):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
