"""The continuous-batching engine: scheduler, paged KV cache, model runner, sampler, detokenizer."""
from .config import EngineConfig
from .engine import LLMEngine
from .errors import InvalidRequest, RequestRejected
from .llm import LLM
from .outputs import CompletionOutput, FinishReason, Logprob, RequestOutput
from .sampling_params import SamplingParams

__all__ = ["EngineConfig", "LLMEngine", "LLM", "InvalidRequest", "RequestRejected", "SamplingParams", "RequestOutput",
           "CompletionOutput", "FinishReason", "Logprob"]
