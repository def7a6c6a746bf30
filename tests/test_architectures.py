"""Qwen3, Qwen3-MoE and Mixtral: greedy output equals transformers' token for token on the same
random weights — alone, batched, chunked, preempted and after a prefix-cache hit — from
safetensors directories and from GGUF files written with ``gguf.GGUFWriter``.

The checkpoints are tiny (hidden 64, head_dim 32 ≠ 64 / 4 heads, 8 experts top-2, one dense layer
in Qwen3-MoE) and made here with transformers; nothing is downloaded. Weights are drawn with a
large spread (std 0.2, norm weights 1 ± 0.3) so that logits and router scores are peaky and
summation-order differences cannot flip a greedy token or an expert choice.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers

from slipstream.server.engine import LLM, SamplingParams
from slipstream.server.models import moe
from slipstream.server.models.config import ModelConfig
from slipstream.server.models.loader import ModelLoadError, builtin_model_path, load_model, load_tokenizer

VOCAB = 512
MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, max_position_embeddings=512, tie_word_embeddings=False,
              rms_norm_eps=1e-6)
ARCHS = {
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(attention_bias=False)),
    # layer 1 dense (mlp_only_layers); Qwen3-MoE's default: top-k weights not renormalized
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, mlp_only_layers=[1],
                       norm_topk_prob=False)),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                dict(num_local_experts=8, num_experts_per_tok=2, sliding_window=None)),
}


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)

    def ids(n):
        return torch.randint(3, VOCAB, (n,), generator=g).tolist()

    prefix = ids(50)  # three full blocks shared by the last two prompts
    return [ids(4), ids(9), ids(23), ids(75), prefix + ids(5), prefix + ids(8)]


PROMPTS = _prompts()


def _randomize(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.3 * noise if "norm" in name else 0.2 * noise)


def _save(path: Path, arch: str, tokenizer, **overrides):
    """A random checkpoint of ``arch`` saved as safetensors with ``tokenizer``; returns the model."""
    config_cls, model_cls, extra = ARCHS[arch]
    cfg = config_cls(**{**COMMON, **extra, **overrides}, eos_token_id=tokenizer.eos_token_id,
                     bos_token_id=tokenizer.bos_token_id)
    model = model_cls(cfg).eval()
    _randomize(model, seed=sum(map(ord, arch)))
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return model


def _generate(hf, prompts, eos: int) -> list[list[int]]:
    from tiny_checkpoints import greedy

    return greedy(hf, prompts, eos, MAX_TOKENS)


@dataclass
class Case:
    arch: str
    path: Path
    loaded: object
    expected: list[list[int]]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("builtin")


@pytest.fixture(scope="module", params=list(ARCHS))
def case(request, tmp_path_factory, tokenizer) -> Case:
    path = tmp_path_factory.mktemp(request.param)
    hf = _save(path, request.param, tokenizer)
    expected = _generate(hf, PROMPTS, tokenizer.eos_token_id)
    # The oracle must be able to tell a wrong model from a right one.
    assert len({t for out in expected for t in out}) >= 20, expected
    assert len({tuple(out) for out in expected}) == len(expected), "prompts should give different outputs"
    return Case(request.param, path, load_model(str(path), torch.device("cpu"), torch.float32), expected)


@pytest.fixture
def make(case, no_leaks):
    made: list[LLM] = []

    def build(**kwargs) -> LLM:
        made.append(LLM(loaded=case.loaded, **{"kv_cache_memory_bytes": 4 << 20, **kwargs}))
        return made[-1]

    yield build
    for llm in made:
        no_leaks(llm.engine)


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_config_reads_qk_norm_head_dim_and_expert_layers(case):
    cfg = case.loaded.config
    assert cfg.head_dim == 32 and cfg.num_heads * cfg.head_dim != cfg.hidden_size
    assert cfg.qk_norm == (case.arch != "mixtral")
    want = {"qwen3": [], "qwen3_moe": [0, 2], "mixtral": [0, 1, 2]}[case.arch]
    assert cfg.moe_layers == want
    if want:
        assert (cfg.num_experts, cfg.num_experts_per_tok) == (8, 2)
        assert cfg.norm_topk_prob == (case.arch == "mixtral")
        assert isinstance(case.loaded.model.layers[want[0]].mlp, moe.SparseMoE)
        assert not case.loaded.model.graph_safe


def test_one_at_a_time_matches_transformers(case, make):
    llm = make(max_num_batched_tokens=512)
    for p, want in zip(PROMPTS, case.expected):
        assert _tokens(llm.generate(p, GREEDY)) == [want]


def test_one_batch_matches_transformers(case, make):
    llm = make(max_num_batched_tokens=1024, trace=True)
    assert _tokens(llm.generate(PROMPTS, GREEDY)) == case.expected
    assert len(llm.engine.trace[0].scheduled) == len(PROMPTS), "all prompts should share the first step"


def test_chunked_prefill_matches_transformers(case, make):
    llm = make(max_num_batched_tokens=16, trace=True)
    assert _tokens(llm.generate(PROMPTS, GREEDY)) == case.expected
    assert all(rec.num_tokens <= 16 for rec in llm.engine.trace)
    assert any(r.num_prefill_tokens and r.num_decode_tokens for r in llm.engine.trace), \
        "some step should carry a prefill chunk beside decode tokens"


def test_preemption_keeps_output_exact(case, make):
    cfg = case.loaded.config
    blocks = -(-(max(len(p) for p in PROMPTS) + MAX_TOKENS) // 16) + 2
    llm = make(kv_cache_memory_bytes=blocks * 16 * cfg.kv_bytes_per_token(4), max_num_batched_tokens=512)
    assert llm.engine.kv.num_blocks == blocks
    assert _tokens(llm.generate(PROMPTS, GREEDY)) == case.expected
    assert llm.engine.scheduler.num_preemptions > 0, "the cache was meant to be too small for all at once"


def test_prefix_cache_hit_keeps_output_exact(case, make):
    llm = make()
    assert _tokens(llm.generate(PROMPTS[4], GREEDY)) == [case.expected[4]]
    out = llm.generate(PROMPTS[5], GREEDY)
    assert _tokens(out) == [case.expected[5]]
    assert out[0].num_cached_tokens == 48, "the shared 50-token prefix holds three full blocks"


# --- the MoE layer alone ------------------------------------------------------------------

@pytest.mark.parametrize("arch, renormalize", [("qwen3_moe", False), ("qwen3_moe", True), ("mixtral", True)])
def test_sparse_moe_matches_transformers_block(arch, renormalize):
    config_cls, model_cls, extra = ARCHS[arch]
    hf_cfg = config_cls(**{**COMMON, **extra, "num_hidden_layers": 1, "mlp_only_layers": [],
                           "norm_topk_prob": renormalize})
    hf = model_cls(hf_cfg).eval()
    _randomize(hf, seed=7)
    block = hf.model.layers[0].mlp
    cfg = ModelConfig("x", VOCAB, 64, 96, 1, 4, 2, 32, 1e-6, 1e4, 512, False, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=64 if arch == "qwen3_moe" else 96, norm_topk_prob=renormalize,
                      moe_layers=[0])
    ours = moe.SparseMoE(cfg)
    state = {k.removeprefix("model.layers.0.mlp."): v for k, v in hf.state_dict().items() if ".mlp." in k}
    ours.load_state_dict(state)
    x = torch.randn(200, 64, generator=torch.Generator().manual_seed(3))
    experts, _ = ours.route(x)
    assert experts.unique().numel() == 8, "every expert should receive tokens"
    with torch.inference_mode():
        torch.testing.assert_close(ours(x), block(x[None])[0], rtol=1e-5, atol=1e-5)


def test_experts_run_one_matmul_pair_per_expert_not_per_token(monkeypatch):
    cfg = ModelConfig("x", VOCAB, 64, 96, 1, 4, 2, 32, 1e-6, 1e4, 512, False, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=48, moe_layers=[0])
    layer = moe.SparseMoE(cfg)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.2)
    calls = []

    def linear(x, w, b=None):
        calls.append(x.shape[0])
        return torch.nn.functional.linear(x, w, b)

    monkeypatch.setattr(moe, "F", SimpleNamespace(linear=linear, silu=torch.nn.functional.silu))
    layer(torch.randn(300, 64))
    assert len(calls) <= 2 * 8 and sum(calls) == 2 * 300 * 2, calls


# --- GGUF ---------------------------------------------------------------------------------

_GGUF_ARCH = {"qwen3": "qwen3", "qwen3_moe": "qwen3moe", "mixtral": "llama", "llama": "llama"}
_TENSOR_NAMES = {  # Hugging Face → llama.cpp, as convert_hf_to_gguf.py writes them
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp",
}
_EXPERT_NAMES = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
                 "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}


def _permute_rope(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's q/k row order for the ``llama`` architecture: each head's two halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.fixture(scope="module")
def gguf_tokenizer() -> dict:
    """The built-in model's GGUF tokenizer fields cut to its first ``VOCAB`` tokens and the merges
    among them (a consistent byte-level BPE; converting 49k tokens would take seconds per test)."""
    import gguf

    src = gguf.GGUFReader(str(builtin_model_path()))
    fields = {k: (src.fields[k].contents(), src.fields[k].types) for k in (
        "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
        "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id")}
    tokens = fields["tokenizer.ggml.tokens"][0][:VOCAB]
    kept = set(tokens)
    merges = [m for m in fields["tokenizer.ggml.merges"][0]
              if "".join(m.split(" ")) in kept and all(part in kept for part in m.split(" "))]
    fields["tokenizer.ggml.tokens"] = (tokens, fields["tokenizer.ggml.tokens"][1])
    fields["tokenizer.ggml.token_type"] = (fields["tokenizer.ggml.token_type"][0][:VOCAB],
                                           fields["tokenizer.ggml.token_type"][1])
    fields["tokenizer.ggml.merges"] = (merges, fields["tokenizer.ggml.merges"][1])
    return fields


# A Q4_K_M-like mix by tensor name (Hugging Face's or llama.cpp's): llama.cpp gives attn_v and the
# LM head more bits (Q6_K); ffn_down here is Q5_K to cover all three K-quants. The rest Q4_K.
K_MIX = {"v_proj": "Q6_K", "attn_v": "Q6_K", "lm_head": "Q6_K", "output": "Q6_K", "down_proj": "Q5_K",
         "ffn_down": "Q5_K"}


def _file_type(t: torch.Tensor, dtype: str, name: str = "") -> str:
    """How the test file stores ``t`` (named ``name``): norms in F32; quantized only where rows split
    into whole blocks (32 weights; 256 for K-quants); ``"Q4_K_M"`` is :data:`K_MIX`."""
    if dtype == "Q4_K_M":
        parts = name.removesuffix(".weight").split(".")
        dtype = next((K_MIX[p] for p in parts[-2:] if p in K_MIX), "Q4_K")
    if t.dim() == 1 or (dtype.startswith("Q") and t.shape[-1] % (256 if dtype.endswith("_K") else 32)):
        return "F32"
    return dtype


def _quantize(array, kind: str):
    """``array`` fp32 as ``kind``'s blocks: the gguf package's encoder, or tests/kquants.py's for K-quants."""
    import gguf
    import kquants

    if kind.endswith("_K"):
        return kquants.quantize(array.reshape(-1, array.shape[-1]), kind).reshape(*array.shape[:-1], -1)
    return gguf.quants.quantize(array, gguf.GGMLQuantizationType[kind])


def _as_stored(t: torch.Tensor, dtype: str, name: str = "") -> torch.Tensor:
    """``t`` as the file holds it, back in fp32: what transformers must run on to be the oracle."""
    import gguf

    kind = _file_type(t, dtype, name)
    if kind == "F16":
        return t.half().float()
    if kind.startswith("Q"):
        stored = _quantize(t.float().numpy(), kind)
        return torch.from_numpy(gguf.quants.dequantize(stored, gguf.GGMLQuantizationType[kind])).reshape(t.shape)
    return t


def _write_gguf(path: Path, arch: str, checkpoint: Path, hf_cfg, dtype: str, tokenizer_fields: dict,
                extra: dict | None = None) -> None:
    """The safetensors in ``checkpoint`` as a GGUF file of ``arch`` with ``tokenizer_fields``, and
    ``extra`` tensors (name → fp32 array) after the model's."""
    import gguf
    import numpy as np
    from safetensors.torch import load_file

    state = {k.removeprefix("model."): v for k, v in load_file(str(checkpoint / "model.safetensors")).items()}
    w = gguf.GGUFWriter(str(path), _GGUF_ARCH[arch])
    w.add_block_count(hf_cfg.num_hidden_layers)
    w.add_context_length(hf_cfg.max_position_embeddings)
    w.add_embedding_length(hf_cfg.hidden_size)
    w.add_feed_forward_length(hf_cfg.intermediate_size)
    w.add_head_count(hf_cfg.num_attention_heads)
    w.add_head_count_kv(hf_cfg.num_key_value_heads)
    w.add_key_length(hf_cfg.head_dim)
    w.add_value_length(hf_cfg.head_dim)
    w.add_rope_dimension_count(hf_cfg.head_dim)
    w.add_rope_freq_base(hf_cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(hf_cfg.rms_norm_eps)
    experts = getattr(hf_cfg, "num_experts", None) or getattr(hf_cfg, "num_local_experts", 0)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(hf_cfg.num_experts_per_tok)
        if arch == "qwen3_moe":
            w.add_expert_feed_forward_length(hf_cfg.moe_intermediate_size)
    for key, (value, types) in tokenizer_fields.items():
        w.add_key_value(key, value, types[0], types[-1] if len(types) > 1 else None)

    def add(name: str, t: torch.Tensor) -> None:
        array = t.float().numpy()
        kind = _file_type(t, dtype, name)
        if kind == "F16":
            w.add_tensor(name, array.astype(np.float16))
        elif kind.startswith("Q"):
            w.add_tensor(name, _quantize(array, kind), raw_dtype=gguf.GGMLQuantizationType[kind])
        else:
            w.add_tensor(name, array)

    add("token_embd.weight", state.pop("embed_tokens.weight"))
    add("output_norm.weight", state.pop("norm.weight"))
    add("output.weight", state.pop("lm_head.weight"))
    for i in range(hf_cfg.num_hidden_layers):
        p = f"layers.{i}."
        stacks: dict[str, list[torch.Tensor]] = {}
        for name in sorted(k for k in state if k.startswith(p)):
            t = state.pop(name)
            rest = name[len(p):].removesuffix(".weight")
            if ".experts." in rest:  # mlp.experts.3.gate_proj → stacked ffn_gate_exps
                e, proj = rest.split(".experts.")[1].split(".")
                stacks.setdefault(_EXPERT_NAMES[proj], []).append((int(e), t))
                continue
            if arch in ("mixtral", "llama") and rest in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = hf_cfg.num_attention_heads if rest.endswith("q_proj") else hf_cfg.num_key_value_heads
                t = _permute_rope(t, heads)
            add(f"blk.{i}.{_TENSOR_NAMES[rest]}.weight", t)
        for gguf_name, parts in stacks.items():
            add(f"blk.{i}.{gguf_name}.weight", torch.stack([t for _, t in sorted(parts, key=lambda x: x[0])]))
    assert not state, sorted(state)
    for name, array in (extra or {}).items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("dtype", ["F32", "F16", "Q8_0"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_gguf_matches_transformers_on_the_same_weights(tmp_path, tokenizer, gguf_tokenizer, arch, dtype, no_leaks,
                                                      monkeypatch):
    monkeypatch.setenv("SLIPSTREAM_CACHE_DIR", str(tmp_path / "cache"))
    # llama.cpp always renormalizes Qwen3-MoE's top-k weights
    hf = _save(tmp_path / "hf", arch, tokenizer, **({"norm_topk_prob": True} if arch == "qwen3_moe" else {}))
    with torch.no_grad():  # quantizing rows commutes with stacking experts and permuting q/k rows
        for p in hf.parameters():
            p.copy_(_as_stored(p, dtype))
    gguf_path = tmp_path / f"{arch}.gguf"
    _write_gguf(gguf_path, arch, tmp_path / "hf", hf.config, dtype, gguf_tokenizer)
    loaded = load_model(str(gguf_path), torch.device("cpu"), torch.float32)
    cfg = loaded.config
    assert cfg.architecture == hf.config.architectures[0]
    assert (cfg.head_dim, cfg.qk_norm, cfg.moe_layers) == (
        32, arch != "mixtral", {"qwen3": [], "qwen3_moe": [0, 2], "mixtral": [0, 1, 2]}[arch])
    prompts = PROMPTS[:4]
    expected = _generate(hf, prompts, tokenizer.eos_token_id)
    assert len(loaded.tokenizer) == VOCAB and loaded.tokenizer.decode(prompts[0])
    from slipstream.kernels import ggml_cpu
    from slipstream.server.models.moe import QuantExperts
    quant_experts = [m for m in loaded.model.modules() if isinstance(m, QuantExperts)]
    # the experts' stacked blocks are served as stored too (one quantized matmul pair per expert)
    assert len(quant_experts) == (len(cfg.moe_layers) if dtype == "Q8_0" and ggml_cpu.available() else 0)
    llm = LLM(loaded=loaded, max_num_batched_tokens=32, kv_cache_memory_bytes=4 << 20)
    assert _tokens(llm.generate(prompts, GREEDY)) == expected
    no_leaks(llm.engine)


def _llama3_rope_factors(hf_cfg) -> "np.ndarray":
    """The ``rope_freqs`` tensor llama.cpp's converter writes for Llama 3.1's rope scaling: per
    rotary pair, the divisor that turns the unscaled frequency into the scaled one (1 for high
    frequencies, ``factor`` for low ones, a smooth blend between)."""
    import math

    import numpy as np

    rope = hf_cfg.rope_parameters
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_len = rope["original_max_position_embeddings"]
    dim = hf_cfg.head_dim
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            factors.append(1.0)
        elif wavelen > old_len / low:
            factors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def test_a_llama_3_gguf_applies_its_rope_frequency_factors(tmp_path, tokenizer, gguf_tokenizer, no_leaks,
                                                          monkeypatch):
    """Llama 3.1/3.2 GGUFs carry their rope scaling as a ``rope_freqs`` tensor, not as keys:
    served with it, greedy tokens equal transformers' on the checkpoint's llama3 rope scaling."""
    monkeypatch.setenv("SLIPSTREAM_CACHE_DIR", str(tmp_path / "cache"))
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    cfg = transformers.LlamaConfig(**COMMON, rope_parameters=rope, eos_token_id=tokenizer.eos_token_id,
                                   bos_token_id=tokenizer.bos_token_id)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    _randomize(hf, seed=3)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    factors = _llama3_rope_factors(hf.config)
    assert 1.0 < factors.max() and factors.min() == 1.0  # the scaling changes some pairs, not all
    gguf_path = tmp_path / "llama3.gguf"
    _write_gguf(gguf_path, "llama", tmp_path / "hf", hf.config, "F32", gguf_tokenizer,
                extra={"rope_freqs.weight": factors})
    loaded = load_model(str(gguf_path), torch.device("cpu"), torch.float32)
    assert loaded.config.rope_scaling["rope_type"] == "freq_factors"
    expected = _generate(hf, PROMPTS[:4], tokenizer.eos_token_id)
    unscaled = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **COMMON, rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)).eval()
    unscaled.load_state_dict(hf.state_dict())
    assert _generate(unscaled, PROMPTS[:4], tokenizer.eos_token_id) != expected  # the factors matter here
    llm = LLM(loaded=loaded, max_num_batched_tokens=32, kv_cache_memory_bytes=4 << 20)
    assert _tokens(llm.generate(PROMPTS[:4], GREEDY)) == expected
    no_leaks(llm.engine)


# K-quant shapes: every row a whole number of 256-weight super-blocks
K_SHAPES = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=4)


@pytest.mark.parametrize("dtype", ["Q4_K_M", "Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_gguf_is_served_as_stored_and_matches_transformers(tmp_path, tokenizer, gguf_tokenizer, dtype,
                                                                  no_leaks, monkeypatch, cpu_isa):
    """llama.cpp's K-quants kept as the file's blocks (the C kernels, and the one-call decode step
    where one type serves each product), greedy tokens equal to transformers' on their dequantization."""
    from slipstream.kernels import ggml_cpu
    from slipstream.server.models import quant

    if not ggml_cpu.available():
        pytest.skip("no C compiler here: the GGML CPU kernels cannot be built")
    monkeypatch.setenv("SLIPSTREAM_CACHE_DIR", str(tmp_path / "cache"))
    hf = _save(tmp_path / "hf", "qwen3", tokenizer, **K_SHAPES)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(_as_stored(p, dtype, name))
    gguf_path = tmp_path / "qwen3.gguf"
    _write_gguf(gguf_path, "qwen3", tmp_path / "hf", hf.config, dtype, gguf_tokenizer)
    loaded = load_model(str(gguf_path), torch.device("cpu"), torch.float32)
    net = loaded.model
    stored = {m.qtype for m in net.modules() if isinstance(m, (quant.QuantLinear, quant.QuantEmbedding))}
    mixed = [m for m in net.modules() if isinstance(m, quant.MixedQuantLinear)]
    if dtype == "Q4_K_M":  # q and k Q4_K beside v Q6_K: the fused q/k/v keeps both parts as stored
        assert stored == {"Q4_K", "Q5_K", "Q6_K"} and len(mixed) == 3, (stored, mixed)
        assert all(m.qtypes == ["Q4_K", "Q6_K"] for m in mixed)
        assert net.fused_plan() is None  # one type per product in the one-call step
    else:
        assert stored == {dtype} and not mixed
        assert net.fused_plan() is not None
    expected = _generate(hf, PROMPTS, tokenizer.eos_token_id)
    assert len({t for out in expected for t in out}) >= 20, expected
    llm = LLM(loaded=loaded, max_num_batched_tokens=32, kv_cache_memory_bytes=4 << 20)
    assert _tokens(llm.generate(PROMPTS, GREEDY)) == expected
    no_leaks(llm.engine)


# --- what is not supported ----------------------------------------------------------------

def test_unsupported_hf_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}')
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="DeepseekV3ForCausalLM.*not supported.*Qwen3MoeForCausalLM"):
        load_model(str(tmp_path), torch.device("cpu"), torch.float32)


def test_unsupported_gguf_architecture_is_named(tmp_path, monkeypatch):
    import gguf

    monkeypatch.setenv("SLIPSTREAM_CACHE_DIR", str(tmp_path / "cache"))
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "mamba")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="'mamba' is not supported.*qwen3moe"):
        load_model(str(tmp_path / "m.gguf"), torch.device("cpu"), torch.float32)


# Custom code a checkpoint ships (transformers' trust_remote_code): leaves a mark if anything runs it.
CUSTOM_CODE = "import pathlib\npathlib.Path(__file__).with_name('RAN').write_text('custom code ran')\n"


def _custom_code(path: Path, auto_map: dict) -> None:
    for module in {ref.split(".")[0] for refs in auto_map.values() for ref in ([refs] if isinstance(refs, str) else refs)
                   if ref}:
        (path / f"{module}.py").write_text(CUSTOM_CODE)


def test_a_checkpoint_of_custom_modeling_code_is_refused_naming_its_auto_map_and_none_of_it_runs(tmp_path):
    auto_map = {"AutoConfig": "configuration_acme.AcmeConfig", "AutoModelForCausalLM": "modeling_acme.AcmeForCausalLM"}
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["AcmeForCausalLM"], "model_type": "acme", "auto_map": auto_map}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    _custom_code(tmp_path, auto_map)
    with pytest.raises(ModelLoadError) as info:
        load_model(str(tmp_path), torch.device("cpu"), torch.float32)
    message = str(info.value)
    assert message.startswith(f"{tmp_path}: config.json has auto_map ")
    assert "modeling_acme.AcmeForCausalLM" in message and "['AcmeForCausalLM']" in message
    assert "trust_remote_code" in message and "runs no remote code" in message and "Qwen3ForCausalLM" in message
    assert not (tmp_path / "RAN").exists()


def test_custom_code_beside_an_architecture_we_implement_is_not_run_and_ours_serves_it(tmp_path, tokenizer, caplog):
    import logging

    _save(tmp_path, "qwen3", tokenizer)
    config = json.loads((tmp_path / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_qwen3.Qwen3Config",
                          "AutoModelForCausalLM": "modeling_qwen3.Qwen3ForCausalLM"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    tokenizer_config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    tokenizer_config["auto_map"] = {"AutoTokenizer": ["tokenization_qwen3.Qwen3Tokenizer", None]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    _custom_code(tmp_path, {**config["auto_map"], **tokenizer_config["auto_map"]})
    with caplog.at_level(logging.WARNING, logger="slipstream.loader"):
        loaded = load_model(str(tmp_path), torch.device("cpu"), torch.float32)
    assert loaded.config.architecture == "Qwen3ForCausalLM"
    assert "auto_map" in caplog.text and "modeling_qwen3.Qwen3ForCausalLM" in caplog.text
    assert "does not run" in caplog.text and "its own implementation" in caplog.text
    assert not (tmp_path / "RAN").exists()


def test_a_quantized_hf_checkpoint_is_refused_naming_its_method(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"], "quantization_config": {
        "quant_method": "gptq", "bits": 4}}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match=rf"^{re.escape(str(tmp_path))}: quantized checkpoints \(gptq\) are not "
                                             r"supported; use an fp16/bf16/fp32 checkpoint or a GGUF file$"):
        load_model(str(tmp_path), torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("quantization", ["auto", "none"])
def test_a_gguf_tensor_of_a_type_nothing_can_dequantize_is_named(tmp_path, monkeypatch, quantization):
    """Q8_K (llama.cpp's intermediate type for dot products) has no kernel here and no decoder in
    the gguf package: the error names the file, the tensor and the type."""
    import gguf
    import numpy as np

    monkeypatch.setenv("SLIPSTREAM_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(256)
    w.add_feed_forward_length(256)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_token_list([f"t{i}" for i in range(32)])
    w.add_tensor("token_embd.weight", np.ones((32, 256), dtype=np.float32))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(256, dtype=np.float32))  # the one layer block_count names
    _, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_K]  # bytes per 256 weights
    w.add_tensor("output.weight", np.zeros((32, type_size), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q8_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match=rf"^{re.escape(str(path))}: tensor output.weight uses quantization Q8_K, "
                                             "which the gguf package cannot dequantize$"):
        load_model(str(path), torch.device("cpu"), torch.float32, quantization=quantization)


# --- config rules, as transformers reads them ----------------------------------------------

def test_qwen3_moe_layers_follow_decoder_sparse_step_and_mlp_only_layers():
    from slipstream.server.models.hf_checkpoint import qwen3_moe_fields as _qwen3_moe_fields

    raw = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8, "decoder_sparse_step": 2,
           "mlp_only_layers": [3]}
    fields = _qwen3_moe_fields(raw, "Qwen3MoeForCausalLM", 6)
    assert fields["moe_layers"] == [1, 5] and fields["norm_topk_prob"] is False
    assert _qwen3_moe_fields({"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 8},
                             "MixtralForCausalLM", 3)["moe_layers"] == [0, 1, 2]


@pytest.mark.parametrize("arch, raw, want", [
    ("MixtralForCausalLM", {"sliding_window": 64}, [64, 64, 64]),
    ("Qwen3ForCausalLM", {"sliding_window": 64}, []),  # use_sliding_window is off by default
    ("Qwen3ForCausalLM", {"sliding_window": 64, "use_sliding_window": True, "max_window_layers": 2}, [None, None, 64]),
    ("Qwen3MoeForCausalLM", {"sliding_window": 64, "use_sliding_window": True}, [64, 64, 64]),
])
def test_sliding_window_layers_follow_transformers(arch, raw, want):
    from slipstream.server.models.hf_checkpoint import layer_windows as _layer_windows

    assert _layer_windows(raw, arch, 3) == want


@dataclass
class Damaged:
    path: Path
    bad: int  # the token whose embedding row is NaN
    expected: dict[int, list[int]]  # PROMPTS index -> transformers' greedy tokens on the clean weights


@pytest.fixture(scope="module")
def damaged(tmp_path_factory, tokenizer) -> Damaged:
    """A tiny Llama checkpoint with one token's embedding row NaN: a token of PROMPTS[0] that no
    other prompt holds and no clean continuation produces."""
    cfg = transformers.LlamaConfig(**COMMON, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    _randomize(hf, seed=11)
    clean = list(range(1, len(PROMPTS)))
    expected = dict(zip(clean, _generate(hf, [PROMPTS[i] for i in clean], tokenizer.eos_token_id)))
    seen = {t for i in clean for t in PROMPTS[i]} | {t for out in expected.values() for t in out}
    bad = next(t for t in PROMPTS[0] if t not in seen)
    with torch.no_grad():
        hf.model.embed_tokens.weight[bad] = float("nan")
    path = tmp_path_factory.mktemp("damaged")
    hf.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return Damaged(path, bad, expected)


def _assert_non_finite_error(out) -> None:
    assert out.outputs[0].finish_reason == "abort" and out.outputs[0].token_ids == []
    assert out.error and "not finite" in out.error and "NaN" in out.error


def test_a_nan_embedding_row_fails_the_requests_that_read_it_and_spares_the_rest_of_the_batch(damaged, no_leaks):
    """argmax over NaN logits picks an index, so without a check the engine served it as text. A
    request whose prompt holds the NaN token fails with an error saying the logits are not finite
    (greedy or sampled); the requests batched with it, and later ones given its freed blocks, get
    transformers' tokens; no block leaks."""
    llm = LLM(model=str(damaged.path), kv_cache_memory_bytes=4 << 20, max_num_batched_tokens=2048, trace=True)
    bad_first = [damaged.bad, *PROMPTS[0]]
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=MAX_TOKENS)
    outs = llm.generate([bad_first, *PROMPTS[1:4], bad_first], [GREEDY, GREEDY, GREEDY, GREEDY, sampled])
    assert len(llm.engine.trace[0].scheduled) == 5, "all five should share the first step"
    _assert_non_finite_error(outs[0])
    _assert_non_finite_error(outs[4])
    assert [o.error for o in outs[1:4]] == [None] * 3
    assert _tokens(outs[1:4]) == [damaged.expected[i] for i in (1, 2, 3)]
    # The damaged requests' freed blocks, NaN and all, are reused: unwritten slots must not leak in.
    outs = llm.generate([PROMPTS[4], PROMPTS[5], bad_first], GREEDY)
    assert _tokens(outs[:2]) == [damaged.expected[4], damaged.expected[5]]
    _assert_non_finite_error(outs[2])
    no_leaks(llm.engine)


@pytest.mark.parametrize("chunk", [None, 40])
def test_a_damaged_request_leaves_no_nan_blocks_in_the_prefix_cache(damaged, no_leaks, chunk):
    """The NaN token after a clean prefix: within its prefill chunk, attention's masked scores
    still multiply the NaN values by 0, so the clean positions before it get NaN K/V too. Those
    blocks carry the clean prefix's hashes: named for the prefix cache, every later request with
    that prefix (a chat's system prompt) failed. The damaged request fails at the step its rows go
    NaN, before its blocks are named; a clean request with the same prefix gets transformers'
    tokens, reusing only blocks computed before the NaN (chunk 40: the first chunk's two)."""
    llm = LLM(model=str(damaged.path), kv_cache_memory_bytes=4 << 20, trace=True,
              max_num_batched_tokens=chunk or 2048)
    prefix = PROMPTS[5][:50]  # PROMPTS[4] and [5] share it
    assert PROMPTS[4][:50] == prefix
    bad_later = [*prefix, damaged.bad, *PROMPTS[0][:30]]
    first = llm.generate([bad_later, PROMPTS[5]], GREEDY)
    _assert_non_finite_error(first[0])
    assert first[1].error is None and _tokens(first[1:]) == [damaged.expected[5]]
    assert first[1].num_cached_tokens == (32 if chunk else 0)
    again = llm.generate(PROMPTS[4], GREEDY)[0]
    assert again.error is None and _tokens([again]) == [damaged.expected[4]]
    no_leaks(llm.engine)
