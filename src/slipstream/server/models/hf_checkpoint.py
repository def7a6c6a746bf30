"""Read a Hugging Face checkpoint directory: ``config.json`` as a :class:`ModelConfig` (with the
architecture's own fields: Qwen3's q/k norms, experts, sliding windows, Gemma's), the
``*.safetensors`` weights and the tokenizer. Pickle checkpoints are refused."""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from ..weights.errors import ModelLoadError
from . import gemma
from .config import SUPPORTED_ARCHITECTURES, ModelConfig, eos_ids
from .layers import rope_inv_freq

log = logging.getLogger("slipstream.loader")


def read_hf_dir(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], object]:
    """Config, weights and tokenizer of the checkpoint directory ``path``. A config.json with
    ``auto_map`` (custom modeling code, transformers' ``trust_remote_code``) is served by our own
    implementation when its architecture is one we have (with a warning), else refused: no code
    from a checkpoint is ever run.

    Raises:
        ModelLoadError: what :func:`read_hf_config` raises; tensors that do not fit; no loadable
            tokenizer.
    """
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    cfg, files = read_hf_config(path)
    t0 = time.perf_counter()
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            weights.update(load_file(str(f)))
        except Exception as e:  # safetensors' own error type: a truncated or damaged file
            raise ModelLoadError(f"{f}: not a readable safetensors file, truncated or damaged? ({e})") from None
    log.info("read %d tensors from %d safetensors files in %.1f s", len(weights), len(files), time.perf_counter() - t0)
    try:
        # never a checkpoint's own tokenizer code, nor transformers' prompt asking whether to run it
        tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    except Exception as e:
        raise ModelLoadError(f"{path}: could not load the tokenizer ({e})") from None
    cfg.eos_token_ids = sorted(set(cfg.eos_token_ids) | eos_ids(tokenizer))
    return cfg, weights, tokenizer


def read_hf_config(path: Path) -> tuple[ModelConfig, list[Path]]:
    """The model config of the checkpoint directory ``path`` and its safetensors files, without
    reading a tensor (cheap: what a parallel engine checks its sizes against before starting ranks).

    Raises:
        ModelLoadError: no config.json; an unsupported architecture (with ``auto_map``: naming it
            and saying that no remote code runs); a quantized checkpoint; pickle weights only or no
            weights; config fields that do not fit.
    """
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{path}: no config.json (a Hugging Face checkpoint directory needs one)")
    raw = json.loads(config_file.read_text())
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    auto_map = raw.get("auto_map")
    if arch is None and auto_map:
        raise ModelLoadError(f"{path}: config.json has auto_map {auto_map!r}: architecture "
                             f"{archs or raw.get('model_type')!r} is custom modeling code shipped with the "
                             "checkpoint (transformers' trust_remote_code), and slipstream runs no remote code; "
                             f"it serves its own implementations only: {', '.join(SUPPORTED_ARCHITECTURES)}")
    if auto_map:
        log.warning("%s: config.json's auto_map %r names custom code, which slipstream does not run; "
                    "serving %s with its own implementation", path, auto_map, arch)
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
    if arch in gemma.ARCHITECTURES:
        try:  # defaults filled in (a multimodal config.json omits most of its text_config)
            raw = {**gemma.text_config(path), "architectures": [arch]}
            gemma_fields = gemma.config_fields(raw)
        except (ValueError, KeyError, TypeError) as e:
            raise ModelLoadError(f"{path}: {e}") from None
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
    cfg.layer_windows = layer_windows(raw, arch, cfg.num_layers)
    try:
        for name, value in qwen3_moe_fields(raw, arch, cfg.num_layers).items():
            setattr(cfg, name, value)
        cfg.__post_init__()
    except (ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(f"{path}: {e}") from None
    if arch in gemma.ARCHITECTURES:
        for name, value in gemma_fields.items():
            setattr(cfg, name, value)
    try:
        rope_inv_freq(cfg)
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from None
    return cfg, files


def qwen3_moe_fields(raw: dict, arch: str, num_layers: int) -> dict:
    """The :class:`ModelConfig` fields of q/k norm (Qwen3) and mixture of experts (Mixtral,
    Qwen3-MoE) from a ``config.json``, as transformers reads them: Mixtral routes every layer and
    always renormalizes the top-k weights; Qwen3-MoE routes layer ``i`` unless ``i`` is in
    ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0``, renormalizing only with
    ``norm_topk_prob``. ``{}`` for other architectures."""
    if arch == "Qwen3ForCausalLM":
        return {"qk_norm": True}
    if arch == "MixtralForCausalLM":
        experts = int(raw["num_local_experts"])
        return {"num_experts": experts, "num_experts_per_tok": int(raw.get("num_experts_per_tok", 2)),
                "moe_intermediate_size": int(raw["intermediate_size"]), "norm_topk_prob": True,
                "moe_layers": list(range(num_layers)) if experts else []}
    if arch == "Qwen3MoeForCausalLM":
        # transformers 5 writes num_local_experts; Qwen's own checkpoints say num_experts
        experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
        step = int(raw.get("decoder_sparse_step", 1))
        dense = set(raw.get("mlp_only_layers") or [])
        return {"qk_norm": True, "num_experts": experts, "num_experts_per_tok": int(raw["num_experts_per_tok"]),
                "moe_intermediate_size": int(raw["moe_intermediate_size"]),
                "norm_topk_prob": bool(raw.get("norm_topk_prob", False)),
                "moe_layers": [i for i in range(num_layers)
                               if experts and i not in dense and (i + 1) % step == 0]}
    return {}


def layer_windows(raw: dict, arch: str, num_layers: int) -> list[int | None]:
    """Each layer's sliding window (tokens; None: full attention), as transformers reads the config:
    Mistral and Mixtral slide in every layer, Qwen3-MoE too with ``use_sliding_window``; Qwen2 and
    Qwen3 only with ``use_sliding_window``, from layer ``max_window_layers`` on unless
    ``layer_types`` says otherwise; others by ``layer_types``.
    [] when no layer slides."""
    window = raw.get("sliding_window")
    qwen = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
    if not window or (arch in qwen and not raw.get("use_sliding_window")):
        return []
    types = raw.get("layer_types")
    if arch in ("MistralForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM"):  # every layer slides
        types = ["sliding_attention"] * num_layers
    elif types is None and arch in qwen:
        first = int(raw.get("max_window_layers", 0))
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    windows = [int(window) if t == "sliding_attention" else None for t in types or []]
    return windows if any(w is not None for w in windows) else []
