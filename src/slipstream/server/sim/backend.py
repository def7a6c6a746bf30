"""``--model sim:PROFILE``: the real engine (scheduler, KV cache, sampler, detokenizer, API) with
a cost model in place of the forward pass.

The runner answers each step with logits that make the sampler pick a token drawn from a seeded
hash of (request, position), then sleeps for the step's modelled time (:mod:`.cost_model`) so
requests queue in real wall-clock time as they would on the modelled GPU. The KV pool is sized
from the profile's memory, so ``kv_cache_usage_perc`` means what it would on that GPU; the
tokenizer is the built-in model's. Model string::

    sim:PROFILE[,time_scale=S][,output_len=N|A-B][,seed=N][,load_seconds=S]

time_scale: wall seconds per modelled second (0.1 runs ten times faster than the GPU would).
output_len: end each request with EOS after N tokens (or a length drawn from A..B per request);
    without it requests run to ``max_tokens`` (EOS is never drawn).
seed: mixes into every request's token stream.
load_seconds: wall seconds the engine takes to build, as a real model's load and warm-up would
    (the pod turns Ready that much later; the autoscaler's cold-start tests use it).
"""
from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Callable

import torch

from ..engine.config import EngineConfig
from ..engine.engine import LLMEngine
from ..engine.model_runner import StepOutput
from ..engine.request import Request
from ..engine.scheduler import SchedulerOutput
from ..models.config import ModelConfig
from ..models.loader import LoadedModel, load_tokenizer
from .cost_model import batch_shape, step_time
from .options import SimOptions, parse_sim_model

log = logging.getLogger("slipstream.sim")

# The chosen token's logit; the rest are 0. Finite, so logprobs stay finite (JSON has no -inf),
# and large enough that temperature, top-p and penalties still pick it.
CHOSEN_LOGIT = 30.0
_MASK64 = (1 << 64) - 1
_SEED_CACHE_LIMIT = 1 << 14
# Simulated text uses the first 1024 ids of the vocabulary (211 common words in SmolLM2's).
WORD_ID_LIMIT = 1024


def _mix(x: int) -> int:
    """splitmix64's finalizer: a cheap, well-spread 64-bit hash of an integer."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def word_token_ids(tokenizer, below: int = WORD_ID_LIMIT) -> list[int]:
    """Ids under ``below`` of plain words with a leading space (byte-level BPE's ``Ġ``), so
    simulated text reads as words; every non-special id under ``below`` when there are too few.

    Low ids only: the logits the runner returns are as wide as the largest id it may draw, and
    the sampler's cost grows with that width (49k columns would cost more than the modelled step).
    """
    special = set(tokenizer.all_special_ids)
    limit = min(below, len(tokenizer))
    pieces = tokenizer.convert_ids_to_tokens(list(range(limit)))
    words = [i for i, p in enumerate(pieces)
             if i not in special and p and p.startswith("Ġ") and len(p) > 3 and p[1:].isascii() and p[1:].isalpha()]
    return words if len(words) >= 100 else [i for i in range(limit) if i not in special]


class SimRunner:
    """A :class:`~slipstream.server.engine.model_runner.StepRunner` whose steps take the cost
    model's time instead of running a model (no KV tensor, no prompt logprobs).

    Args:
        options: profile, time scale, output length, seed.
        vocab_size: the model's vocabulary (the largest logits width ever returned).
        eos_token_id: drawn at the configured output length.
        words: token ids drawn for text.
        sleep, clock: injectable for tests (seconds).
    """

    def __init__(self, options: SimOptions, vocab_size: int, eos_token_id: int | None, words: list[int],
                 sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic):
        self.options = options
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.words = words
        self._base_width = min(vocab_size, max(words + [eos_token_id or 0]) + 1)
        self._sleep, self._clock = sleep, clock
        self._seeds: dict[str, int] = {}
        self._last_end: float | None = None
        self._last_ids: set[str] = set()
        self.modelled_seconds = 0.0  # modelled time of every step so far
        self.steps = 0
        self.overruns = 0  # steps the engine's own CPU time made longer than modelled
        self._warned = False

    supports_prompt_logprobs = False

    def allocate_kv_cache(self, num_blocks: int, max_model_len: int) -> None:
        """Nothing to allocate: the scheduler's block pool is the whole simulated cache."""

    def run_with_prompt_logprobs(self, batch: SchedulerOutput, sample_rows: list[int], spans: list) -> tuple:
        raise NotImplementedError("the simulator computes no prompt logprobs (supports_prompt_logprobs is False)")

    def request_seed(self, req: Request) -> int:
        """The request's stream seed: its own ``seed`` if it set one, else a hash of its prompt;
        the same for a preempted request when it is recomputed."""
        seed = self._seeds.get(req.request_id)
        if seed is None:
            # hash() of a tuple of ints is the same in every process (only str/bytes hashing is salted).
            base = req.params.seed if req.params.seed is not None else hash(tuple(req.prompt_token_ids))
            seed = _mix((base ^ (self.options.seed * 0x9E3779B1) ^ (req.index << 48)) & _MASK64)
            if len(self._seeds) >= _SEED_CACHE_LIMIT:  # recomputing is only a hash: drop the oldest
                del self._seeds[next(iter(self._seeds))]
            self._seeds[req.request_id] = seed
        return seed

    def output_len(self, seed: int) -> int | None:
        """Tokens after which the request draws EOS (None: never)."""
        span = self.options.output_len
        if span is None:
            return None
        return span[0] + _mix(seed ^ 0x5EED) % (span[1] - span[0] + 1)

    def next_token(self, req: Request) -> int:
        """The token at the request's next output position."""
        seed = self.request_seed(req)
        position = req.num_output_tokens
        target = self.output_len(seed)
        if target is not None and position + 1 >= target and self.eos_token_id is not None:
            return self.eos_token_id
        return self.words[_mix(seed + position) % len(self.words)]

    def run(self, batch: SchedulerOutput, sample_rows: list[int]) -> StepOutput:
        """Logits ``[len(sample_rows), width]`` fp32 whose argmax is :meth:`next_token`, returned
        once the step's modelled time × ``time_scale`` has passed.

        ``width`` covers every id this runner draws and every stop id of the sampled requests,
        not the whole vocabulary: ids beyond it are never sampled (as with a one-hot row over the
        full vocabulary), and the sampler's cost grows with the width.
        """
        start = self._clock()
        modelled = step_time(self.options.profile,
                             batch_shape((r.num_computed_tokens, n) for r, n in zip(batch.requests, batch.num_new_tokens)))
        self.modelled_seconds += modelled
        self.steps += 1
        sampled = [batch.requests[i] for i in sample_rows]
        logits = torch.zeros(len(sampled), self._width(sampled))
        for row, req in enumerate(sampled):
            logits[row, self.next_token(req)] = CHOSEN_LOGIT
        ids = {r.request_id for r in batch.requests}
        # Back to back with the previous step (a request in both), the engine's own time since
        # that step ended counts toward this one: the modelled time is the step period.
        began = self._last_end if self._last_end is not None and ids & self._last_ids else start
        remaining = began + modelled * self.options.time_scale - self._clock()
        if remaining > 0:
            self._sleep(remaining)
        else:
            self._overran()
        self._last_end, self._last_ids = self._clock(), ids
        return StepOutput(logits)

    def _width(self, requests: list[Request]) -> int:
        # The sampler masks stop ids by index only while a request is short of min_tokens.
        stops = [t for r in requests if r.num_output_tokens < r.params.min_tokens for t in r.params.stop_token_ids]
        return min(self.vocab_size, max([self._base_width] + [t + 1 for t in stops]))

    def _overran(self) -> None:
        """Warn once when many steps took the engine longer on this CPU than the modelled time:
        the simulated GPU then runs slower than modelled (raise time_scale)."""
        self.overruns += 1
        if not self._warned and self.steps >= 200 and self.overruns * 5 > self.steps:
            self._warned = True
            log.warning("%d of %d steps took this CPU longer than modelled on %s: the simulation runs "
                        "slower than the GPU would; raise time_scale", self.overruns, self.steps,
                        self.options.profile.name)


def model_config(options: SimOptions, tokenizer) -> ModelConfig:
    """The engine's view of the simulated model: its attention shape (so KV blocks have the
    modelled size) with the built-in tokenizer's vocabulary and EOS."""
    m = options.profile.model
    eos = getattr(tokenizer, "eos_token_id", None)
    return ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=len(tokenizer), hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size, num_layers=m.num_layers, num_heads=m.num_heads,
        num_kv_heads=m.num_kv_heads, head_dim=m.head_dim, rms_norm_eps=1e-5, rope_theta=500000.0,
        max_position_embeddings=m.max_model_len, tie_word_embeddings=False,
        eos_token_ids=[int(eos)] if eos is not None else [])


def build_engine(config: EngineConfig, tokenizer=None, sleep: Callable[[float], None] = time.sleep) -> LLMEngine:
    """An :class:`LLMEngine` over ``config.model`` = ``sim:...``.

    The KV pool is ``memory × config.gpu_memory_utilization − weights`` of the profile's GPU unless
    ``config.kv_cache_memory_bytes`` is given, in which case that wins;
    KV is held in BF16 like the modelled GPU's. Engine limits (``max_num_seqs``, …) are the
    config's. Raises ValueError for a bad model string.
    """
    options = parse_sim_model(config.model)
    profile = options.profile
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer("builtin")
    kv_bytes = config.kv_cache_memory_bytes
    if kv_bytes is None:  # the modelled GPU's memory × the config's utilization, less the weights
        kv_bytes = replace(profile, gpu_memory_utilization=config.gpu_memory_utilization).kv_cache_bytes
    sim_config = replace(config, device="cpu", dtype="bfloat16", kv_cache_memory_bytes=kv_bytes)
    cfg = model_config(options, tokenizer)
    runner = SimRunner(options, cfg.vocab_size, cfg.eos_token_ids[0] if cfg.eos_token_ids else None,
                       word_token_ids(tokenizer), sleep=sleep)
    if options.load_seconds:
        log.info("simulating a model load of %g s", options.load_seconds)
        sleep(options.load_seconds)
    loaded = LoadedModel(None, cfg, tokenizer, options.name, config.model)
    engine = LLMEngine(sim_config, loaded=loaded, runner=runner)
    log.info("simulating %s on %s (%s), time scale %g: %.1f GiB KV cache", profile.model.name,
             profile.device.name, profile.name, options.time_scale, kv_bytes / 2**30)
    return engine
