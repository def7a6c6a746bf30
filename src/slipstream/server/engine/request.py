"""A request's state as the scheduler moves it from waiting to running to finished."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from slipstream.api_types.tenancy import DEFAULT_TENANT

from .outputs import Logprob, RequestMetrics
from .sampling_params import SamplingParams

if TYPE_CHECKING:
    from .structured_outputs import GrammarMatcher


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    """One sequence: a prompt and the tokens generated after it.

    ``num_computed_tokens`` counts tokens whose K/V is in the cache; a step moves it toward
    ``num_tokens`` (vLLM v1's single loop: prefill, chunked prefill, prefix hits and decode are
    the same move with different numbers). With ``n > 1`` each choice is its own Request, with
    ``group_id`` the caller's id and ``index`` the choice. ``tenant`` and ``priority`` (lower runs
    sooner) are what the scheduling policy orders by (:mod:`.fairness`).
    """

    request_id: str
    group_id: str
    index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    metrics: RequestMetrics
    tenant: str = DEFAULT_TENANT
    priority: int = 0
    token_ids: list[int] = field(default_factory=list)  # prompt + output
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    num_released_blocks: int = 0  # leading table entries released behind the sliding window (NULL_BLOCK)
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of full blocks
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    detokenizer: object = None
    grammar: GrammarMatcher | None = None  # structured outputs: advanced by each output token
    # Prompt logprobs computed so far when asked for (first entry None: nothing predicts token 0).
    prompt_logprobs: list[Logprob | None] | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_reusable_tokens(self) -> int:
        """Tokens at the head that a prefix-cache hit may cover: all but the last (its logits are
        needed), and while prompt logprobs are missing only those before the first missing one
        (a hit skips the positions that would predict them)."""
        limit = self.num_tokens - 1
        if self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens:
            limit = min(limit, len(self.prompt_logprobs) - 1)
        return limit

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
