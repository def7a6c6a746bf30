"""The continuous-batching engine: scheduler, paged KV cache, model runner, sampler, detokenizer.

Names are imported on first use, so that a module of the package (``engine.config``, the model
runner) can be imported without the whole engine: a tensor-parallel worker process starts from
:mod:`slipstream.server.distributed.worker`, which the engine itself imports.
"""
from __future__ import annotations

import importlib

_HOMES = {"EngineConfig": "config", "LLMEngine": "engine", "InvalidRequest": "errors", "RequestRejected": "errors",
          "LLM": "llm", "SamplingParams": "sampling_params", "RequestOutput": "outputs",
          "CompletionOutput": "outputs", "FinishReason": "outputs", "Logprob": "outputs"}
__all__ = list(_HOMES)


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
