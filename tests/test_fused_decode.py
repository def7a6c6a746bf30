"""A decode step's layers in one C call (kernels/cpu_decode.c, server/models/fused_decode.py)
against the modules' torch path on the same quantized weights: the hidden states and the K/V it
writes, for Llama, Qwen2 (q/k/v bias), Qwen3 (q/k norms) and sliding-window layers, one to
several rows over random paged contexts; and which models and steps take it. The token-for-token
oracle of the built-in model, which takes this path by default, is tests/test_oracle.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize

from slipstream import kernels
from slipstream.kernels import AttentionMetadata, ggml_cpu
from slipstream.server.models import quant
from slipstream.server.models.config import ModelConfig
from slipstream.server.models.llama import LlamaModel
from slipstream.server.models.quant import GGMLTensor

BLOCK = 4


@pytest.fixture(autouse=True)
def _kernels():
    if not ggml_cpu.available():
        pytest.skip("no C compiler here: the CPU kernels cannot be built")


def _cfg(**kw) -> ModelConfig:
    base = dict(architecture="LlamaForCausalLM", vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=3,
                num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                max_position_embeddings=256, tie_word_embeddings=True)
    return ModelConfig(**{**base, **kw})


def _model(cfg: ModelConfig, types=("Q4_1", "Q4_0", "Q8_0"), seed=0) -> LlamaModel:
    rng = np.random.default_rng(seed)

    def blocks(rows, cols, qtype):
        w = (rng.standard_normal((rows, cols)) * 0.3).astype(np.float32)
        t = GGMLQuantizationType[qtype]
        return GGMLTensor(torch.from_numpy(np.ascontiguousarray(gguf_quantize(w, t))), qtype, (rows, cols))

    q, kv, h, i = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    w = {"embed_tokens.weight": torch.from_numpy(rng.standard_normal((cfg.vocab_size, h)).astype(np.float32)),
         "norm.weight": torch.ones(h)}
    for layer in range(cfg.num_layers):
        p = f"layers.{layer}."
        kind = lambda n: types[(layer + n) % len(types)]  # noqa: E731 - every type in every role
        w[p + "self_attn.qkv_proj.weight"] = blocks(q + 2 * kv, h, kind(0))
        w[p + "self_attn.o_proj.weight"] = blocks(h, q, kind(1))
        w[p + "mlp.gate_up_proj.weight"] = blocks(2 * i, h, kind(2))
        w[p + "mlp.down_proj.weight"] = blocks(h, i, kind(0))
        for n in ("input_layernorm", "post_attention_layernorm"):
            w[p + n + ".weight"] = torch.from_numpy((1 + 0.2 * rng.standard_normal(h)).astype(np.float32))
        if cfg.attention_bias:
            w[p + "self_attn.qkv_proj.bias"] = torch.from_numpy(rng.standard_normal(q + 2 * kv).astype(np.float32))
        if cfg.qk_norm:
            for n in ("q_norm", "k_norm"):
                w[p + f"self_attn.{n}.weight"] = torch.from_numpy(
                    (1 + 0.2 * rng.standard_normal(cfg.head_dim)).astype(np.float32))
    model = LlamaModel(cfg)
    model.load_weights(w)
    return model.eval()


def _step(cfg: ModelConfig, context_lens: list[int], seed: int = 1, pad_last: bool = False):
    """One decode token per request over random earlier K/V: (ids, positions, kv cache, meta)."""
    g = torch.Generator().manual_seed(seed)
    per = -(-max(context_lens) // BLOCK)
    num_blocks = per * len(context_lens) + 1
    cache = torch.randn(cfg.num_layers, 2, num_blocks, BLOCK, cfg.num_kv_heads, cfg.head_dim, generator=g)
    order = torch.randperm(num_blocks - 1, generator=g) + 1  # tables out of order: block 0 unused
    tables = order[:per * len(context_lens)].view(len(context_lens), per).to(torch.int32)
    positions = torch.tensor([n - 1 for n in context_lens])
    slots = torch.tensor([int(tables[b, p // BLOCK]) * BLOCK + p % BLOCK for b, p in enumerate(positions.tolist())])
    if pad_last:
        slots[-1] = -1
    meta = AttentionMetadata(slot_mapping=slots, query_start_loc=torch.arange(len(context_lens) + 1, dtype=torch.int32),
                             seq_lens=torch.tensor(context_lens, dtype=torch.int32), block_tables=tables,
                             max_query_len=1, max_seq_len=max(context_lens))
    ids = torch.randint(0, cfg.vocab_size, (len(context_lens),), generator=g)
    return ids, positions, cache, meta


@pytest.mark.parametrize("kw", [{}, {"attention_bias": True, "architecture": "Qwen2ForCausalLM"},
                                {"qk_norm": True, "architecture": "Qwen3ForCausalLM"},
                                {"layer_windows": [5, None, 3]}], ids=["llama", "qwen2-bias", "qwen3-qk-norm", "window"])
@pytest.mark.parametrize("lens", [[7], [1, 9, 13], [30, 2, 17, 5, 11, 8, 21, 3, 14]])
def test_one_call_decode_equals_the_modules_torch_path(kw, lens, cpu_isa):
    cfg = _cfg(**kw)
    model = _model(cfg)
    attention = kernels.resolve_backend("cpu")
    assert attention.name == "cpu" and model.fused_plan() is not None
    ids, positions, cache, meta = _step(cfg, lens, pad_last=len(lens) > 1)
    if len(lens) > quant.KERNEL_MAX_ROWS:
        pytest.skip("more rows than this machine's kernel crossover")
    fused_cache, torch_cache = cache.clone(), cache.clone()
    fused = model(ids, positions, fused_cache, meta, attention)
    model._fused = None  # the torch path from here on
    meta.backend_cache.clear()
    expected = model(ids, positions, torch_cache, meta, attention)
    torch.testing.assert_close(fused, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused_cache, torch_cache, rtol=1e-5, atol=1e-5)
    written = (fused_cache != cache).any(dim=(0, 1, 4, 5)).nonzero().tolist()  # [block, offset] pairs
    slots = [s for s in meta.slot_mapping.tolist() if s >= 0]
    assert sorted(b * BLOCK + o for b, o in written) == sorted(slots), "K/V written at exactly the live slots"


def test_only_plain_quantized_layers_and_one_token_steps_take_it(monkeypatch):
    cfg = _cfg()
    attention = kernels.resolve_backend("cpu")
    assert _model(cfg).fused_plan() is not None
    dense = LlamaModel(cfg)  # fp32 weights (--quantization none): the torch path
    assert dense.fused_plan() is None
    monkeypatch.setenv("SLIPSTREAM_FUSED_DECODE", "0")
    assert _model(cfg).fused_plan() is None
    monkeypatch.delenv("SLIPSTREAM_FUSED_DECODE")
    model = _model(cfg)
    calls = []
    monkeypatch.setattr(kernels.cpu_decode, "decode_layers",
                        lambda *a, **k: calls.append(a) or a[1])
    ids, positions, cache, meta = _step(cfg, [4, 6])
    model(ids, positions, cache, meta, attention)
    assert len(calls) == 1
    prefill = AttentionMetadata(slot_mapping=torch.arange(3), query_start_loc=torch.tensor([0, 3], dtype=torch.int32),
                                seq_lens=torch.tensor([3], dtype=torch.int32), block_tables=torch.tensor([[0]], dtype=torch.int32),
                                max_query_len=3, max_seq_len=3)
    model(torch.tensor([1, 2, 3]), torch.arange(3), cache, prefill, attention)
    monkeypatch.setenv("SLIPSTREAM_ATTENTION", "torch")
    model(ids, positions, cache, meta, kernels.resolve_backend("cpu"))
    assert len(calls) == 1, "a prefill step and the torch attention backend keep the modules' path"


def test_the_builtin_model_takes_it(loaded):
    assert loaded.model.fused_plan() is not None
