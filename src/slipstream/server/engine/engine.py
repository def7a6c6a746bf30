"""LLMEngine: add requests, step, get increments. A request's path reads top to bottom:
``add_request`` → ``step`` (schedule → run → sample → postprocess) → outputs."""
from __future__ import annotations

import collections
import logging
import random
import time
import uuid
from dataclasses import replace

import torch

from slipstream.api_types.tenancy import DEFAULT_TENANT

from ..distributed.executor import ParallelRunner, RankFailed, threads_per_rank
from ..models import crossover
from ..models.loader import LoadedModel, load_model
from .config import CPU_KV_CACHE_BYTES, DTYPES, EngineConfig
from .detokenizer import IncrementalDetokenizer
from .errors import InvalidRequest, RequestRejected
from .fairness import WaitingQueue
from .kv_cache import KVCacheManager
from .memory import plan_kv_cache
from .model_runner import ModelRunner, StepRunner, prompt_spans
from .outputs import CompletionOutput, FinishReason, RequestMetrics, RequestOutput
from .request import Request
from .sampler import NON_FINITE, Sampler
from .sampling_params import SamplingParams
from .scheduler import NO_STOP, Scheduler, SchedulerOutput
from .structured_outputs import GrammarCompiler, GrammarMatcher
from .threads import choose_threads, cpu_limit, release_openmp_team
from .trace import EngineStats, StepRecord

log = logging.getLogger("slipstream.engine")

NON_FINITE_ERROR = ("internal error in model: the logits are not finite (NaN or infinity); "
                    "the weights or the numerics are broken")

def resolve_device(config: EngineConfig) -> tuple[torch.device, torch.dtype]:
    device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    name = config.dtype or ("float32" if device.type == "cpu" else "bfloat16")
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return device, DTYPES[name]


class LLMEngine:
    """The continuous-batching engine on one device.

    Args:
        config: engine settings (see :class:`EngineConfig`).
        loaded: an already loaded model to reuse (tests and benchmarks build several engines
            over one model); ``config.model`` is then only a name.
        runner: a :class:`StepRunner` to use instead of the model's forward pass (the simulator's
            cost model); ``loaded.model`` may then be None. Requests with ``prompt_logprobs`` need
            a runner that ``supports_prompt_logprobs``.

    Raises:
        ModelLoadError: the model could not be loaded.
        ValueError: settings that cannot work (a KV budget smaller than one block, a
            ``max_model_len`` beyond the model's context, GPU memory that leaves no room for one
            ``max_model_len`` request).
    """

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None, runner=None):
        self.config = config
        self.num_threads: int | None = None  # decided by the first apply_threads
        self.device, self.dtype = resolve_device(config)
        torch.manual_seed(config.seed)
        self.apply_threads()
        if config.world_size > 1:
            if loaded is not None or runner is not None:
                raise ValueError("a parallel engine starts its ranks and loads each one's slice itself: "
                                 "pass neither a loaded model nor a runner")
            runner = ParallelRunner(config, self.device, self.dtype, self.num_threads)
            loaded = runner.loaded
        loaded = loaded or load_model(config.model, self.device, self.dtype, config.quantization)
        if self.device.type == "cpu" and runner is None and loaded.model is not None:
            crossover.apply(crossover.calibrate(loaded.model, self.num_threads))
        self.model_name = loaded.name
        self.model_config = cfg = loaded.config
        self.tokenizer = loaded.tokenizer
        if config.max_model_len and config.max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's context "
                             f"of {cfg.max_position_embeddings} tokens")
        self.max_model_len = config.max_model_len or cfg.max_position_embeddings
        kv_cfg = cfg if loaded.model is None else loaded.model.cfg  # a parallel rank's own layers and KV heads
        block_bytes = config.block_size * kv_cfg.kv_bytes_per_token(torch.finfo(self.dtype).bits // 8)
        self.runner: StepRunner = runner or ModelRunner(loaded.model, config.block_size, self.device, self.dtype,
                                                        max_num_seqs=config.max_num_seqs,
                                                        enforce_eager=config.enforce_eager)
        kv_bytes = self._kv_cache_bytes(block_bytes)
        num_blocks = kv_bytes // block_bytes
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory_bytes={kv_bytes} holds no KV block "
                             f"(one block of {config.block_size} tokens needs {block_bytes} bytes)")
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching, cfg.kv_window)
        capacity = self._request_capacity()
        if capacity < self.max_model_len:
            if config.max_model_len:  # asked for: kept, longer requests are refused with the cache's size
                log.warning("max_model_len %d exceeds the KV cache's %d tokens: requests needing more are rejected",
                            self.max_model_len, capacity)
            else:  # the model's own context: advertise what the cache can hold instead
                log.warning("the KV cache holds %d tokens, fewer than the model's context of %d: max_model_len "
                            "is %d (give more --kv-cache-memory-bytes to raise it)", capacity, self.max_model_len,
                            capacity)
                self.max_model_len = capacity
        self.runner.allocate_kv_cache(num_blocks, self.max_model_len)
        waiting = WaitingQueue(config.scheduling_policy, config.tenant_weights,
                               cached_blocks=self.kv.cached_prefix_blocks)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   cfg.eos_token_ids, self.max_model_len, waiting,
                                   config.long_prefill_token_threshold)
        self.eos_token_ids = list(cfg.eos_token_ids)
        self.sampler = Sampler(self.eos_token_ids)
        self.grammars = GrammarCompiler(self.tokenizer, cfg.vocab_size, self.eos_token_ids)
        self.groups: dict[str, list[Request]] = {}
        self._rng = random.Random(config.seed)
        self.num_steps = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.trace: list[StepRecord] = []
        self.step_listeners: list = []
        log.info("KV cache: %d blocks of %d tokens (%.0f MiB), max_model_len %d", num_blocks, config.block_size,
                 num_blocks * block_bytes / 2**20, self.max_model_len)
        release_openmp_team()  # the loading thread's workers; the stepping thread starts its own

    def close(self) -> None:
        """Stop the worker ranks of a tensor-parallel engine (nothing to do for one process)."""
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    def check_ranks(self) -> None:
        """Raise :class:`RankFailed` when a rank of a parallel engine is gone (called while idle,
        so a dead rank fails the server before the next request does); nothing for one process."""
        check = getattr(self.runner, "check_ranks", None)
        if check is not None:
            check()

    def _request_capacity(self) -> int:
        """Tokens one request can reach alone in the pool: every slot, or ``max_model_len`` when
        every layer slides and the blocks of a window plus a prefill chunk fit (those behind the
        window are released as it moves)."""
        kv = self.kv
        if kv.sliding_window is not None and \
                kv.max_blocks_held(self.max_model_len, self.config.max_num_batched_tokens) <= kv.num_blocks:
            return max(self.max_model_len, kv.num_slots)
        return kv.num_slots

    def _kv_cache_bytes(self, block_bytes: int) -> int:
        """The KV pool's bytes: the config's when given; on CUDA with the model's own runner, what
        ``gpu_memory_utilization`` leaves after profiling (:mod:`.memory`); else the CPU default."""
        config = self.config
        if config.kv_cache_memory_bytes is not None:
            return config.kv_cache_memory_bytes
        if self.device.type != "cuda" or not isinstance(self.runner, (ModelRunner, ParallelRunner)):
            return CPU_KV_CACHE_BYTES
        if isinstance(self.runner, ParallelRunner):
            return self.runner.kv_cache_bytes(config.max_num_batched_tokens, config.gpu_memory_utilization,
                                              config.block_size, self.max_model_len)
        profile = self.runner.profile_memory(config.max_num_batched_tokens)
        plan = plan_kv_cache(profile, config.gpu_memory_utilization, block_bytes, config.block_size,
                             self.max_model_len)
        log.info("%s", plan.describe(profile, config.gpu_memory_utilization))
        return plan.kv_cache_bytes

    def apply_threads(self) -> None:
        """Set torch's thread count for the calling thread (the one that will run :meth:`step`):
        ``num_threads``, else torch's default capped at the CPUs the cgroup quota and affinity
        mask allow. Decided (and logged) on the first call; later calls apply the same count."""
        if self.num_threads is None:
            self.num_threads, why = choose_threads(self.config.num_threads, torch.get_num_threads(), cpu_limit())
            size = self.config.ranks_per_node
            if size > 1 and self.config.num_threads is None:
                self.num_threads = threads_per_rank(self.num_threads, size)
                why += f", shared by {size} ranks"
            log.info("torch threads: %d (%s)", self.num_threads, why)
        torch.set_num_threads(self.num_threads)

    # --- requests in ------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt: a string is encoded with the tokenizer's special tokens
        (a BOS where the model wants one); a list is taken as token ids and checked."""
        if isinstance(prompt, str):
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as e:
                raise InvalidRequest(f"prompt is not valid Unicode text: {e.reason} at character {e.start}",
                                     "prompt") from None
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            ids = list(prompt)
            self.check_token_ids(ids, "prompt")
        if not ids:
            raise InvalidRequest("prompt must not be empty", "prompt")
        return ids

    @property
    def num_token_ids(self) -> int:
        """Token ids run from 0 to this (exclusive): those the model embeds and the tokenizer decodes
        (a model's vocabulary may be padded past the tokenizer's, or a tokenizer add tokens the
        model lacks)."""
        return min(self.model_config.vocab_size, len(self.tokenizer))

    def check_token_ids(self, ids: list, param: str = "prompt") -> None:
        """The one check of token ids a caller sends (a prompt, ``/detokenize``'s tokens).

        Raises:
            InvalidRequest: an id that is not an integer in [0, :attr:`num_token_ids`); ``param`` names the field.
        """
        limit = self.num_token_ids
        bad = next((i for i, t in enumerate(ids) if not isinstance(t, int) or isinstance(t, bool)
                    or not 0 <= t < limit), None)
        if bad is not None:
            raise InvalidRequest(f"{param} token ids must be integers in [0, {limit}); {param}[{bad}] is "
                                 f"{ids[bad]!r:.40}", param)

    def make_requests(self, prompt: str | list[int], params: SamplingParams | None = None,
                      request_id: str | None = None, arrival_time: float | None = None,
                      tenant: str = DEFAULT_TENANT, priority: int = 0) -> list[Request]:
        """Validate and build a request (its first choice; more choices fork after the prompt).
        ``tenant`` and ``priority`` (lower runs sooner) are what the scheduling policy orders by.

        Does not touch the scheduler, so it may run on another thread than :meth:`step`.

        Raises:
            RequestRejected: prompt + ``max_tokens`` over ``max_model_len``, or more blocks than the cache has.
            InvalidRequest: an empty prompt, or token ids (of the prompt or ``logit_bias``) outside the vocabulary.
            StructuredOutputError: a structured-output constraint that does not compile (an InvalidRequest).

        Compiles the structured-output constraint (cached; a large schema may take up to a second).
        """
        params = params or SamplingParams()
        vocab = self.model_config.vocab_size
        bad = [t for t in params.logit_bias or {} if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(f"logit_bias keys must be token ids in [0, {vocab}), got {bad[0]!r}", "logit_bias")
        if params.prompt_logprobs is not None and not self.runner.supports_prompt_logprobs:
            raise InvalidRequest(f"prompt_logprobs needs the model's forward pass, which this engine's runner "
                                 f"({type(self.runner).__name__}) does not run. Leave prompt_logprobs unset.",
                                 "prompt_logprobs", "unsupported_parameter")
        ids = self.tokenize(prompt)
        n_prompt = len(ids)
        if n_prompt >= self.max_model_len:
            raise RequestRejected(f"This model's maximum context length is {self.max_model_len} tokens; "
                                  f"the prompt has {n_prompt} tokens. Shorten the prompt.",
                                  "context_length_exceeded", "messages")
        max_tokens = params.max_tokens
        if max_tokens is None:  # the rest of the context, as far as the whole cache reaches
            capacity = self._request_capacity()
            if n_prompt >= capacity:  # possible when an explicit max_model_len exceeds the cache
                raise RequestRejected(f"The prompt has {n_prompt} tokens but the KV cache holds only {capacity}, "
                                      "and at least one more is needed to generate. Shorten the prompt.",
                                      "context_length_exceeded", "messages")
            max_tokens = min(self.max_model_len, capacity) - n_prompt
        if n_prompt + max_tokens > self.max_model_len:
            raise RequestRejected(f"This model's maximum context length is {self.max_model_len} tokens. However, "
                                  f"you requested {n_prompt + max_tokens} tokens ({n_prompt} in the prompt, "
                                  f"{max_tokens} for the completion). Reduce the prompt or max_tokens.",
                                  "context_length_exceeded", "max_tokens")
        blocks = self.kv.max_blocks_held(n_prompt + max_tokens, self.config.max_num_batched_tokens)
        if blocks > self.kv.num_blocks:
            raise RequestRejected(f"The request needs {blocks} KV blocks ({n_prompt + max_tokens} tokens) but the "
                                  f"cache holds only {self.kv.num_blocks}. Reduce the prompt or max_tokens.",
                                  "context_length_exceeded", "max_tokens")
        if params.max_tokens is None:
            params = replace(params, max_tokens=max_tokens)
        grammar = self.grammars.compile(params.structured_outputs) if params.structured_outputs else None
        gid = request_id or uuid.uuid4().hex
        req = self._new_request(gid, 0, ids, params, arrival_time or time.monotonic(), grammar)
        req.tenant, req.priority = tenant, priority
        return [req]

    def _new_request(self, gid: str, index: int, ids: list[int], params: SamplingParams, arrival: float,
                     grammar: GrammarMatcher | None = None) -> Request:
        generator = None
        if not params.greedy:
            generator = torch.Generator(device=self.device)
            seed = params.seed + index * 0x9E3779B1 if params.seed is not None else self._rng.getrandbits(62)
            generator.manual_seed(seed % (1 << 63))
        req = Request(f"{gid}-{index}" if index else gid, gid, index, ids, params, generator, RequestMetrics(arrival))
        req.grammar = grammar
        if params.prompt_logprobs is not None and index == 0:  # the group's output carries them once
            req.prompt_logprobs = [None]
        req.detokenizer = IncrementalDetokenizer(self.tokenizer, ids, params.stop, params.skip_special_tokens,
                                                params.include_stop_str_in_output)
        return req

    def add(self, requests: list[Request]) -> None:
        """Queue requests built by :meth:`make_requests`."""
        gid = requests[0].group_id
        if gid in self.groups:
            raise ValueError(f"request id {gid!r} is already in use")
        self.groups[gid] = list(requests)
        for req in requests:
            self.scheduler.add(req)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Validate and queue a request; returns its id. Raises as :meth:`make_requests`."""
        reqs = self.make_requests(prompt, params, request_id)
        self.add(reqs)
        return reqs[0].group_id

    def abort(self, request_id: str, error: str | None = None) -> RequestOutput | None:
        """Finish every unfinished choice of a request with reason ``abort`` and free its blocks now.

        Returns:
            The request's last output (each choice not reported finished yet ends ``abort``;
            ``error`` set when given, for a failure rather than a caller's abort), or None when
            no such request is running.
        """
        group = self.groups.get(request_id)
        if group is None:
            return None
        return self._fail(group[:1], error)[0]

    def has_unfinished(self) -> bool:
        return bool(self.groups)

    # --- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, run the forward pass over every scheduled token, sample,
        append, detokenize, retire. Returns the increments of the requests that moved."""
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        if not batch:
            return []
        now = time.monotonic()
        for req in batch.requests:
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
                if req.index == 0:
                    self.prompt_tokens_total += req.num_prompt_tokens
        sample_idx = batch.sample_indices()
        to_sample = [batch.requests[i] for i in sample_idx]
        record = self._record(batch)
        t_run = time.perf_counter()
        try:
            spans = prompt_spans(batch)  # only requests that asked for prompt logprobs pay for them
            if spans:
                out = self.runner.run_with_prompt_logprobs(batch, sample_idx, spans)
                for span, entries in zip(spans, out.prompt_logprobs):
                    batch.requests[span.index].prompt_logprobs.extend(entries)
            else:
                out = self.runner.run(batch, sample_idx)
            sampled = self.sampler(out.logits, to_sample)
            damaged = out.non_finite_requests(batch)  # after the sampler's copy: the flag is already on the host
        except RankFailed:  # no step can run any more: the caller fails every request and stops
            raise
        except Exception as e:  # a failed step fails its requests, never the engine
            log.exception("step %d failed; aborting its %d requests", self.num_steps, len(batch.requests))
            return self._fail(batch.requests, f"internal error in engine step: {type(e).__name__}: {e}")
        t_fwd = time.perf_counter()
        outputs = self._fail_damaged([batch.requests[i] for i in damaged])
        outputs += self._postprocess(batch, to_sample, sampled.token_ids, sampled.logprobs)
        self.num_steps += 1
        record.forward_time = t_fwd - t_run
        record.step_time = time.perf_counter() - t0
        self._publish(record)
        return outputs

    def _postprocess(self, batch: SchedulerOutput, requests: list[Request], tokens: list[int],
                     logprobs: list) -> list[RequestOutput]:
        """The engine's share of the after-step update, around the scheduler's own
        (:meth:`Scheduler.update_from_output`: advance, cache blocks, append, EOS/stop-token/length).

        ``requests`` are the batch's sampled ones, ``tokens`` and ``logprobs`` aligned with them.
        Before the update: a row whose logits are not finite, or whose token the grammar refuses,
        fails its request (nothing is appended); a first choice's siblings are forked. After it:
        detokenization, stop strings, a complete grammar, metrics and the outputs.
        """
        now = time.monotonic()
        changed: dict[str, list[CompletionOutput]] = {}
        prompt_logprobs: dict[str, list] = {}
        failed: dict[str, tuple[Request, str]] = {}
        accepted: dict[Request, int] = {}
        for req, tok in zip(requests, tokens):
            if req.finished:
                continue
            if tok == NON_FINITE:  # the hidden states were finite (else it failed already): the LM head's weights
                log.error("request %s: the model's logits hold NaN or infinity (step %d)", req.request_id,
                          self.num_steps)
                failed.setdefault(req.group_id, (req, NON_FINITE_ERROR))
                continue
            if req.grammar is not None and not req.grammar.accept(tok):  # the mask allowed it: a bug, not the user's
                log.error("request %s: structured output matcher refused token %d: %s", req.request_id, tok,
                          req.grammar.error)
                failed.setdefault(req.group_id, (req, f"internal error in structured output: {req.grammar.error}"))
                continue
            accepted[req] = tok
            if req.metrics.first_token_time is None and req.index == 0 and req.params.n > 1:
                self._fork(req)  # now: the update may finish the parent and free the blocks its siblings share
        logprob_of = dict(zip(requests, logprobs))
        for req in self.scheduler.update_from_output(batch, accepted, self._text_stop):
            tok, lp = accepted[req], logprob_of[req]
            self.generation_tokens_total += 1
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
                if req.prompt_logprobs is not None:  # delivered once, with the first token
                    prompt_logprobs[req.group_id] = req.prompt_logprobs
            req.metrics.last_token_time = now
            if req.finished:
                req.metrics.finished_time = now
            changed.setdefault(req.group_id, []).append(CompletionOutput(
                req.index, req.detokenizer.take(req.finished), [tok], req.finish_reason, req.stop_reason,
                [lp] if lp is not None else None))
        outputs = [self._group_output(gid, outs, prompt_logprobs.get(gid)) for gid, outs in changed.items()
                   if gid not in failed]
        for req, message in failed.values():
            outputs += self._fail([req], message, changed)
        return outputs

    @staticmethod
    def _text_stop(req: Request, tok: int) -> object:
        """The scheduler's ``text_stop``: detokenize ``tok`` (just appended) and judge the stops
        that need text or a grammar — a stop string (past ``min_tokens``; returned) or a complete
        structured output (None: ``min_tokens`` and ``ignore_eos`` cannot extend it) — else NO_STOP."""
        past_min = req.num_output_tokens >= req.params.min_tokens
        stop_str = req.detokenizer.append(tok, check_stop=past_min)
        if stop_str is not None:
            return stop_str
        if req.grammar is not None and req.grammar.done:
            return None
        return NO_STOP

    def _fork(self, parent: Request) -> None:
        """Start choices 1..n-1 of a request, sharing the parent's prompt blocks (all computed by
        this step's forward pass; the scheduler's count catches up in ``update_from_output``)."""
        group = self.groups[parent.group_id]
        for i in range(parent.params.n - 1, 0, -1):
            child = self._new_request(parent.group_id, i, parent.prompt_token_ids, parent.params,
                                      parent.metrics.arrival_time, parent.grammar and parent.grammar.fresh())
            child.tenant, child.priority = parent.tenant, parent.priority
            self.kv.fork(parent, child, num_computed=parent.num_tokens)
            group.append(child)
            self.scheduler.add(child, front=True)

    def _group_output(self, gid: str, outs: list[CompletionOutput],
                      prompt_logprobs: list | None = None) -> RequestOutput:
        group = self.groups[gid]
        first = group[0]
        done = all(r.finished for r in group) and (first.params.n == len(group) or first.finish_reason == "abort")
        if done:
            del self.groups[gid]
        return RequestOutput(gid, first.prompt_token_ids, outs, done, first.metrics,
                             first.num_cached_tokens, prompt_logprobs=prompt_logprobs)

    def _fail_damaged(self, requests: list[Request]) -> list[RequestOutput]:
        """Fail the requests whose hidden states were not finite this step, before the scheduler's
        update: finished first, their blocks are freed without being named, so no later request
        reuses their suspect K/V from the prefix cache."""
        for req in requests:
            log.error("request %s: the model's hidden states hold NaN or infinity (step %d)", req.request_id,
                      self.num_steps)
        return self._fail(requests, NON_FINITE_ERROR)

    def _fail(self, requests: list[Request], message: str | None,
              finished_now: dict[str, list[CompletionOutput]] | None = None) -> list[RequestOutput]:
        """Fail (or abort) the groups of ``requests``: each choice not yet finished ends with reason
        ``abort`` and the output carries ``message`` as its error (None: an abort, no error).
        ``finished_now``: per group, the outputs of choices this step finished normally, reported
        with it (each choice finishes once)."""
        outputs = []
        for gid in dict.fromkeys(r.group_id for r in requests):
            group = self.groups.pop(gid, [])
            outs = [co for co in (finished_now or {}).get(gid, []) if co.finish_reason is not None]
            reported = {req.index for req in group if req.finished}  # output before, or in ``outs``
            for req in group:
                self.scheduler.finish(req, FinishReason.ABORT)
            # every other choice, forked or not yet (a first step that failed), fails now
            outs += [CompletionOutput(i, "", [], FinishReason.ABORT.value) for i in range(group[0].params.n)
                     if i not in reported]
            outputs.append(RequestOutput(gid, group[0].prompt_token_ids, outs, True, group[0].metrics,
                                         error=message))
        return outputs

    # --- observability ----------------------------------------------------------------------
    def _record(self, batch: SchedulerOutput) -> StepRecord:
        rec = StepRecord(self.num_steps, num_preemptions=len(batch.preempted),
                         num_blocks_used=self.kv.num_used_blocks, num_blocks_total=self.kv.num_blocks,
                         num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting)
        for req, n in zip(batch.requests, batch.num_new_tokens):
            decode = 1 if n == 1 and req.num_output_tokens and req.num_computed_tokens == req.num_tokens - 1 else 0
            rec.scheduled.append((req.request_id, n - decode, decode))
            rec.num_prefill_tokens += n - decode
            rec.num_decode_tokens += decode
        return rec

    def _publish(self, record: StepRecord) -> None:
        if self.config.trace:
            running = self.scheduler.running
            record.kv_utilization = self.kv.utilization(running) if running else None
            self.trace.append(record)
        for fn in self.step_listeners:
            fn(record)

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=self.kv.usage,
            num_blocks=self.kv.num_blocks,
            num_free_blocks=self.kv.num_free_blocks,
            num_preemptions_total=self.scheduler.num_preemptions,
            prefix_cache_queries_total=self.kv.prefix_queries,
            prefix_cache_hits_total=self.kv.prefix_hits,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            num_steps=self.num_steps,
            block_size=self.kv.block_size,
            max_num_seqs=self.scheduler.max_num_seqs,
            max_num_batched_tokens=self.scheduler.max_num_batched_tokens,
            enable_prefix_caching=self.kv.enable_prefix_caching,
            long_prefill_token_threshold=self.scheduler.long_prefill_token_threshold,
            # copies (atomic under the GIL): stats() is read from the event loop while the engine steps
            tenant_requests=self.scheduler.waiting.requests_by_tenant(),
            tenant_running=dict(collections.Counter(r.tenant for r in list(self.scheduler.running))),
            tenant_served=dict(self.scheduler.waiting.counters),
        )
