"""Iteration-level scheduling (Orca, Yu et al. OSDI '22, §4.1) with chunked prefill and preemption.

Every step: running requests first (each its next decode token or prefill chunk), the
policy's most protected first; then waiting requests in the policy's order (:mod:`.fairness`:
fcfs, priority, or fair across tenants — first-come with one tenant) while the token budget, the
seat limit and free blocks allow. When a running request needs a block and none is free, the
policy's last running request (fcfs: the newest) is preempted: its blocks are freed and it waits
ahead of later arrivals to be recomputed (vLLM's recompute preemption, Kwon et al. SOSP '23, §4.5). If nothing runs and the head of the queue still does not
fit, or the last running request had to preempt itself, waiting requests give back the blocks
they hold, so the queue always moves. With a long-prefill threshold (vLLM's
``long_prefill_token_threshold``), a request's chunk is capped at it whenever the step carries
other requests, so short prompts arriving behind a long one are admitted in the next step, and
every step beside it stays short, instead of waiting out its whole prefill (head-of-line
blocking); a capped chunk alone in its step takes the whole budget, as without a cap. One long
prefill runs at a time (vLLM V0's ``max_long_partial_prefills`` of 1): a waiting request with more
than the threshold to compute waits while another is in progress, keeping its place at the head
of the queue, and shorter ones behind it start meanwhile (as vLLM V0 lets them), so under a
backlog long prompts are prefilled one after another instead of sharing the budget and all
finishing late, and a second long prompt does not hold every short one behind it. Finished
requests leave at once, so a freed seat is filled on the very next step. Before a request's
blocks are allocated, those behind every layer's sliding window are released
(:meth:`KVCacheManager.free_out_of_window`).

After the forward pass, :meth:`Scheduler.update_from_output` is the other half of the state
machine (vLLM v1's ``Scheduler.update_from_output``, nano-vllm's ``Scheduler.postprocess``): it
advances ``num_computed_tokens``, caches full blocks, appends sampled tokens and finishes the
requests that stop. The engine, the simulator and the tests all call it. It judges the stops of
token ids itself and asks the engine's ``text_stop`` (detokenization, stop strings, a complete
structured output) for the rest, then finishes each request once. :meth:`Scheduler.finish` is
the one place a request's finished state and reason are set: the update calls it, and so do the
engine's abort and failure paths (reason ``abort``).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from .fairness import WaitingQueue
from .kv_cache import KVCacheManager
from .outputs import FinishReason
from .request import Request, RequestStatus


NO_STOP = object()  # what a TextStop returns when the token's text does not end the request
TextStop = Callable[[Request, int], object]  # (request, token) -> stop_reason (str | None) or NO_STOP


@dataclass
class SchedulerOutput:
    """What one step runs: ``num_new_tokens[i]`` tokens of ``requests[i]``, flattened in order."""

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.requests)

    def sample_indices(self) -> list[int]:
        """Positions in ``requests`` whose step reaches the end of their tokens, so the forward pass
        samples a next token for them (a mid-prompt chunk samples nothing). Valid until
        :meth:`Scheduler.update_from_output` advances the counts."""
        return [i for i, (req, n) in enumerate(zip(self.requests, self.num_new_tokens))
                if req.num_computed_tokens + n == req.num_tokens]


class Scheduler:
    """Args:
        kv: the block pool.
        max_num_seqs: most running requests.
        max_num_batched_tokens: token budget per step (decode tokens + prefill chunk tokens).
        eos_token_ids: token ids that end a request (unless its ``ignore_eos``); none: never.
        max_model_len: most tokens (prompt + output) a request may hold; None: only ``max_tokens`` caps it.
        waiting: the waiting queue and its policy (:class:`~.fairness.WaitingQueue`); None: ``fair``
            with equal tenant weights, preferring cached prefixes within a tenant.
        long_prefill_token_threshold: most tokens of one request in a step that others share;
            0: only the budget caps a chunk.
    """

    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 eos_token_ids: Iterable[int] = (), max_model_len: int | None = None,
                 waiting: WaitingQueue | None = None, long_prefill_token_threshold: int = 0):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.waiting = waiting if waiting is not None else WaitingQueue(cached_blocks=kv.cached_prefix_blocks)
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request, front: bool = False) -> None:
        """Queue ``req``; ``front``: a preempted request, ahead of later arrivals."""
        req.status = RequestStatus.WAITING
        self.waiting.add(req, front)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        self.running = self.waiting.protect_order(self.running)
        seat = self.waiting.seat_victim(self.running, self.max_num_seqs)
        vacated = seated = None  # the request preempted for a seat, and the one seated in its place
        reserved = 0
        if seat is not None:  # before anything is scheduled: the freed seat goes to the waiting tenant
            vacated, seated = seat
            self.running.remove(vacated)
            self._preempt(vacated)
            out.preempted.append(vacated)
            # and the budget for its prefill; the running requests only decode in this step (their
            # prefill chunks wait one): the seated request's first token comes at this step, and
            # no sooner than its own prefill allows, not after a flood's chunks
            reserved = max(0, min(seated.num_tokens - seated.num_computed_tokens, budget - len(self.running)))
            budget -= reserved
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._chunk(req, budget)
            if vacated is not None and n > 1:
                i += 1
                continue
            self.kv.free_out_of_window(req)
            while not self.kv.allocate(req, n):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                out.requests.append(req)
                out.num_new_tokens.append(n)
                budget -= n
                i += 1
        budget += reserved
        if out.preempted and out.preempted != [vacated]:
            if not self.running:
                # A lone request preempted itself: blocks that waiting choices hold (a fork's,
                # possibly past a sliding window its parent cannot find again) are all that is left.
                self._release_waiting()
            return out  # blocks are short: admitting now would only preempt again
        long_prefill = self.long_prefill_token_threshold > 0 and any(self._is_long(r) for r in self.running)
        held: list[Request] = []  # long prompts waiting out the one in progress, out of the queue for this step
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req, was_seated, seated = seated or self.waiting.head(), seated is not None, None
            fresh = not req.block_table  # a forked choice arrives holding its parent's blocks
            hit = self.kv.match_prefix(req) if fresh else 0
            long = self._is_long(req)  # what is left after the prefix cache's hit
            if long and long_prefill and not was_seated:
                if fresh:
                    self.kv.free_request(req)
                self.waiting.remove(req)  # one long prefill at a time; shorter ones behind may start
                held.append(req)
                continue
            n = self._chunk(req, budget)
            self.kv.free_out_of_window(req)
            if not self.kv.allocate(req, n):
                if fresh:
                    self.kv.free_request(req)  # don't pin cache hits while it waits
                if self.running or not self._release_waiting():
                    break
                continue  # nothing runs to free blocks: the ones waiting requests held are free now
            if fresh:
                self.kv.prefix_queries += req.num_tokens
                self.kv.prefix_hits += hit
            self.waiting.pop(req)
            long_prefill |= long
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.requests.append(req)
            out.num_new_tokens.append(n)
            budget -= n
        for req in reversed(held):  # back where they were, ahead of the rest
            self.waiting.add(req, front=True, returning=True)
        self._uncap_if_alone(out, budget)
        return out

    def _chunk(self, req: Request, budget: int) -> int:
        """Tokens ``req`` computes this step: what it has left, within ``budget`` and the
        long-prefill threshold (:meth:`_uncap_if_alone` lifts the threshold afterwards)."""
        n = min(req.num_tokens - req.num_computed_tokens, budget)
        threshold = self.long_prefill_token_threshold
        return min(n, threshold) if threshold > 0 else n

    def _is_long(self, req: Request) -> bool:
        """Whether ``req`` has more tokens to compute than the long-prefill threshold (0: none has)."""
        return 0 < self.long_prefill_token_threshold < req.num_tokens - req.num_computed_tokens

    def _uncap_if_alone(self, out: SchedulerOutput, budget: int) -> None:
        """A capped chunk alone in its step takes the rest of the ``budget`` too, as far as free
        blocks allow: the cap is there to make room for others, and none share this step."""
        if self.long_prefill_token_threshold <= 0 or len(out.requests) != 1:
            return
        req, n = out.requests[0], out.num_new_tokens[0]
        more = min(req.num_tokens - req.num_computed_tokens - n, budget)
        if more > 0 and self.kv.allocate(req, n + more):
            out.num_new_tokens[0] = n + more

    def update_from_output(self, batch: SchedulerOutput, sampled: Mapping[Request, int],
                           text_stop: TextStop | None = None) -> list[Request]:
        """Apply one step's result: the after-step half of the state machine (vLLM v1's
        ``Scheduler.update_from_output``; nano-vllm's ``Scheduler.postprocess``).

        Every scheduled request advances ``num_computed_tokens`` by its ``num_new_tokens`` and
        names its newly full blocks (:meth:`KVCacheManager.cache_full_blocks`). Each request in
        ``sampled`` (one of :meth:`SchedulerOutput.sample_indices`; the engine leaves out a token
        its grammar refused) appends its token id and is finished, its blocks freed, on the first
        of: an EOS id once past ``min_tokens`` and not ``ignore_eos`` (reason ``stop``); one of its
        ``stop_token_ids`` once past ``min_tokens`` (``stop``, ``stop_reason`` = that id); the stop
        ``text_stop`` reports (``stop``: a stop string, or a complete structured output);
        ``max_tokens`` output tokens or ``max_model_len`` tokens in all (``length``). A text stop
        outranks the length cap on the same token (as vLLM's output processor lets a stop string
        override it).

        Args:
            batch: the step's :meth:`schedule` output, not yet applied.
            sampled: request -> the token id sampled for it this step.
            text_stop: called with (request, token) for every appended token, after the append:
                takes the token's text and returns ``stop_reason`` (the stop string, or None for a
                complete grammar) when the text ends the request, else :data:`NO_STOP`. None: only
                token-id stops (the simulator's requests have no text).
        Returns:
            The requests that got a token, in batch order; those it finished have
            ``finished`` True and ``finish_reason``/``stop_reason`` set.
        """
        got = []
        for req, n in zip(batch.requests, batch.num_new_tokens):
            if req.finished:
                continue
            full = req.num_computed_tokens // self.kv.block_size
            req.num_computed_tokens += n
            if req.num_computed_tokens // self.kv.block_size > full:  # else no block became full: no new name
                self.kv.cache_full_blocks(req)
            tok = sampled.get(req)
            if tok is None:
                continue
            req.token_ids.append(tok)
            self.waiting.charge(req, 0, 1)
            got.append(req)
            reason = self._check_stop(req, tok)
            text = text_stop(req, tok) if text_stop is not None else NO_STOP
            if text is not NO_STOP and (reason is None or reason[0] is FinishReason.LENGTH):
                reason = FinishReason.STOP, text
            if reason is not None:
                self.finish(req, *reason)
        return got

    def _check_stop(self, req: Request, tok: int) -> tuple[FinishReason, int | None] | None:
        """The stop, if any, that ``tok`` (just appended) brings: (reason, stop_reason)."""
        p = req.params
        num_output = req.num_output_tokens
        if num_output >= p.min_tokens:
            if tok in self.eos_token_ids and not p.ignore_eos:
                return FinishReason.STOP, None
            if tok in p.stop_token_ids:
                return FinishReason.STOP, tok
        if (p.max_tokens is not None and num_output >= p.max_tokens) or \
                (self.max_model_len is not None and req.num_tokens >= self.max_model_len):
            return FinishReason.LENGTH, None
        return None

    def finish(self, req: Request, reason: FinishReason, stop_reason: str | int | None = None) -> None:
        """Finish a request: set its status, ``finish_reason`` and ``stop_reason``, take it out of
        the queues and free its blocks at once. The only place a request finishes; a request
        already finished keeps its first reason.
        """
        if req.finished:
            return
        req.finish_reason = reason.value
        req.stop_reason = stop_reason
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
        self.waiting.finished(req)
        self.kv.free_request(req)

    def _release_waiting(self) -> bool:
        """Free the blocks that waiting requests hold (forked choices keep their parent's prompt
        blocks): with nothing running, no one else would ever free them. They are recomputed on
        admission, mostly from the prefix cache. Returns whether any block was released."""
        holders = [req for req in self.waiting if req.block_table]
        for req in holders:
            self.kv.free_request(req)
        return bool(holders)

    def _preempt(self, req: Request) -> None:
        self.kv.free_request(req)
        req.num_preemptions += 1
        self.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.add(req, front=True, returning=True)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)
