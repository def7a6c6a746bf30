"""slipstream's engine and server. ``from slipstream.server import LLM, SamplingParams``.

Imports are lazy so that ``slipstream operator`` does not pay for torch.
"""
from __future__ import annotations

__all__ = ["LLM", "AsyncLLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "RequestRejected"]


def __getattr__(name: str):
    if name == "AsyncLLM":
        from .engine.async_llm import AsyncLLM
        return AsyncLLM
    if name in __all__:
        from . import engine
        return getattr(engine, name)
    raise AttributeError(f"module 'slipstream.server' has no attribute {name!r}")
