"""The CPU linear crossovers measured at start-up (server/models/crossover.py): the pure choice,
the cache, and that the model code follows what is applied. The oracle at either extreme is in
test_oracle.py."""
from __future__ import annotations

import json

import pytest
import torch

from slipstream.kernels import ggml_cpu
from slipstream.server.models import crossover, layers, quant
from slipstream.server.models.crossover import Crossovers


@pytest.mark.parametrize("direct, dense, want", [
    ([1, 1, 1, 1], [2, 2, 2, 2], 8),    # the direct method always wins: the last candidate
    ([1, 1, 3, 1], [2, 2, 2, 2], 2),    # the first loss decides, a later win is noise
    ([3, 1, 1, 1], [2, 2, 2, 2], 0),    # dense from the first row
    ([2, 2, 2, 2], [2, 2, 2, 2], 8),    # a tie keeps the direct method
])
def test_the_crossover_is_the_last_row_count_before_dense_first_wins(direct, dense, want):
    assert crossover.crossover([1, 2, 4, 8], zip(direct, dense)) == want


def test_timings_cut_short_by_the_budget_leave_the_default_where_it_is_larger():
    assert crossover.crossover([4, 8, 16, 32], [(1, 2)], prior=16) == 16  # 4 won, then out of time
    assert crossover.crossover([4, 8, 16, 32], [(1, 2)] * 3, prior=8) == 16
    assert crossover.crossover([4, 8, 16, 32], [(1, 2), (3, 2)], prior=16) == 4, "a measured loss decides"
    assert crossover.crossover([4, 8], [(1, 2)] * 2, prior=64) == 8, "measured to the end: no prior"


def test_the_crossover_measures_no_further_than_the_first_loss():
    read = []

    def timings():
        for t in [(1, 2), (3, 2), (1, 2), (1, 2)]:
            read.append(t)
            yield t

    assert crossover.crossover([1, 2, 4, 8], timings()) == 1 and len(read) == 2


@pytest.fixture
def calibrating(monkeypatch, tmp_path):
    monkeypatch.delenv("SLIPSTREAM_CALIBRATE", raising=False)
    monkeypatch.setenv("SLIPSTREAM_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_calibration_measures_the_models_own_layers_once_and_caches_the_result(loaded, calibrating, monkeypatch):
    calls = []
    real_kernel, real_small = crossover.measure_kernel, crossover.measure_small_batch
    monkeypatch.setattr(crossover, "measure_kernel", lambda layers: calls.append(layers) or real_kernel(layers))
    monkeypatch.setattr(crossover, "measure_small_batch", lambda layers: calls.append(layers) or real_small(layers))
    found = crossover.calibrate(loaded.model, threads=1)
    assert found.kernel_max_rows in (0, *crossover.KERNEL_CANDIDATES)
    [layers] = calls  # the built-in model is all blocks: quantized layers timed, fp32 keeps the default
    assert found.small_batch_rows == Crossovers().small_batch_rows
    assert all(isinstance(m, quant.QuantLinear) for m in layers)
    assert len(layers) == loaded.config.num_layers, "the largest projection of every layer (the fused MLP one)"
    sizes = [m.in_features * m.out_features for name, m in loaded.model.named_modules()
             if isinstance(m, quant.QuantLinear) and "lm_head" not in name]
    assert layers[0].in_features * layers[0].out_features == max(sizes), "not the LM head"
    [cached] = (calibrating / "crossovers").glob("*.json")
    assert Crossovers(**json.loads(cached.read_text())) == found
    calls.clear()
    assert crossover.calibrate(loaded.model, threads=1) == found and calls == [], "read back, not measured"
    crossover.calibrate(loaded.model, threads=2)
    assert len(calls) == 1 and len(list((calibrating / "crossovers").glob("*.json"))) == 2, "per thread count"


def test_calibration_off_keeps_the_defaults_and_a_damaged_cache_is_measured_again(loaded, calibrating, monkeypatch):
    monkeypatch.setenv("SLIPSTREAM_CALIBRATE", "0")
    assert crossover.calibrate(loaded.model, threads=1) == Crossovers()
    assert not (calibrating / "crossovers").exists()
    monkeypatch.delenv("SLIPSTREAM_CALIBRATE")
    monkeypatch.setattr(crossover, "measure_kernel", lambda layers: 24)
    first = crossover.calibrate(loaded.model, threads=1)
    [cached] = (calibrating / "crossovers").glob("*.json")
    cached.write_text("{not json")
    monkeypatch.setattr(crossover, "measure_kernel", lambda layers: 32)
    assert first.kernel_max_rows == 24 and crossover.calibrate(loaded.model, threads=1).kernel_max_rows == 32


def test_a_dense_layer_is_measured_against_f_linear():
    torch.manual_seed(0)
    dense = [layers.Linear(256, 512, bias=False) for _ in range(3)]
    rows = crossover.measure_small_batch(dense, candidates=(1, 2, 4))
    assert rows in (0, 1, 2, 4)


def test_the_model_code_takes_the_method_that_is_applied(monkeypatch):
    monkeypatch.setattr(layers, "SMALL_BATCH_ROWS", layers.SMALL_BATCH_ROWS)
    monkeypatch.setattr(quant, "KERNEL_MAX_ROWS", quant.KERNEL_MAX_ROWS)
    torch.manual_seed(0)
    dense = layers.Linear(64, 32, bias=False)
    w = quant.GGMLTensor(torch.randint(0, 255, (32, 64 // 32 * ggml_cpu.BLOCK_BYTES["Q8_0"]), dtype=torch.uint8),
                         "Q8_0", (32, 64))
    w.blocks.view(32, 2, 34)[:, :, :2] = torch.tensor([0, 0x3C], dtype=torch.uint8)  # fp16 scale 1.0: finite
    blocked = quant.QuantLinear(w)
    x = torch.randn(2, 64)
    used = []
    real_small, real_matmul = layers.small_batch_linear, ggml_cpu.matmul
    monkeypatch.setattr(layers, "small_batch_linear", lambda *a: used.append("W @ x.T") or real_small(*a))
    monkeypatch.setattr(ggml_cpu, "matmul", lambda *a: used.append("kernel") or real_matmul(*a))
    crossover.apply(Crossovers(small_batch_rows=2, kernel_max_rows=2))
    reference = (dense(x), blocked(x))
    assert used == ["W @ x.T", "kernel"]
    used.clear()
    crossover.apply(Crossovers(small_batch_rows=1, kernel_max_rows=1))
    assert torch.allclose(dense(x), reference[0], atol=1e-5) and torch.allclose(blocked(x), reference[1], atol=1e-4)
    assert used == [], "two rows above both crossovers: F.linear and the dequantized GEMM"
