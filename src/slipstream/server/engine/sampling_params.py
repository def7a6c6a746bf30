"""Per-request sampling and stopping parameters (vLLM-shaped)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .errors import InvalidRequest


@dataclass
class StructuredOutputsParams:
    """A constraint on a request's output text (vLLM's ``structured_outputs``); exactly one is set.

    json: a JSON Schema (an object, or its JSON text) the output must validate against.
    json_object: any JSON object (OpenAI's ``response_format: {"type": "json_object"}``).
    regex: a regular expression the whole output must match.
    choice: the output is exactly one of these strings.
    grammar: a Lark grammar in llguidance's syntax (may embed ``%json {...}`` schemas).

    Raises:
        ValueError: none or more than one constraint given.
    """

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise InvalidRequest(f"structured_outputs needs exactly one of json, json_object, regex, choice, grammar; "
                             f"got {', '.join(given) or 'none'}", "structured_outputs")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise InvalidRequest("structured_outputs.choice must be a non-empty list of strings",
                                 "structured_outputs.choice")


@dataclass
class SamplingParams:
    """How one request samples and when it stops.

    Penalties follow OpenAI (presence, frequency: additive on logits of tokens already
    generated) and CTRL (repetition, Keskar et al. 2019, §4.1: divide positive logits, multiply
    negative ones, for tokens in prompt or output). ``temperature == 0`` is greedy.

    Raises:
        InvalidRequest: a value out of range; ``param`` names the field.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token; 0: only the sampled one
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False  # keep the stop string that ended the text (vLLM)
    prompt_logprobs: int | None = None  # top-N logprobs per prompt token (vLLM); 0: only the prompt's own
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100] (OpenAI)
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        checks = [  # (ok, field, message)
            (self.n >= 1, "n", f"n must be >= 1, got {self.n}"),
            (self.temperature >= 0, "temperature", f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, "top_p", f"top_p must be in (0, 1], got {self.top_p}"),
            (0 <= self.top_k <= 1 << 30, "top_k", f"top_k must be -1, 0 (off) or in [1, 2**30], got {self.top_k}"),
            (all(0 <= t < 1 << 31 for t in self.stop_token_ids), "stop_token_ids",
             "stop_token_ids must be token ids in [0, 2**31)"),
            (0 <= self.min_p <= 1, "min_p", f"min_p must be in [0, 1], got {self.min_p}"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty",
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty",
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.repetition_penalty > 0, "repetition_penalty",
             f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens",
             f"max_tokens must be >= 1, got {self.max_tokens}"),
            (self.min_tokens >= 0, "min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
             f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"),
            (all(isinstance(s, str) and s for s in self.stop), "stop", "stop must be non-empty strings"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs",
             f"logprobs must be in [0, 20], got {self.logprobs}"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20, "prompt_logprobs",
             f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}"),
            (all(-100 <= v <= 100 for v in (self.logit_bias or {}).values()), "logit_bias",
             "logit_bias values must be in [-100, 100]"),
        ]
        for ok, param, message in checks:
            if not ok:
                raise InvalidRequest(message, param)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
