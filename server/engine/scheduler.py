"""Iteration-level scheduling (Orca, Yu et al. OSDI '22, §4.1) with chunked prefill and preemption.

Every step: running requests first (each its next decode token or prefill chunk), oldest first;
then waiting requests FCFS while the token budget, the seat limit and free blocks allow. When a
running request needs a block and none is free, the newest running request is preempted: its
blocks are freed and it waits at the head of the queue to be recomputed (vLLM's recompute
preemption, Kwon et al. SOSP '23, §4.5). If nothing runs and the head of the queue still does not
fit, waiting requests give back the blocks they hold, so the queue always moves. Finished
requests leave at once, so a freed seat is filled on the very next step.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .kv_cache import KVCacheManager
from .request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    """What one step runs: ``num_new_tokens[i]`` tokens of ``requests[i]``, flattened in order."""

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.requests)


class Scheduler:
    """Args:
        kv: the block pool.
        max_num_seqs: most running requests.
        max_num_batched_tokens: token budget per step (decode tokens + prefill chunk tokens).
    """

    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request, front: bool = False) -> None:
        req.status = RequestStatus.WAITING
        if front:
            self.waiting.appendleft(req)
        else:
            self.waiting.append(req)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
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
        if out.preempted:
            return out  # blocks are short: admitting now would only preempt again
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            fresh = not req.block_table  # a forked choice arrives holding its parent's blocks
            hit = self.kv.match_prefix(req) if fresh else 0
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self.kv.allocate(req, n):
                if fresh:
                    self.kv.free_request(req)  # don't pin cache hits while it waits
                if self.running or not self._release_waiting():
                    break
                continue  # nothing runs to free blocks: the ones waiting requests held are free now
            if fresh:
                self.kv.prefix_queries += req.num_tokens
                self.kv.prefix_hits += hit
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.requests.append(req)
            out.num_new_tokens.append(n)
            budget -= n
        return out

    def finish(self, req: Request) -> None:
        """Remove a finished or aborted request and free its blocks at once."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
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
        self.add(req, front=True)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)
