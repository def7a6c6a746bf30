"""Per-step records: what ran, what it cost. Cheap enough to build every step; kept only on request."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class StepRecord:
    """One engine step.

    ``scheduled`` holds ``(request_id, prefill_tokens, decode_tokens)`` per request; times are
    seconds (``forward_time``: input layout, model and sampler; ``step_time``: the whole step,
    so ``step_time - forward_time`` is the scheduler's and postprocessing's share).
    """

    step: int
    scheduled: list[tuple[str, int, int]] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_preemptions: int = 0
    num_blocks_used: int = 0
    num_blocks_total: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_utilization: float | None = None  # tokens held / slots allocated after the step (trace only; None: none running)
    forward_time: float = 0.0
    step_time: float = 0.0

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens


@dataclass
class EngineStats:
    """A snapshot of the engine's gauges and cumulative counters (tokens, requests, seconds)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of blocks referenced, 0..1
    num_blocks: int
    num_free_blocks: int
    num_preemptions_total: int
    prefix_cache_queries_total: int  # tokens
    prefix_cache_hits_total: int     # tokens
    prompt_tokens_total: int         # prompt tokens of admitted requests
    generation_tokens_total: int
    num_steps: int
    # the engine's settings, for the ``engine_config_info`` gauge (a gateway reads them there)
    block_size: int = 0              # tokens per KV block
    max_num_seqs: int = 0
    max_num_batched_tokens: int = 0  # tokens per step
    enable_prefix_caching: bool = False
    long_prefill_token_threshold: int = 0  # tokens; 0: off
    # per tenant (the fairness header's id): requests in the engine (waiting or running), running,
    # and the fairness counter (weighted tokens served; ``fair`` only)
    tenant_requests: dict[str, int] = field(default_factory=dict)
    tenant_running: dict[str, int] = field(default_factory=dict)
    tenant_served: dict[str, float] = field(default_factory=dict)
