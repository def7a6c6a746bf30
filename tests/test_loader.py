"""Loading Hugging Face checkpoint directories of the Llama family, and clear errors otherwise.

Tiny random checkpoints are made with transformers itself and saved as safetensors; the oracle
is transformers' own greedy generate on the same files."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from slipstream.server.engine import LLM, SamplingParams
from slipstream.server.models import gguf_file
from slipstream.server.models.loader import ModelLoadError, load_model


def _save_tiny(tmp_path, loaded, arch: str, **overrides):
    import transformers

    tok = loaded.tokenizer
    common = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  initializer_range=0.2, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    common.update(overrides)
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[arch]
    torch.manual_seed(0)
    model = model_cls(config_cls(**common)).eval()
    if arch == "qwen2":  # random biases, so a loader that dropped them would be caught
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    path = tmp_path / arch
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return model, path


CASES = {
    "llama-tied-llama3-rope": ("llama", dict(tie_word_embeddings=True, rope_theta=50000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32})),
    # transformers 5 writes a default rope's theta only inside rope_parameters
    "llama-default-rope-theta": ("llama", dict(rope_theta=500000.0)),
    "qwen2-bias-untied": ("qwen2", dict(tie_word_embeddings=False)),
    "mistral-head-dim": ("mistral", dict(head_dim=32, sliding_window=None)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_hf_directory_matches_transformers(tmp_path, loaded, case):
    arch, overrides = CASES[case]
    hf, path = _save_tiny(tmp_path, loaded, arch, **overrides)
    prompts = [loaded.tokenizer.encode(t) for t in ("Hello, my name is", "The list of colours: red, green,")]
    expected = []
    with torch.inference_mode():
        for p in prompts:
            ids = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=40, min_new_tokens=40, do_sample=False, pad_token_id=0)
            expected.append(ids[0, len(p):].tolist())
    llm = LLM(model=str(path), max_num_batched_tokens=16)  # chunked, and a context crossing blocks
    got = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in got] == expected


def test_missing_path_is_named(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(str(tmp_path / "nope"), torch.device("cpu"), torch.float32)


def test_pickle_checkpoint_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    torch.save({"x": torch.zeros(1)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="pickle"):
        load_model(str(tmp_path), torch.device("cpu"), torch.float32)


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel.*not supported"):
        load_model(str(tmp_path), torch.device("cpu"), torch.float32)


def test_directory_without_config_is_named(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(str(tmp_path), torch.device("cpu"), torch.float32)


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(ModelLoadError, match="GGUF"):
        load_model(str(bad), torch.device("cpu"), torch.float32)


def test_a_gguf_whose_tensor_type_was_edited_without_its_bytes_is_refused(tmp_path, monkeypatch):
    """A header that says F16 where F32 bytes lie would read the next tensor's bytes as this one's."""
    import gguf

    monkeypatch.setenv("SLIPSTREAM_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "model.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for name in ("token_embd.weight", "output_norm.weight", "output.weight"):
        w.add_tensor(name, np.ones((64, 32), dtype=np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file()
    w.close()
    field = gguf.GGUFReader(str(path)).tensors[0].field  # parts: name length, name, n_dims, dims, type, offset
    at = field.offset + sum(int(part.nbytes) for part in field.parts[:4])
    data = bytearray(path.read_bytes())
    assert int.from_bytes(data[at:at + 4], "little") == gguf.GGMLQuantizationType.F32
    data[at:at + 4] = int(gguf.GGMLQuantizationType.F16).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=r"tensor output_norm.weight \(F32, \(32, 64\)\) starts at byte \d+, "
                                             r"but tensor token_embd.weight \(F16, \(32, 64\)\) ends at \d+"):
        load_model(str(path), torch.device("cpu"), torch.float32)
    # the last tensor's type edited: its data ends early, bytes follow it that no tensor claims
    data = bytearray(path.read_bytes())
    data[at:at + 4] = int(gguf.GGMLQuantizationType.F32).to_bytes(4, "little")
    field = gguf.GGUFReader(str(path)).tensors[-1].field
    last = field.offset + sum(int(part.nbytes) for part in field.parts[:4])
    data[last:last + 4] = int(gguf.GGMLQuantizationType.Q4_0).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=r"tensor output.weight \(Q4_0, \(32, 64\)\) ends at byte \d+, but the "
                                             r"file holds \d+ more bytes"):
        load_model(str(path), torch.device("cpu"), torch.float32)


def _tiny_gguf(path, layers: int = 2, tensors_of: int | None = None, drop: tuple[str, ...] = (),
               rename: dict[str, str] | None = None, extra: dict | None = None, **meta) -> None:
    """A small llama GGUF (random F32 tensors of ``tensors_of`` layers, default ``layers``), its
    metadata ``meta`` over the defaults (None drops a key), ``rename``-d tensors, ``extra`` ones."""
    import gguf

    values = {"llama.block_count": layers, "llama.context_length": 128, "llama.embedding_length": 64,
              "llama.feed_forward_length": 96, "llama.attention.head_count": 4,
              "llama.attention.head_count_kv": 2, "llama.attention.layer_norm_rms_epsilon": 1e-5,
              "tokenizer.ggml.eos_token_id": 2, **{k.replace("__", "."): v for k, v in meta.items()}}
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in values.items():
        if value is None:
            continue
        kind = gguf.GGUFValueType.FLOAT32 if isinstance(value, float) else gguf.GGUFValueType.UINT32
        w.add_key_value(key, value, kind)
    if "tokens" not in drop:
        w.add_token_list([f"t{i}" for i in range(8)])
    rng = np.random.default_rng(0)
    shapes = {"token_embd": (8, 64), "output_norm": (64,), "output": (8, 64)}
    for i in range(layers if tensors_of is None else tensors_of):
        shapes.update({f"blk.{i}.attn_norm": (64,), f"blk.{i}.attn_q": (64, 64), f"blk.{i}.attn_k": (32, 64),
                       f"blk.{i}.attn_v": (32, 64), f"blk.{i}.attn_output": (64, 64), f"blk.{i}.ffn_norm": (64,),
                       f"blk.{i}.ffn_gate": (96, 64), f"blk.{i}.ffn_up": (96, 64), f"blk.{i}.ffn_down": (64, 96)})
    for name, shape in shapes.items():
        name = (rename or {}).get(name, name)
        w.add_tensor(f"{name}.weight", rng.standard_normal(shape).astype(np.float32))
    for name, array in (extra or {}).items():
        w.add_tensor(name, array)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("edit, said", [
    (dict(llama__block_count=None), "GGUF key llama.block_count is missing"),
    (dict(llama__attention__head_count=0), "GGUF key llama.attention.head_count is 0; it must be a positive"),
    (dict(llama__context_length=0), "GGUF key llama.context_length is 0"),
    (dict(llama__attention__layer_norm_rms_epsilon=None), "layer_norm_rms_epsilon is missing"),
    (dict(layers=1, tensors_of=2), "llama.block_count says 1 layers, but the file holds tensors of layer 1"),
    (dict(layers=3, tensors_of=2), "llama.block_count says 3 layers, but the file holds tensors of no layer 2"),
    (dict(tokenizer__ggml__eos_token_id=10**9), "eos_token_id is 1000000000, outside the vocabulary of 8 tokens"),
    (dict(drop=("tokens",)), "holds no tokenizer (GGUF key tokenizer.ggml.tokens is missing)"),
    (dict(rename={"blk.0.attn_q": "blk.0.attn_X"}), "tensor blk.0.attn_X.weight is not one a GGUF llama model has"),
    (dict(rename={"output_norm": "output_nxrm"}), "tensor output_nxrm.weight is not one a GGUF llama model has"),
    (dict(llama__attention__layer_norm_rms_epsilon=float("nan")), "layer_norm_rms_epsilon is nan; it must be a finite"),
    (dict(llama__attention__layer_norm_rms_epsilon=925353388), "layer_norm_rms_epsilon is 925353388; it must be a"),
    (dict(llama__rope__freq_base=0.0), "GGUF key llama.rope.freq_base is 0.0; it must be a finite positive float"),
    (dict(llama__rope__dimension_count=0), "GGUF key llama.rope.dimension_count is 0; it must be a positive"),
    (dict(llama__attention__head_count_kv=3), "head_count (4) is not a multiple of llama.attention.head_count_kv (3)"),
    (dict(llama__attention__head_count_kv=4), "tensor blk.0.attn_k.weight has 32 rows, but the header's "
                                              "attention.head_count_kv (4) × head dim (16) is 64"),
    (dict(extra={"rope_freqs.weight": -np.ones(8, dtype=np.float32)}), "holds factors that are not finite and pos"),
    (dict(extra={"rope_freqs.weight": np.ones((2, 4), dtype=np.float32)}), "is F32 of shape (4, 2), not one F32"),
])
def test_a_damaged_gguf_header_is_a_load_error_naming_what_is_wrong(tmp_path, monkeypatch, edit, said):
    """Each of these was a traceback (TypeError, KeyError, ZeroDivisionError, AttributeError, IndexError)."""
    monkeypatch.setenv("SLIPSTREAM_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "model.gguf"
    _tiny_gguf(path, **edit)
    with pytest.raises(ModelLoadError) as err:
        load_model(str(path), torch.device("cpu"), torch.float32)
    assert str(err.value).count(str(path)) == 1 and said in str(err.value), str(err.value)


def test_a_gguf_tokenizer_transformers_cannot_convert_is_a_load_error(tmp_path, monkeypatch):
    monkeypatch.setenv("SLIPSTREAM_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "model.gguf"
    _tiny_gguf(path)  # tokens, but no tokenizer.ggml.model to say how they encode
    with pytest.raises(ModelLoadError, match=rf"^{re.escape(str(path))}: its tokenizer could not be converted"):
        load_model(str(path), torch.device("cpu"), torch.float32)


def test_checkpoint_missing_a_tensor_is_named(tmp_path, loaded):
    from safetensors.torch import load_file, save_file
    _, path = _save_tiny(tmp_path, loaded, "llama", tie_word_embeddings=True)
    weights = load_file(path / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="layers.1.mlp.up_proj.weight"):
        load_model(str(path), torch.device("cpu"), torch.float32)


@pytest.mark.slow
def test_gguf_weight_cache_round_trips_exactly(tmp_path, monkeypatch, loaded, caplog):
    import logging
    monkeypatch.setenv("SLIPSTREAM_CACHE_DIR", str(tmp_path))
    caplog.set_level(logging.INFO, logger="slipstream.loader")
    first = load_model("builtin", torch.device("cpu"), torch.float32, "none")  # parses, fills the cache
    assert any((tmp_path / "weights").glob("*/model.safetensors"))
    caplog.clear()
    second = load_model("builtin", torch.device("cpu"), torch.float32, "none")
    assert "cached dequantized" in caplog.text
    a, b = first.model.state_dict(), second.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert second.config == first.config
    assert second.model.lm_head.weight is second.model.embed_tokens.weight  # still tied


@pytest.mark.slow
def test_a_changed_gguf_replaces_its_cached_weights_and_tokenizer(tmp_path, monkeypatch):
    import os
    import shutil
    from slipstream.server.models.loader import builtin_model_path
    monkeypatch.setenv("SLIPSTREAM_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "model.gguf"
    shutil.copyfile(builtin_model_path(), gguf)
    os.utime(gguf, (1_000_000_000, 1_000_000_000))
    load_model(str(gguf), torch.device("cpu"), torch.float32, "none")
    first = {kind: sorted(p.name for p in (tmp_path / "cache" / kind).iterdir()) for kind in ("weights", "tokenizers")}
    os.utime(gguf, (2_000_000_000, 2_000_000_000))  # the file changed: new entries, old ones removed
    load_model(str(gguf), torch.device("cpu"), torch.float32, "none")
    for kind, before in first.items():
        after = sorted(p.name for p in (tmp_path / "cache" / kind).iterdir())
        assert len(before) == len(after) == 1 and after != before, kind


@pytest.mark.slow
def test_a_first_gguf_load_parses_the_header_once_and_its_tokenizer_is_transformers_conversion(tmp_path, monkeypatch):
    """The index and the tokenizer's conversion share one parse (seconds each for a 49k vocabulary)."""
    import gguf
    from transformers import AutoTokenizer
    from slipstream.server.models.loader import builtin_model_path

    monkeypatch.setenv("SLIPSTREAM_CACHE_DIR", str(tmp_path))
    real, real_open, opened = gguf.GGUFReader, gguf_file.open_reader, []

    def counting(path, *args, **kwargs):
        opened.append(("GGUFReader", str(path)))
        return real(path, *args, **kwargs)

    def counting_open(path):
        opened.append(("open_reader", str(path)))
        return real_open(path)

    monkeypatch.setattr(gguf, "GGUFReader", counting)
    monkeypatch.setattr(gguf_file, "open_reader", counting_open)
    loaded = load_model("builtin", torch.device("cpu"), torch.float32)
    assert opened == [("open_reader", str(builtin_model_path()))] and gguf.GGUFReader is counting
    path = builtin_model_path()
    oracle = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    text = "Hello, world! Ünïcode <|im_start|>user\n 12345"
    assert loaded.tokenizer(text)["input_ids"] == oracle(text)["input_ids"]
    assert loaded.tokenizer.get_vocab() == oracle.get_vocab()


def test_the_plain_reader_reads_what_gguf_reads():
    """open_reader parses a plain ndarray (3x faster than GGUFReader's memmap) to the same fields
    and tensors."""
    import gguf
    from slipstream.server.models.loader import builtin_model_path

    path = builtin_model_path()
    fast, slow = gguf_file.open_reader(path), gguf.GGUFReader(str(path))
    assert type(fast.data) is np.ndarray and isinstance(slow.data, np.memmap)
    assert list(fast.fields) == list(slow.fields)
    for name, field in slow.fields.items():
        assert fast.fields[name].types == field.types
        assert str(fast.fields[name].contents()) == str(field.contents()), name
    assert [(t.name, t.tensor_type, list(t.shape), t.data_offset) for t in fast.tensors] == \
        [(t.name, t.tensor_type, list(t.shape), t.data_offset) for t in slow.tensors]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(fast.tensors, slow.tensors))
