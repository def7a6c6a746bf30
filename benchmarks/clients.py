"""The evaluation and benchmark tools of the field against a real ``slipstream serve``, unchanged.

1. lm-evaluation-harness ``--model local-completions`` (the server's prompt logprobs through
   ``echo``) and ``--model hf`` (transformers on the same GGUF weights, dequantized to fp32) on a
   local multiple-choice task (``benchmarks/lm_eval_task/facts_mc.yaml``, 55 items, 4 choices). The
   hf run is the oracle: every item's chosen answer must be equal and every log-likelihood within
   ``--tolerance`` (1e-3). The table: items, agreement, max |Δ loglik|, accuracy of each.
2. ``--model local-chat-completions`` on the same questions as a generation task (``facts_gen.yaml``).
3. ``guidellm run``: a short streaming sweep (synchronous, throughput, then constant rates between;
   synthetic 64-token prompts, 32 output tokens), its summary.

Everything offline: the tokenizer the tools need comes from ``slipstream tokenizer export``; only
127.0.0.1 is used. Needs the ``bench`` extra (``pip install -e '.[bench]'``). Not part of ``make test``.

Usage: ``python benchmarks/clients.py [--parts mc,gen,guidellm] [--tolerance 1e-3]
[--guidellm-requests 16]``; exits 1 if the two lm-eval runs disagree.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests

HERE = Path(__file__).resolve().parent
TASKS = HERE / "lm_eval_task"
OUT = HERE / "out" / "clients"
MODEL = "smollm2"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "DO_NOT_TRACK": "1",
           "GUIDELLM__LOGGING__DISABLED": "true"}
ENV = {**os.environ, **OFFLINE}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(log: Path) -> tuple[subprocess.Popen, str]:
    """``slipstream serve`` of the built-in model on 127.0.0.1; returns (process, base URL) once ready."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "slipstream.server", "serve", "--host", "127.0.0.1", "--port", str(port),
         "--served-model-name", MODEL, "--max-model-len", "2048", "--kv-cache-memory-bytes", "256MiB",
         "--max-num-seqs", "16", "--seed", "0"],
        stdout=log.open("w"), stderr=subprocess.STDOUT, env=ENV, cwd=OUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"slipstream serve exited with {proc.returncode}; see {log}")
        try:
            if requests.get(url + "/ready", timeout=2).status_code == 200:
                return proc, url
        except requests.ConnectionError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"slipstream serve not ready after 300 s; see {log}")


def run(cmd: list[str], log: Path, cwd: Path) -> float:
    """Run ``cmd`` with its output in ``log``; returns its wall time in seconds, exits on failure."""
    print("$", " ".join(cmd), flush=True)
    start = time.monotonic()
    with log.open("w") as f:
        code = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, env=ENV, cwd=cwd)
    if code != 0:
        raise SystemExit(f"exit {code}: {' '.join(cmd)}; see {log}")
    return time.monotonic() - start


def lm_eval(model: str, model_args: str, task: str, out: Path, *extra: str) -> float:
    return run([sys.executable, "-m", "lm_eval", "--model", model, "--model_args", model_args,
                "--tasks", task, "--include_path", str(TASKS), "--log_samples", "--output_path", str(out),
                *extra], out.with_suffix(".log"), TASKS)  # facts.jsonl is named relative to the task folder


def samples(out: Path, task: str) -> dict[int, dict]:
    """doc_id → lm-eval's logged sample of ``task`` under ``out``."""
    files = sorted(out.glob(f"**/samples_{task}_*.jsonl"))
    if not files:
        raise SystemExit(f"no samples of {task} under {out}")
    return {s["doc_id"]: s for s in map(json.loads, files[-1].read_text().splitlines())}


def logliks(sample: dict) -> list[float]:
    """Per choice, the continuation's log-likelihood lm-eval scored (``resps[i][0] = [loglik, greedy]``)."""
    return [float(r[0][0]) for r in sample["resps"]]


def compare(server: dict[int, dict], oracle: dict[int, dict], tolerance: float) -> dict:
    """Per-item agreement of the chosen answers and the largest |Δ loglik| over all choices."""
    assert server.keys() == oracle.keys(), "the two runs scored different items"
    worst, worst_at, disagree, within = 0.0, None, [], 0
    for doc_id in sorted(server):
        a, b = logliks(server[doc_id]), logliks(oracle[doc_id])
        if max(range(len(a)), key=a.__getitem__) != max(range(len(b)), key=b.__getitem__):
            disagree.append(doc_id)
        for i, (x, y) in enumerate(zip(a, b)):
            within += abs(x - y) <= tolerance
            if abs(x - y) > worst:
                worst, worst_at = abs(x - y), (doc_id, i, x, y)
    n = len(server)
    return {"items": n, "choices": sum(len(logliks(s)) for s in server.values()), "agree": n - len(disagree),
            "choices_within": within,
            "disagree": disagree, "max_abs_delta": worst, "worst": worst_at, "tolerance": tolerance,
            "acc_server": sum(s["acc"] for s in server.values()) / n,
            "acc_oracle": sum(s["acc"] for s in oracle.values()) / n,
            "ok": not disagree and worst <= tolerance}


def part_mc(url: str, tokenizer: Path, gguf: Path, tolerance: float) -> dict:
    task = "slipstream_facts_mc"
    served = OUT / "mc-local-completions"
    oracle = OUT / "mc-hf"
    t_server = lm_eval("local-completions",
                       f"model={MODEL},base_url={url}/v1/completions,tokenizer_backend=huggingface,"
                       f"tokenizer={tokenizer},num_concurrent=4,max_retries=1", task, served)
    t_oracle = lm_eval("hf", f"pretrained={gguf.parent},gguf_file={gguf.name},tokenizer={tokenizer},dtype=float32",
                       task, oracle, "--device", "cpu", "--batch_size", "8")
    result = compare(samples(served, task), samples(oracle, task), tolerance)
    result.update(seconds_server=round(t_server, 1), seconds_oracle=round(t_oracle, 1))
    print(f"\n| items | same choice | choices within {tolerance:g} | max abs Δ loglik | acc local-completions | acc hf "
          f"| agree |\n|---|---|---|---|---|---|---|\n| {result['items']} | {result['agree']}/{result['items']} | "
          f"{result['choices_within']}/{result['choices']} | {result['max_abs_delta']:.2e} | "
          f"{result['acc_server']:.4f} | {result['acc_oracle']:.4f} | {'yes' if result['ok'] else 'NO'} |")
    if result["disagree"] or not result["ok"]:
        print(f"disagreeing items: {result['disagree']}; worst (doc, choice, server, hf): {result['worst']}")
    return result


def part_gen(url: str) -> dict:
    task = "slipstream_facts_gen"
    out = OUT / "gen-local-chat-completions"
    seconds = lm_eval("local-chat-completions", f"model={MODEL},base_url={url}/v1/chat/completions,num_concurrent=4,"
                      "max_retries=1", task, out, "--apply_chat_template")
    scored = samples(out, task)
    score = sum(s["contains_answer"] for s in scored.values()) / len(scored)
    empty = sum(not s["resps"][0][0].strip() for s in scored.values())
    print(f"\nlocal-chat-completions: {len(scored)} items, contains_answer {score:.4f}, empty replies {empty}, "
          f"{seconds:.0f} s")
    return {"items": len(scored), "contains_answer": score, "empty": empty, "seconds": round(seconds, 1)}


def part_guidellm(url: str, tokenizer: Path, num_requests: int) -> dict:
    out = OUT / "guidellm.json"
    scenario = OUT / "guidellm-scenario.json"
    scenario.write_text(json.dumps({"spec": {
        "backend": {"kind": "openai_http", "target": url, "model": MODEL, "request_format": "/v1/completions",
                    "http2": False},
        "profile": {"kind": "sweep", "sweep_size": 4, "strategy_type": "constant"},
        "tokenizer": {"kind": "huggingface_auto", "model": str(tokenizer)},
        "data": [{"kind": "synthetic_text", "prompt_tokens": 64, "output_tokens": 32}],
        "constraints": [{"kind": "max_requests", "count": num_requests}],
        "outputs": [{"kind": "json", "path": str(out)}, {"kind": "console"}],
    }}, indent=1))
    seconds = run([str(Path(sys.executable).parent / "guidellm"), "run", "--scenario", str(scenario),
                   "--disable-progress"], OUT / "guidellm.log", OUT)
    print((OUT / "guidellm.log").read_text()[-6000:])
    return {"seconds": round(seconds, 1), "report": str(out)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="mc,gen,guidellm")
    parser.add_argument("--tolerance", type=float, default=1e-3)
    parser.add_argument("--guidellm-requests", type=int, default=16)
    args = parser.parse_args(argv)
    parts = args.parts.split(",")
    OUT.mkdir(parents=True, exist_ok=True)
    tokenizer = OUT / "tokenizer"
    run([sys.executable, "-m", "slipstream.server", "tokenizer", "export", str(tokenizer)],
        OUT / "tokenizer.log", OUT)
    from slipstream.server.models.loader import builtin_model_path
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally below: stop the server
    proc, url = start_server(OUT / "serve.log")
    results: dict = {}
    try:
        if "mc" in parts:
            results["mc"] = part_mc(url, tokenizer, builtin_model_path(), args.tolerance)
        if "gen" in parts:
            results["gen"] = part_gen(url)
        if "guidellm" in parts:
            results["guidellm"] = part_guidellm(url, tokenizer, args.guidellm_requests)
    finally:
        proc.terminate()
        proc.wait(60)
    (OUT / "summary.json").write_text(json.dumps(results, indent=1))
    return 1 if "mc" in results and not results["mc"]["ok"] else 0


if __name__ == "__main__":
    sys.exit(main())
