"""GGUF-quantized weights served as stored: the CPU kernels against the gguf package's own
dequantization, the quantized modules against dense fp32, and the loader's choice of path.
The token-for-token oracle of the quantized model is tests/test_oracle.py (the default path)."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize, quantize as gguf_quantize

from slipstream.kernels import ggml_cpu
from slipstream.server.engine.config import EngineConfig
from slipstream.server.models import quant
from slipstream.server.models.loader import load_model

TYPES = ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]


def _cols(qtype: str, blocks: int) -> int:
    """Row length of ``blocks`` blocks of 32 weights (K-quants: ``blocks`` / 3 super-blocks, at least 1)."""
    return max(1, blocks // 3) * 256 if qtype.endswith("_K") else blocks * 32


def _blocks(qtype: str, rows: int, cols: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random fp32 weights quantized by the gguf package (K-quants: tests/kquants.py's encoder):
    (blocks uint8, gguf's dequantization)."""
    import kquants

    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    w[0] = 0.0  # an all-zero block: scale 0
    w[1, :32] = 7.5  # a constant block: m alone carries it in Q4_1
    t = GGMLQuantizationType[qtype]
    raw = kquants.quantize(w, qtype) if qtype.endswith("_K") else gguf_quantize(w, t)
    return torch.from_numpy(np.ascontiguousarray(raw)), torch.from_numpy(gguf_dequantize(raw, t).astype(np.float32))


@pytest.fixture(autouse=True)
def _kernels():
    if not ggml_cpu.available():
        pytest.skip("no C compiler here: the GGML CPU kernels cannot be built")


@pytest.mark.parametrize("qtype", TYPES)
def test_dequantize_is_the_gguf_packages_bit_for_bit(qtype, cpu_isa):
    k = _cols(qtype, 6)
    blocks, want = _blocks(qtype, 37, k)
    assert torch.equal(ggml_cpu.dequantize(blocks, qtype, k), want)
    ids = torch.tensor([36, 0, 5, 5])
    assert torch.equal(ggml_cpu.dequantize(blocks, qtype, k, ids), want[ids])
    with pytest.raises(IndexError):
        ggml_cpu.dequantize(blocks, qtype, k, torch.tensor([37]))


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 17])
def test_matmul_equals_dense_fp32_up_to_summation_order(qtype, rows, cpu_isa):
    # 37 output rows: full tiles of 4 and 2 weight rows, then a partial one.
    k = _cols(qtype, 5) * (2 if qtype.endswith("_K") else 1)
    blocks, w = _blocks(qtype, 37, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    y = ggml_cpu.matmul(x, blocks, qtype, k)
    want = (x.double() @ w.double().t()).float()
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5 * k / 32)


def test_matmul_is_the_same_at_any_thread_count(cpu_isa):
    blocks, _ = _blocks("Q4_1", 203, 576)
    x = torch.randn(3, 576)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ggml_cpu.matmul(x, blocks, "Q4_1", 576)
        torch.set_num_threads(2)
        two = ggml_cpu.matmul(x, blocks, "Q4_1", 576)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)  # each output is one thread's sum, in one order


def test_bad_blocks_and_types_are_refused():
    blocks, _ = _blocks("Q4_1", 4, 64)
    with pytest.raises(ValueError, match="do not hold rows of 96"):
        ggml_cpu.matmul(torch.randn(1, 96), blocks, "Q4_1", 96)
    with pytest.raises(ValueError, match="no CPU kernel for GGML type Q3_K"):
        ggml_cpu.matmul(torch.randn(1, 64), blocks, "Q3_K", 64)
    with pytest.raises(ValueError, match="Q4_K blocks .* do not hold rows of 64"):  # K-quants: 256 per row at least
        ggml_cpu.matmul(torch.randn(1, 64), blocks, "Q4_K", 64)
    with pytest.raises(ValueError, match="float32"):
        ggml_cpu.matmul(torch.randn(1, 64, dtype=torch.bfloat16), blocks, "Q4_1", 64)


@pytest.mark.parametrize("rows", [1, quant.KERNEL_MAX_ROWS, quant.KERNEL_MAX_ROWS + 1, 64])
def test_quant_linear_matches_linear_on_both_sides_of_the_crossover(rows):
    blocks, w = _blocks("Q4_1", 48, 64)
    bias = torch.randn(48)
    layer = quant.QuantLinear(quant.GGMLTensor(blocks, "Q4_1", (48, 64)), bias)
    x = torch.randn(rows, 64)
    torch.testing.assert_close(layer(x), F.linear(x, w, bias), rtol=1e-5, atol=1e-5)
    assert layer(x.view(1, rows, 64)).shape == (1, rows, 48)


def test_quant_embedding_looks_up_dequantized_rows():
    blocks, w = _blocks("Q8_0", 50, 64)
    emb = quant.QuantEmbedding(quant.GGMLTensor(blocks, "Q8_0", (50, 64)))
    ids = torch.tensor([[3, 49], [0, 3]])
    assert torch.equal(emb(ids), w[ids])


def test_fusing_tensors_of_different_types_keeps_each_as_stored():
    a, wa = _blocks("Q4_1", 8, 64)
    b, wb = _blocks("Q8_0", 4, 64, seed=1)
    ta, tb = quant.GGMLTensor(a, "Q4_1", (8, 64)), quant.GGMLTensor(b, "Q8_0", (4, 64))
    same = quant.GGMLTensor.cat([ta, ta])
    assert isinstance(same, quant.GGMLTensor) and same.shape == (16, 64)
    mixed = quant.GGMLTensor.cat([ta, ta, tb])  # q, k of one type and v of another: two parts
    assert isinstance(mixed, quant.GGMLRows) and [p.qtype for p in mixed.parts] == ["Q4_1", "Q8_0"]
    assert mixed.shape == (20, 64) and torch.equal(mixed.dequantize(), torch.cat([wa, wa, wb]))
    bias = torch.randn(20)
    layer = quant.MixedQuantLinear(mixed, bias)
    for rows in (1, 3, quant.KERNEL_MAX_ROWS + 1):
        x = torch.randn(2, rows, 64)
        torch.testing.assert_close(layer(x), F.linear(x, mixed.dequantize(), bias), rtol=1e-5, atol=1e-5)
    wide = quant.GGMLTensor(_blocks("Q8_0", 4, 96)[0], "Q8_0", (4, 96))
    with pytest.raises(ValueError, match="columns"):
        quant.GGMLTensor.cat([ta, wide])


def test_the_builtin_model_keeps_the_files_blocks(loaded):
    import gguf

    net = loaded.model
    assert isinstance(net.layers[0].mlp.gate_up_proj, quant.QuantLinear)
    assert isinstance(net.embed_tokens, quant.QuantEmbedding)
    assert net.lm_head.blocks is net.embed_tokens.blocks  # tied: one copy of the Q8_0 table
    reader = gguf.GGUFReader(loaded.path)
    down = next(t for t in reader.tensors if t.name == "blk.3.ffn_down.weight")
    assert torch.equal(net.layers[3].mlp.down_proj.blocks, torch.from_numpy(np.array(down.data)))
    stored = sum(b.numel() * b.element_size() for b in net.buffers() if b.dtype == torch.uint8)
    assert stored < 110e6, f"{stored / 1e6:.0f} MB of blocks: the weights should stay ~4-bit"


def test_none_and_unavailable_kernels_serve_dequantized_fp32(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SLIPSTREAM_WEIGHT_CACHE", "0")
    dense = load_model("builtin", torch.device("cpu"), torch.float32, "none").model
    assert type(dense.layers[0].mlp.gate_up_proj).__name__ == "Linear"
    monkeypatch.setenv("SLIPSTREAM_CPU_KERNELS", "0")
    ggml_cpu.library.cache_clear()
    try:
        caplog.set_level(logging.INFO, logger="slipstream.loader")
        fallback = load_model("builtin", torch.device("cpu"), torch.float32, "auto").model
        assert type(fallback.layers[0].mlp.gate_up_proj).__name__ == "Linear"
        assert "dequantized to fp32" in caplog.text
    finally:
        ggml_cpu.library.cache_clear()
    assert torch.equal(fallback.layers[2].self_attn.qkv_proj.weight, dense.layers[2].self_attn.qkv_proj.weight)


def test_quantization_mode_is_checked():
    with pytest.raises(ValueError, match="quantization must be 'auto' or 'none'"):
        EngineConfig(quantization="int4")
    with pytest.raises(ValueError, match="quantization must be one of auto, none"):
        load_model("builtin", torch.device("cpu"), torch.float32, "int4")
