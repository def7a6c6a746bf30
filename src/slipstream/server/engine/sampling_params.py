"""Per-request sampling and stopping parameters (vLLM-shaped)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .errors import InvalidRequest, OutOfRange


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


# The ranges of the request fields, owned here: the API maps its names and types onto these fields
# and reports a refusal under its own name (OpenAI's limits: temperature <= 2, n <= 128, top-20 logprobs).
MAX_TEMPERATURE = 2.0
MAX_N = 128
MAX_LOGPROBS = 20
MAX_TOP_K = 1 << 30
MAX_LOGIT_BIAS = 100.0
SEED_RANGE = (-(1 << 63), 1 << 64)  # signed or unsigned 64-bit, as clients send them
TOKEN_ID_LIMIT = 1 << 31  # stop_token_ids: any int32 id (one the model lacks never matches)


@dataclass
class SamplingParams:
    """How one request samples and when it stops; the one place request limits are checked.

    Penalties follow OpenAI (presence, frequency: additive on logits of tokens already
    generated) and CTRL (repetition, Keskar et al. 2019, §4.1: divide positive logits, multiply
    negative ones, for tokens in prompt or output). ``temperature == 0`` is greedy, and so is
    ``top_p == 0`` (the limit of nucleus sampling as p -> 0 keeps only the most likely token; it is
    stored as ``temperature=0, top_p=1``). ``top_k`` -1 is stored as 0 (off).

    Raises:
        InvalidRequest: a value out of range (:class:`OutOfRange` for numbers); ``param`` names the field.
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
        self._check_ranges()
        if self.top_k == -1:
            self.top_k = 0
        if self.top_p == 0:
            self.temperature, self.top_p = 0.0, 1.0
        checks = [  # (ok, field, message): rules that are not a plain range
            (all(isinstance(s, str) and s for s in self.stop), "stop", "stop must not contain empty strings"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
             f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"),
        ]
        for ok, param, message in checks:
            if not ok:
                raise InvalidRequest(message, param)

    def _check_ranges(self) -> None:
        """Every numeric field inside its range, checked in field order (the first one out is reported)."""
        bias_out = next((v for v in (self.logit_bias or {}).values() if not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS),
                        None)
        ranges = [  # (field, value, ok, requirement)
            ("n", self.n, 1 <= self.n <= MAX_N, f"must be in [1, {MAX_N}]"),
            ("temperature", self.temperature, 0 <= self.temperature <= MAX_TEMPERATURE,
             f"must be in [0, {MAX_TEMPERATURE:g}]"),
            ("top_p", self.top_p, 0 <= self.top_p <= 1, "must be in [0, 1]"),
            ("top_k", self.top_k, self.top_k == -1 or 0 <= self.top_k <= MAX_TOP_K,
             "must be -1, 0 (off) or in [1, 2**30]"),
            ("min_p", self.min_p, 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("seed", self.seed, self.seed is None or SEED_RANGE[0] <= self.seed < SEED_RANGE[1],
             "must be a 64-bit integer, in [-2**63, 2**64)"),
            ("presence_penalty", self.presence_penalty, -2 <= self.presence_penalty <= 2, "must be in [-2, 2]"),
            ("frequency_penalty", self.frequency_penalty, -2 <= self.frequency_penalty <= 2, "must be in [-2, 2]"),
            ("repetition_penalty", self.repetition_penalty, self.repetition_penalty > 0, "must be > 0"),
            ("max_tokens", self.max_tokens, self.max_tokens is None or self.max_tokens >= 1, "must be >= 1"),
            ("min_tokens", self.min_tokens, self.min_tokens >= 0, "must be >= 0"),
            ("stop_token_ids", self.stop_token_ids, all(0 <= t < TOKEN_ID_LIMIT for t in self.stop_token_ids),
             "must be token ids in [0, 2**31)"),
            ("logprobs", self.logprobs, self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
             f"must be in [0, {MAX_LOGPROBS}]"),
            ("prompt_logprobs", self.prompt_logprobs,
             self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS, f"must be in [0, {MAX_LOGPROBS}]"),
            ("logit_bias", bias_out, bias_out is None, "values must be in [-100, 100]"),
        ]
        for param, value, ok, requirement in ranges:
            if not ok:
                raise OutOfRange(param, requirement, value)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
