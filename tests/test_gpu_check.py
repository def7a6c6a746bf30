"""benchmarks/gpu_check: the parts that run without a GPU or network, so CI notices when they rot.

The fast tests check the import guard and the wheel list against the engine's real imports (with
no ``.whl`` here, the shipped distributions are allowed from site-packages: the list is proven,
not the wheels). The slow one runs ``run.py`` end to end on CPU with small sizes.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

GPU_CHECK = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check"
sys.path.insert(0, str(GPU_CHECK))
import env  # noqa: E402


def guarded_import(tmp_path, modules: list[str], shipped_here: bool) -> subprocess.CompletedProcess:
    guard = env.write_guard(tmp_path / "guard.json", [env.SRC], shipped_here, tmp_path / "refused.txt")
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
    script = tmp_path / "imp.py"
    script.write_text(code)
    return subprocess.run([sys.executable, "-P", str(script), *modules], capture_output=True, text=True, cwd=tmp_path,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{guard}:{env.SRC}",
                               "SLIPSTREAM_GPU_GUARD": str(tmp_path / "guard.json")})


def test_engine_imports_with_only_the_gpu_machines_packages_and_the_shipped_list(tmp_path):
    done = guarded_import(tmp_path, ["slipstream.server.engine.engine", "slipstream.kernels.triton_attention", "pytest"],
                          shipped_here=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_guard_hides_a_package_that_is_neither_shipped_nor_on_the_gpu_machine(tmp_path):
    done = guarded_import(tmp_path, ["slipstream.server.engine.engine"], shipped_here=False)
    assert done.returncode != 0
    assert "No module named 'llguidance'" in done.stderr
    assert "llguidance" in (tmp_path / "refused.txt").read_text().split()


def test_pins_name_every_shipped_distribution_with_its_installed_version():
    pins = env.pins()
    assert [p.split("==")[0] for p in pins] == list(env.SHIPPED)
    assert all(p.split("==")[1] for p in pins)


@pytest.mark.slow
def test_run_rehearses_every_stage_on_cpu_and_marks_cuda_stages_skipped(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, str(GPU_CHECK / "run.py"), "--out", str(out), "--isolate", "on",
                           "--wheels", str(tmp_path / "no-wheels"),
                           "--pytest-args", "-k 'test_context_groups or test_default_backend'"],
                          capture_output=True, text=True, timeout=1500)
    summary = json.loads((out / "summary.json").read_text())
    status = {name: rec["status"] for name, rec in summary["stages"].items()}
    assert done.returncode == 0, (status, done.stdout[-3000:])
    assert status["roofline"] == status["syncs"] == status["throughput-slipstream-graphs"] == "skipped: no CUDA"
    assert summary["stages"]["kernel-tests"]["result"]["passed"] == 2
    assert summary["stages"]["oracle"]["result"]["ok"] is True
    assert "KV cache" in summary["stages"]["kv-sizing"]["result"]["kv_log_line"]
    parallel = summary["stages"]["parallel"]["result"]
    assert parallel["tensor"] == 3 and parallel["equal"] == parallel["prompts"] == 6, parallel
    assert "| stage | status | seconds |" in (out / "gpu-check.md").read_text()
