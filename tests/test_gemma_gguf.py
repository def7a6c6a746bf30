"""Gemma 2 and Gemma 3 (text) GGUF files, llama.cpp's ``gemma2``/``gemma3`` architectures: greedy
output equals transformers' reading the same file, token for token, alone and batched, on prompts
longer than the 16-token sliding window; Q8_0 and Q4_0 files served as stored (the quantized
modules on the file's blocks), the Q8_0 one also chunked, preempted and prefix-cached.

The files are written here with ``gguf.GGUFWriter`` from tiny random Gemma models, in llama.cpp's
conventions (``convert_hf_to_gguf.py``): norm weights stored with 1 added, q/k rows not permuted,
Gemma's four norms as ``attn_norm``/``post_attention_norm``/``ffn_norm``/``post_ffw_norm``, the
LM head tied (no ``output.weight``). transformers' GGUF reader drops the soft-caps and the RoPE
scaling and has no ``query_pre_attn_scalar`` (llama.cpp takes ``head_dim``), so the oracle is given
them as config overrides; it must also agree with the source model, which checks the writer.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from slipstream.server.engine import LLM

from test_architectures import VOCAB, _as_stored, _file_type, gguf_tokenizer  # noqa: F401 (fixture)
from tiny_checkpoints import GREEDY, assert_not_degenerate, check_engine_modes, greedy, tokens

WINDOW = 16
HEAD_DIM = 32
SHAPES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
              head_dim=HEAD_DIM, sliding_window=WINDOW, max_position_embeddings=512, initializer_range=0.2,
              rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh")
ROPE_SCALING = {"rope_type": "linear", "factor": 8.0}
# config as llama.cpp reads the file, which transformers' GGUF reader leaves at its defaults
OVERRIDES = {
    "gemma2": dict(query_pre_attn_scalar=HEAD_DIM, attn_logit_softcapping=5.0, final_logit_softcapping=30.0),
    "gemma3": dict(query_pre_attn_scalar=HEAD_DIM, layer_types=["sliding_attention"] * 5 + ["full_attention"],
                   rope_parameters={"full_attention": {**ROPE_SCALING, "rope_theta": 1_000_000.0},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}),
}
GGUF_NAMES = {  # Hugging Face → llama.cpp for Gemma (gguf.constants.MODEL_TENSORS[MODEL_ARCH.GEMMA3])
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def _source(arch: str, eos: int):
    """A random Gemma model whose post-sublayer norms are drawn around 4 (see ``tiny_checkpoints``)."""
    import transformers

    if arch == "gemma2":
        config = transformers.Gemma2Config(**SHAPES, num_hidden_layers=4, **OVERRIDES["gemma2"],
                                           eos_token_id=eos, bos_token_id=1, pad_token_id=eos)
        cls = transformers.Gemma2ForCausalLM
    else:
        config = transformers.Gemma3TextConfig(**SHAPES, num_hidden_layers=6, **OVERRIDES["gemma3"],
                                               eos_token_id=eos, bos_token_id=1, pad_token_id=eos)
        cls = transformers.Gemma3ForCausalLM
    torch.manual_seed(sum(map(ord, arch)))
    model = cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".post_" in name and "norm" in name:
                p.normal_(4.0, 0.5)
    return model


def _write_gguf(path: Path, arch: str, model, dtype: str, tokenizer_fields: dict) -> None:
    """``model`` as a llama.cpp ``arch`` GGUF file, matrices in ``dtype``, norms in F32 (+1)."""
    import gguf
    import numpy as np

    c = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_sliding_window(c.sliding_window)
    if arch == "gemma2":
        w.add_rope_freq_base(10_000.0)
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        w.add_final_logit_softcapping(c.final_logit_softcapping)
    else:
        w.add_rope_freq_base(1_000_000.0)
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(ROPE_SCALING["factor"])
    for key, (value, types) in tokenizer_fields.items():
        w.add_key_value(key, value, types[0], types[-1] if len(types) > 1 else None)

    def add(name: str, t: torch.Tensor) -> None:
        array = t.detach().float().numpy()
        if "norm" in name:
            w.add_tensor(name, array + 1)
        elif _file_type(t, dtype).startswith("Q"):
            qtype = gguf.GGMLQuantizationType[dtype]
            w.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, array.astype(np.float16) if dtype == "F16" else array)

    state = {k.removeprefix("model."): v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    add("token_embd.weight", state.pop("embed_tokens.weight"))
    add("output_norm.weight", state.pop("norm.weight"))
    for i in range(c.num_hidden_layers):
        p = f"layers.{i}."
        for name in sorted(k for k in state if k.startswith(p)):
            add(f"blk.{i}.{GGUF_NAMES[name[len(p):].removesuffix('.weight')]}.weight", state.pop(name))
    assert not state, sorted(state)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _prompts() -> list[list[int]]:
    """Four prompts, three longer than the window (one over three windows), one shorter; the last
    two share their first 34 tokens (two full 16-token blocks and more, for prefix caching)."""
    g = torch.Generator().manual_seed(5)
    ps = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 23, 40, 57)]
    ps[3][:34] = ps[2][:34]
    return ps


@pytest.mark.parametrize("dtype", ["F32", "Q8_0", "Q4_0"])
@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_gguf_greedy_tokens_equal_transformers(tmp_path, monkeypatch, gguf_tokenizer, arch,  # noqa: F811
                                                     dtype, no_leaks):
    from transformers import AutoModelForCausalLM

    from slipstream.server.models.gemma import GemmaModel
    from slipstream.server.models.loader import load_model
    from slipstream.kernels import ggml_cpu
    from slipstream.server.models.quant import QuantEmbedding, QuantLinear

    monkeypatch.setenv("SLIPSTREAM_CACHE_DIR", str(tmp_path / "cache"))
    eos = int(gguf_tokenizer["tokenizer.ggml.eos_token_id"][0])
    model = _source(arch, eos)
    with torch.no_grad():  # what the file holds, back in fp32
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.copy_(_as_stored(p, dtype))
    gguf_path = tmp_path / f"{arch}.gguf"
    _write_gguf(gguf_path, arch, model, dtype, gguf_tokenizer)
    ps = _prompts()

    oracle = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=gguf_path.name, dtype=torch.float32,
                                                  attn_implementation="eager", **OVERRIDES[arch]).eval()
    expected = greedy(oracle, ps, eos)
    assert_not_degenerate(expected)
    assert greedy(model, ps, eos) == expected, "transformers should read the file as the model it was written from"

    loaded = load_model(str(gguf_path), torch.device("cpu"), torch.float32)
    cfg = loaded.config
    assert isinstance(loaded.model, GemmaModel) and cfg.tie_word_embeddings
    assert cfg.query_pre_attn_scalar == HEAD_DIM
    if arch == "gemma2":
        assert cfg.architecture == "Gemma2ForCausalLM" and cfg.layer_windows == [WINDOW, None] * 2
        assert (cfg.attn_logit_softcap, cfg.final_logit_softcap) == (5.0, 30.0)
    else:
        assert cfg.architecture == "Gemma3ForCausalLM" and cfg.layer_windows == [WINDOW] * 5 + [None]
        assert (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_scaling) == (1e6, 1e4, ROPE_SCALING)
    assert any(len(p) > 2 * WINDOW for p in ps)
    blocks = {type(m).__name__ for m in loaded.model.modules() if isinstance(m, (QuantLinear, QuantEmbedding))}
    # served as the file stores them: the quantized kernels on the file's blocks, not widened to fp32
    quantized = dtype.startswith("Q") and ggml_cpu.available()  # else dequantized (no C compiler here)
    assert blocks == ({"QuantLinear", "QuantEmbedding"} if quantized else set()), blocks

    if dtype == "Q8_0":  # the quantized file in every engine mode: chunked, preempted, prefix-cached too
        check_engine_modes(gguf_path, ps, expected, no_leaks)
        return
    alone = LLM(loaded=loaded, max_num_batched_tokens=512, kv_cache_memory_bytes=4 << 20)
    assert [tokens(alone.generate(p, GREEDY))[0] for p in ps] == expected
    no_leaks(alone.engine)
    batched = LLM(loaded=loaded, max_num_batched_tokens=1024, kv_cache_memory_bytes=4 << 20, trace=True)
    assert tokens(batched.generate(ps, GREEDY)) == expected
    assert len(batched.engine.trace[0].scheduled) == len(ps), "all prompts should share the first step"
    no_leaks(batched.engine)


def test_a_sentencepiece_tokenizer_in_a_gemma_gguf_encodes_as_sentencepiece_does(tmp_path, monkeypatch):
    """Real Gemma GGUFs carry a SentencePiece vocabulary (``tokenizer.ggml.model = llama``: pieces,
    scores, token types; no merges), not byte-level BPE. A small SentencePiece BPE model with
    Gemma's options (byte fallback, split digits, no dummy prefix, whitespace kept, chat-turn
    markers), written as llama.cpp's converter writes it, must encode every text as
    SentencePiece itself does, BOS first, markers whole."""
    import gguf
    import numpy as np
    import sentencepiece as spm

    from slipstream.server.models.loader import load_tokenizer

    monkeypatch.setenv("SLIPSTREAM_CACHE_DIR", str(tmp_path / "cache"))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(("The lighthouse keeper wrote in the log every night: wind from the west, three ships.\n"
                       "Item 12 costs 84 coins and weighs 14 pounds. Übermäßig große Häuser, café, naïve, 東京.\n"
                       "def f(x):\n    return x * 2  # tabs\tand  double  spaces\n") * 30)
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(tmp_path / "spm"), vocab_size=400, model_type="bpe", byte_fallback=True,
        split_digits=True, add_dummy_prefix=False, remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,
        normalization_rule_name="identity", character_coverage=1.0, pad_id=0, eos_id=1, bos_id=2, unk_id=3,
        user_defined_symbols=["<start_of_turn>", "<end_of_turn>"], minloglevel=2)
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "spm.model"))
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    kinds = [gguf.TokenType.UNKNOWN if sp.is_unknown(i) else gguf.TokenType.CONTROL
             if sp.is_control(i) or pieces[i].endswith("_of_turn>") else gguf.TokenType.BYTE if sp.is_byte(i)
             else gguf.TokenType.NORMAL for i in range(len(pieces))]
    path = tmp_path / "gemma-spm.gguf"
    w = gguf.GGUFWriter(str(path), "gemma2")
    w.add_tokenizer_model("llama")
    w.add_token_list(pieces)
    w.add_token_scores([sp.get_score(i) for i in range(len(pieces))])
    w.add_token_types([int(k) for k in kinds])
    for add, value in ((w.add_bos_token_id, 2), (w.add_eos_token_id, 1), (w.add_unk_token_id, 3),
                       (w.add_pad_token_id, 0), (w.add_add_bos_token, True), (w.add_add_eos_token, False),
                       (w.add_add_space_prefix, False)):
        add(value)
    w.add_tensor("token_embd.weight", np.zeros((len(pieces), 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    tok = load_tokenizer(str(path))
    texts = ["The lighthouse keeper", "  two spaces and\ttab", "Item 1234 costs 5 coins.", "café naïve 東京 ☃ 🙂",
             "<start_of_turn>user\nhi<end_of_turn>", "\n\nnewlines\n", " leading space", "x"]
    for text in texts:
        assert tok.encode(text) == [sp.bos_id()] + sp.encode(text), text
    assert tok.decode(tok.encode("café 🙂 1234"), skip_special_tokens=True) == "café 🙂 1234"
    assert len(tok.encode("🙂", add_special_tokens=False)) == 4, "an unseen character falls back to its bytes"
