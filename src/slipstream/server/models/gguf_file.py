"""Read a GGUF file: config, tensors (kept as stored or dequantized) and tokenizer.

Read with the ``gguf`` package. ``as_stored``: Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K tensors stay in their blocks
(:mod:`.quant`); other types are dequantized by ``gguf.quants``. The header's config and tensor
table, the dequantized fp32 weights and the converted tokenizer are each cached on disk
(:mod:`.disk_cache`): parsing and converting take seconds, reloading a fraction of one.
"""
from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..weights import disk_cache
from ..weights.errors import ModelLoadError
from . import quant
from .config import ModelConfig, eos_ids

log = logging.getLogger("slipstream.loader")

# GGUF tensor names → Hugging Face names (llama.cpp's convert script maps the other way).
GGUF_NAMES = {
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
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate_inp": "mlp.gate",
    # experts stacked 3-D ([E, rows, cols]); named without ".weight" (see _hf_name)
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
ROPE_FREQS = "rope_freqs"  # llama.cpp's per-pair RoPE frequency factors (Llama 3.1's rope scaling)
# Gemma's four norms per layer: llama.cpp's ffn_norm is the norm before the feed-forward there.
_GEMMA_NAMES = {**GGUF_NAMES, "post_attention_norm": "post_attention_layernorm",
                "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}


def read_gguf(path: Path, as_stored: bool) -> tuple[ModelConfig, dict, object, Path | None]:
    """Config, weights and tokenizer of a GGUF file, and the cache folder to fill (or None).

    ``as_stored``: Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K tensors come back as :class:`~.quant.GGMLTensor` (reading
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
    tokenizer = gguf_tokenizer(path)
    cfg.eos_token_ids = sorted(set(cfg.eos_token_ids) | eos_ids(tokenizer))
    return cfg, weights, tokenizer, entry if use_cache and cached is None and not kept else None



def gguf_config(path: Path) -> ModelConfig:
    """The model config of a GGUF file from its header (cached; no tensor is read).

    Raises:
        ModelLoadError: not a readable GGUF file, a split model, or fields that do not fit.
    """
    return _gguf_index(path)[0]

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


def write_weight_cache(tmp: Path, cfg: ModelConfig, net: torch.nn.Module) -> None:
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
    try:
        reader = open_reader(path)
    except Exception as e:  # a truncated or foreign file
        raise ModelLoadError(f"{path}: not a readable GGUF file, truncated or damaged? ({path.stat().st_size} bytes; "
                             f"the gguf reader says: {e})") from None
    _check_layout(reader, path)
    _PARSED[path.resolve()] = reader  # for the tokenizer's conversion, next in the same load
    split = reader.fields.get("split.count")
    if split is not None and int(split.contents()) > 1:
        raise ModelLoadError(f"{path}: one of {int(split.contents())} shards of a split GGUF model, which is not "
                             "supported yet; merge them into one file (llama.cpp: llama-gguf-split --merge FIRST-SHARD "
                             "OUT.gguf) and serve that")
    cfg = _gguf_config(reader, path)
    tensors = [_TensorInfo(t.name, t.tensor_type.name, tuple(int(d) for d in t.shape), int(t.data_offset),
                           int(t.n_bytes)) for t in reader.tensors]
    from dataclasses import asdict
    index = {"config": asdict(cfg), "tensors": [asdict(t) for t in tensors]}
    disk_cache.fill_cache(entry, lambda tmp: (tmp / "index.json").write_text(json.dumps(index)), path)
    return cfg, tensors


def _check_layout(reader, path: Path) -> None:
    """llama.cpp's check of the tensor table (``gguf_init_from_file_impl``): each tensor's data
    starts where the one before it ends, padded to the file's alignment, and the last ends within
    the file; and, as every GGUF writer pads each tensor, at most one alignment of bytes follows
    the last. A type or shape edited in the header without its bytes breaks this; served, it
    would read another tensor's bytes as its own.

    Raises :class:`ModelLoadError` naming the tensor out of place and the one described before it."""
    expected, size = int(reader.data_offset), int(reader.data.size)
    align, end, before = int(reader.alignment), int(reader.data_offset), "the header"

    def described(t) -> str:
        return f"tensor {t.name} ({t.tensor_type.name}, {tuple(int(d) for d in t.shape)})"

    for t in reader.tensors:
        if int(t.data_offset) != expected:
            raise ModelLoadError(f"{path}: {described(t)} starts at byte {int(t.data_offset)}, but {before} ends at "
                                 f"{expected}: the tensor table does not match the data (damaged file?)")
        end = expected + int(t.n_bytes)
        if end > size:
            raise ModelLoadError(f"{path}: {described(t)} ends at byte {end}, past the end of the file ({size} bytes; "
                                 "truncated?)")
        expected, before = -(-end // align) * align, described(t)
    if size - end >= align:
        raise ModelLoadError(f"{path}: {before} ends at byte {end}, but the file holds {size - end} more bytes: the "
                             "tensor table does not match the data (damaged file?)")


# GGUF ``general.architecture`` → the Hugging Face architecture it is served as. llama.cpp writes
# Mixtral as ``llama`` with ``llama.expert_count``; it permutes q/k rows only for ``llama``.
_GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
_GGUF_ROPE_PERMUTED = ("LlamaForCausalLM", "MixtralForCausalLM")
_GGUF_GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")


def _gguf_config(reader, path: Path) -> ModelConfig:
    def field(key: str, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    if arch not in _GGUF_ARCHITECTURES:
        raise ModelLoadError(f"{path}: GGUF architecture {arch!r} is not supported "
                             f"(supported: {', '.join(_GGUF_ARCHITECTURES)})")

    def a(key: str, default=None):
        return field(f"{arch}.{key}", default)

    def need(key: str, default=None):
        value = a(key, default)
        if value is None:
            raise ModelLoadError(f"{path}: GGUF key {arch}.{key} is missing; the model cannot be built without it")
        return value

    def positive(key: str, default=None) -> int:
        value = need(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
            raise ModelLoadError(f"{path}: GGUF key {arch}.{key} is {value!r}; it must be a positive integer")
        return int(value)

    def positive_float(key: str, default=None) -> float:
        value = need(key, default)
        if not isinstance(value, (float, np.floating)) or not math.isfinite(value) or value <= 0:
            raise ModelLoadError(f"{path}: GGUF key {arch}.{key} is {value!r}; it must be a finite positive float")
        return float(value)

    num_heads = positive("attention.head_count")
    num_kv_heads = positive("attention.head_count_kv", num_heads)
    if num_heads % num_kv_heads:
        raise ModelLoadError(f"{path}: GGUF key {arch}.attention.head_count ({num_heads}) is not a multiple of "
                             f"{arch}.attention.head_count_kv ({num_kv_heads})")
    hidden = positive("embedding_length")
    num_layers = positive("block_count")
    positive("context_length")
    head_dim = positive("attention.key_length") if a("attention.key_length") else \
        positive("rope.dimension_count", hidden // num_heads)
    rms_norm_eps = positive_float("attention.layer_norm_rms_epsilon")
    rope_theta = positive_float("rope.freq_base", 10000.0)
    tensors = {t.name: t for t in reader.tensors}
    _check_tensor_names(tensors, num_layers, arch, path)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ModelLoadError(f"{path}: the file holds no tokenizer (GGUF key tokenizer.ggml.tokens is missing)")
    embd = tensors.get("token_embd.weight")
    eos = field("tokenizer.ggml.eos_token_id")
    if eos is not None and not 0 <= int(eos) < len(tokens.data):
        raise ModelLoadError(f"{path}: GGUF key tokenizer.ggml.eos_token_id is {eos}, outside the vocabulary of "
                             f"{len(tokens.data)} tokens")
    experts = int(a("expert_count", 0) or 0)
    hf_arch = "MixtralForCausalLM" if arch == "llama" and experts else _GGUF_ARCHITECTURES[arch]
    try:
        cfg = ModelConfig(
            architecture=hf_arch,
            # the embedding's rows, which a file may hold more or fewer of than tokenizer entries
            vocab_size=int(embd.shape[1]) if embd is not None else int(a("vocab_size", 0)
                                                                       or len(field("tokenizer.ggml.tokens"))),
            hidden_size=hidden,
            intermediate_size=int(a("feed_forward_length", 0)),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=rms_norm_eps,
            rope_theta=rope_theta,
            max_position_embeddings=int(a("context_length")),
            tie_word_embeddings="output.weight" not in tensors,
            attention_bias="blk.0.attn_q.bias" in tensors,
            eos_token_ids=[int(eos)] if eos is not None else [],
            qk_norm="blk.0.attn_q_norm.weight" in tensors,
        )
    except ModelLoadError:
        raise
    except ValueError as e:  # ModelConfig's own checks (heads dividing the hidden size, ...)
        raise ModelLoadError(f"{path}: {e}") from None
    if experts:
        cfg.moe_layers = [i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" in tensors]
        legacy = [i for i in cfg.moe_layers if f"blk.{i}.ffn_gate_exps.weight" not in tensors]
        if legacy:
            raise ModelLoadError(f"{path}: layer {legacy[0]} stores its experts one tensor each (an old llama.cpp "
                                 "layout); convert the model again with a current convert_hf_to_gguf.py")
        cfg.num_experts = experts
        cfg.num_experts_per_tok = positive("expert_used_count")
        cfg.moe_intermediate_size = int(a("expert_feed_forward_length", 0) or cfg.intermediate_size)
        # llama.cpp renormalizes the top-k weights of Mixtral and Qwen3-MoE unless the file says not to
        cfg.norm_topk_prob = bool(a("expert_weights_norm", True))
        try:
            cfg.__post_init__()
        except ValueError as e:
            raise ModelLoadError(f"{path}: {e}") from None
    scaling_type = a("rope.scaling.type")
    if scaling_type not in (None, "none"):
        if scaling_type != "linear":
            raise ModelLoadError(f"{path}: GGUF rope scaling {scaling_type!r} is not supported")
        cfg.rope_scaling = {"rope_type": "linear", "factor": float(a("rope.scaling.factor"))}
    freqs = tensors.get(f"{ROPE_FREQS}.weight")
    if freqs is not None:
        shape = tuple(int(d) for d in freqs.shape)
        if freqs.tensor_type.name != "F32" or shape != (cfg.head_dim // 2,):
            raise ModelLoadError(f"{path}: tensor {ROPE_FREQS}.weight is {freqs.tensor_type.name} of shape {shape}, "
                                 f"not one F32 factor per rotary pair ({cfg.head_dim // 2},)")
        factors = np.asarray(freqs.data, dtype=np.float32).reshape(-1)
        if not (np.isfinite(factors).all() and (factors > 0).all()):
            raise ModelLoadError(f"{path}: tensor {ROPE_FREQS}.weight holds factors that are not finite and "
                                 f"positive (min {factors.min()!r}, max {factors.max()!r})")
        if cfg.rope_scaling:
            raise ModelLoadError(f"{path}: tensor {ROPE_FREQS}.weight and the key {arch}.rope.scaling.type both "
                                 "scale RoPE; a file has one or the other")
        cfg.rope_scaling = {"rope_type": "freq_factors", "factors": [float(f) for f in factors]}
    if hf_arch in _GGUF_GEMMA:
        for name, value in _gemma_fields(a, hf_arch, cfg).items():
            setattr(cfg, name, value)
    return cfg


def _check_tensor_names(tensors: dict, num_layers: int, arch: str, path: Path) -> None:
    """Every tensor is one the model reads (``rope_freqs``: RoPE frequency factors, read into the
    config), and the layers' tensors are those of layers 0 to ``block_count`` - 1.

    Raises :class:`ModelLoadError` naming the first tensor that is not."""
    names = _GEMMA_NAMES if arch in ("gemma2", "gemma3") else GGUF_NAMES
    layers = set()
    for name in tensors:
        parts = name.split(".")
        known = parts[0] == ROPE_FREQS or (parts[0] == "blk" and len(parts) >= 3 and parts[1].isdigit()
                                           and parts[2] in names) or (parts[0] != "blk" and parts[0] in names)
        if not known:
            raise ModelLoadError(f"{path}: tensor {name} is not one a GGUF {arch} model has")
        if parts[0] == "blk":
            layers.add(int(parts[1]))
    if layers != set(range(num_layers)):
        extra = sorted(layers - set(range(num_layers)))
        missing = sorted(set(range(num_layers)) - layers)
        raise ModelLoadError(f"{path}: {arch}.block_count says {num_layers} layers, but the file holds tensors "
                             + (f"of layer {extra[0]}" if extra else f"of no layer {missing[0]}"))


def _gemma_fields(a, hf_arch: str, cfg: ModelConfig) -> dict:
    """Gemma's :class:`ModelConfig` fields as llama.cpp reads a ``gemma2``/``gemma3`` file
    (``llama_load_hparams``): local layers every other one (Gemma 2) or five in six (Gemma 3,
    RoPE base 10,000 there), soft-caps only in Gemma 2 (default 50 and 30), and an attention scale
    from ``hidden / heads`` for the 27B models (46 and 62 layers) and from ``head_dim`` otherwise."""
    gemma3 = hf_arch == "Gemma3ForCausalLM"
    pattern = a("attention.sliding_window_pattern", 6 if gemma3 else 2)
    window = a("attention.sliding_window")
    if isinstance(pattern, list):  # newer files: one flag per layer, true for the local ones
        local = [bool(p) for p in pattern]
    else:
        local = [bool((i + 1) % int(pattern)) for i in range(cfg.num_layers)]
    is_27b = cfg.num_layers == (62 if gemma3 else 46)
    return {
        "layer_windows": [int(window) if window and w else None for w in local],
        "attn_logit_softcap": None if gemma3 else float(a("attn_logit_softcapping", 50.0)),
        "final_logit_softcap": None if gemma3 else float(a("final_logit_softcapping", 30.0)),
        "query_pre_attn_scalar": float(cfg.hidden_size // cfg.num_heads if is_27b else cfg.head_dim),
        "rope_local_theta": 10_000.0 if gemma3 else None,
    }


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
        if t.name == f"{ROPE_FREQS}.weight":  # read into cfg.rope_scaling by _gguf_config
            continue
        qtype = t.qtype
        if t.offset + t.nbytes > data.size:
            raise ModelLoadError(f"{path}: tensor {t.name} lies past the end of the file (truncated?)")
        raw = data[t.offset:t.offset + t.nbytes]
        rows = int(np.prod(t.shape[1:], dtype=np.int64))
        keep = as_stored and quant.supported(qtype) and len(t.shape) in (2, 3)  # 3-D: stacked experts
        if keep:
            # [rows, row bytes] (experts: [experts, rows, row bytes]), the file's blocks
            array = np.array(raw.reshape(*reversed(t.shape[1:]), -1), copy=True)
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
        name = _hf_name(t.name, _GEMMA_NAMES if cfg.architecture in _GGUF_GEMMA else GGUF_NAMES)
        if cfg.architecture in _GGUF_GEMMA and name.endswith("norm.weight"):
            array = array - 1  # llama.cpp's converter stores Gemma's zero-centred norm weights + 1
        if cfg.architecture in _GGUF_ROPE_PERMUTED and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_heads if name.endswith("q_proj.weight") else cfg.num_kv_heads
            if array.shape[0] != heads * cfg.head_dim:
                key = "head_count" if name.endswith("q_proj.weight") else "head_count_kv"
                raise ModelLoadError(f"{path}: tensor {t.name} has {array.shape[0]} rows, but the header's "
                                     f"attention.{key} ({heads}) × head dim ({cfg.head_dim}) is {heads * cfg.head_dim}")
            array = _unpermute_rope(array, heads)  # permutes whole rows: blocks stay intact
        tensor = torch.from_numpy(array)
        weights[name] = quant.GGMLTensor(tensor, qtype, tuple(reversed(t.shape))) if keep else tensor
    if dequantized:
        log.info("no CPU kernel for %s: those tensors are served dequantized to fp32", ", ".join(sorted(dequantized)))
    kept = sorted({w.qtype for w in weights.values() if isinstance(w, quant.GGMLTensor)})
    log.info("read %d GGUF tensors in %.1f s (%s)", len(weights), time.perf_counter() - t0,
             f"{', '.join(kept)} kept as stored" if kept else "dequantized to fp32")
    return cfg, weights


def _hf_name(gguf_name: str, names: dict[str, str] = GGUF_NAMES) -> str:
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        suffix = "" if parts[2].endswith("_exps") else f".{parts[3]}"  # stacked experts: Experts' own names
        return f"model.layers.{parts[1]}.{names[parts[2]]}{suffix}"
    return f"{names[parts[0]]}.{parts[1]}"


def _unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved rotary pairs) back to HF's half-split
    layout, so one RoPE implementation serves GGUF and safetensors checkpoints."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# A header parsed for the index (seconds for a large vocabulary), kept for the tokenizer's
# conversion, which would parse it again; dropped once that has run.
_PARSED: dict[Path, object] = {}


def open_reader(path: Path):
    """``gguf.GGUFReader(path)`` parsing a plain ndarray view of the file's memory map.

    The reader slices its buffer once per header value (about a million slices for a 49k-token
    vocabulary), and ``np.memmap``'s per-slice ``__array_finalize__`` made that three times slower
    (the built-in model's header: 2.0 s -> 0.6 s). Fields and tensors are the same.
    Raises what ``GGUFReader`` raises (``ValueError`` for a foreign file, ...)."""
    return _plain_reader()(str(path))


@functools.cache
def _plain_reader() -> type:
    from gguf.gguf_reader import GGUFReader  # the class itself, even while _reader_reused stands in

    class PlainReader(GGUFReader):
        @property
        def data(self) -> np.ndarray:
            return self._data

        @data.setter
        def data(self, value: np.ndarray) -> None:
            self._data = value.view(np.ndarray)  # its .base keeps the map open

    return PlainReader


@contextlib.contextmanager
def _reader_reused(path: Path, reader: object | None):
    """While transformers converts the tokenizer of ``path``, ``gguf.GGUFReader(path)`` (which
    transformers calls) returns ``reader``, the one :func:`_gguf_index` built, or else one from
    :func:`open_reader`."""
    import gguf

    real = gguf.GGUFReader

    def reuse(file, *args, **kwargs):
        if args or kwargs or Path(file).resolve() != path.resolve():
            return real(file, *args, **kwargs)
        return reader if reader is not None else open_reader(path)

    gguf.GGUFReader = reuse
    try:
        yield
    finally:
        gguf.GGUFReader = real


def gguf_tokenizer(path: Path):
    """transformers tokenizer converted from the GGUF, cached under ``$SLIPSTREAM_CACHE_DIR``."""
    from transformers import AutoTokenizer

    reader = _PARSED.pop(path.resolve(), None)
    cached = disk_cache.cache_entry(path, "tokenizers")
    if (cached / "tokenizer_config.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(cached))
        except Exception as e:  # a damaged cache is rebuilt, never fatal
            log.warning("tokenizer cache %s unreadable (%s); rebuilding", cached, e)
    t0 = time.perf_counter()
    log.info("converting the GGUF tokenizer (once; cached in %s)", cached)
    try:
        with _reader_reused(path, reader):
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:  # transformers' conversion of a damaged or unusual tokenizer
        raise ModelLoadError(f"{path}: its tokenizer could not be converted ({type(e).__name__}: {e})") from None
    disk_cache.fill_cache(cached, lambda tmp: tokenizer.save_pretrained(str(tmp)), path)
    log.info("tokenizer converted in %.1f s", time.perf_counter() - t0)
    return tokenizer
