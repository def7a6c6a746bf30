"""Head-of-line blocking: static (request-level) batching against continuous (iteration-level)
batching, the example ``slipstream simulate --example head-of-line`` prints.

A batch of ``slots`` requests whose outputs differ (20, 50, 200, 2000 tokens) decodes one token
per request per step. Static batching, as in a server that batches whole requests, holds every
slot until the longest request ends: 2,000 steps for 2,270 useful tokens, 28.4% of the 8,000
slot-steps. Continuous batching (Orca, Yu et al. OSDI '22, §3–4; vLLM) schedules per step, so a
finished request's slot takes the next queued request at once. Here the continuous side is the
engine's own :class:`Scheduler` and :class:`KVCacheManager`, so the numbers are what this
engine does, not a formula.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..engine.kv_cache import KVCacheManager
from ..engine.outputs import RequestMetrics
from ..engine.request import Request
from ..engine.sampling_params import SamplingParams
from ..engine.scheduler import Scheduler

OUTPUTS = (20, 50, 200, 2000)


@dataclass(frozen=True, slots=True)
class BatchingRun:
    """One policy over one queue (counts in steps; every request has a 1-token prompt).

    finish_steps[i]: the step at which request i produced its last token (1-based).
    steps_to_first_batch_tokens: steps until as many tokens as the first ``slots`` requests
        hold had been produced. first_batch_steps: steps until those first requests all ended.
    idle_before: slot-steps left empty up to ``steps_to_first_batch_tokens``.
    queue_emptied: the step that admitted the last queued request.
    """

    policy: str
    slots: int
    outputs: tuple[int, ...]
    total_steps: int
    finish_steps: tuple[int, ...]
    first_batch_steps: int
    steps_to_first_batch_tokens: int
    idle_before: int
    queue_emptied: int

    @property
    def useful(self) -> int:
        return sum(self.outputs)

    @property
    def utilization(self) -> float:
        """Useful slot-steps / all slot-steps over the whole run."""
        return self.useful / (self.slots * self.total_steps)


def static_batching(outputs: tuple[int, ...], slots: int) -> BatchingRun:
    """Batches of ``slots`` consecutive requests; a batch runs until its longest request ends."""
    finish: list[int] = []
    target = sum(outputs[:slots])
    start = produced = steps_to = first_batch = 0
    for b in range(0, len(outputs), slots):
        batch = outputs[b:b + slots]
        finish += [start + n for n in batch]
        for k in range(1, max(batch) + 1):  # the batch's k-th step: requests not yet done emit
            produced += sum(1 for n in batch if n >= k)
            if not steps_to and produced >= target:
                steps_to, idle = start + k, slots * (start + k) - produced
        start += max(batch)
        first_batch = first_batch or start
    last_batch = _batch_starts(outputs, slots)[-1] + 1
    return BatchingRun("static", slots, outputs, start, tuple(finish), first_batch, steps_to, idle, last_batch)


def _batch_starts(outputs: tuple[int, ...], slots: int) -> list[int]:
    starts, t = [], 0
    for b in range(0, len(outputs), slots):
        starts.append(t)
        t += max(outputs[b:b + slots])
    return starts


def continuous_batching(outputs: tuple[int, ...], slots: int) -> BatchingRun:
    """The engine's scheduler with ``slots`` seats over the whole queue, one step at a time."""
    kv = KVCacheManager(num_blocks=sum(-(-(n + 1) // 16) for n in outputs), block_size=16,
                        enable_prefix_caching=False)
    scheduler = Scheduler(kv, max_num_seqs=slots, max_num_batched_tokens=max(slots, 16))
    for i, n in enumerate(outputs):  # request i ends at max_tokens = its output length
        rid = str(i)
        scheduler.add(Request(rid, rid, 0, [0], SamplingParams(max_tokens=n, ignore_eos=True), None,
                              RequestMetrics(0.0)))
    finish = [0] * len(outputs)
    target = sum(outputs[:slots])
    produced = step = steps_to = idle = emptied = 0
    while scheduler.num_waiting or scheduler.num_running:
        batch = scheduler.schedule()
        step += 1
        if not scheduler.num_waiting and not emptied:
            emptied = step
        sampled = {batch.requests[i]: 0 for i in batch.sample_indices()}
        for req in scheduler.update_from_output(batch, sampled):  # the engine's own after-step update
            produced += 1
            if req.finished:
                finish[int(req.request_id)] = step
        if produced >= target and not steps_to:
            steps_to, idle = step, slots * step - produced
    first_batch = max(finish[:slots])
    return BatchingRun("continuous", slots, outputs, step, tuple(finish), first_batch, steps_to, idle, emptied)


def report(slots: int = 4, outputs: tuple[int, ...] = OUTPUTS, rounds: int = 4, step_seconds: float = 0.05) -> str:
    """The example's text: both policies on ``rounds`` repetitions of ``outputs`` in a queue."""
    queue = tuple(outputs) * rounds
    static, cont = static_batching(queue, slots), continuous_batching(queue, slots)
    first = sum(queue[:slots])
    s = step_seconds

    def seconds(steps: int) -> str:
        return f"{steps:,} steps = {steps * s:,.1f} s"

    def mean_finish(run: BatchingRun) -> float:
        return sum(run.finish_steps) / len(run.finish_steps) * s

    if cont.idle_before == 0:
        why = (f"{first:,} / {slots} = {first / slots:g}, rounded up: until then every step ran all {slots} "
               f"slots, each freed slot refilled from the queue on the next step")
    else:
        why = (f"not {first / slots:g} = {first:,} / {slots}: the queue ran dry at step {cont.queue_emptied:,} "
               f"and {cont.idle_before:,} slot-steps idled before; a longer queue keeps every slot busy")
    lines = [
        f"Head-of-line blocking: {slots} slots, outputs of {'/'.join(map(str, outputs))} tokens, "
        f"{s * 1000:g} ms a step; a queue of {len(queue)} such requests ({rounds} of each).",
        "",
        "Static batching (a batch holds every slot until its longest request ends):",
        f"  first batch: {seconds(static.first_batch_steps)}; useful slot-steps {first:,} of "
        f"{slots * static.first_batch_steps:,} = {first / (slots * static.first_batch_steps):.1%}",
        f"  whole queue: {seconds(static.total_steps)}; {static.utilization:.1%} of slot-steps useful; "
        f"mean completion {mean_finish(static):.1f} s",
        "",
        "Continuous batching (this engine's scheduler, stepped with the queue above):",
        f"  the same {first:,} useful tokens: {seconds(cont.steps_to_first_batch_tokens)} ({why})",
        f"  the first {slots} requests still end at step {cont.first_batch_steps:,}: the "
        f"{max(outputs[:slots]):,}-token one needs that many steps whatever the batching",
        f"  whole queue: {seconds(cont.total_steps)}; {cont.utilization:.1%} of slot-steps useful; "
        f"mean completion {mean_finish(cont):.1f} s",
        f"  not {sum(queue) / slots:,.1f} steps ({sum(queue):,} tokens / {slots}): the queue ran dry at step "
        f"{cont.queue_emptied:,}, after which the last long requests ran beside idle slots, and none can end "
        f"before its start + its length ({max(outputs):,} steps)",
    ]
    return "\n".join(lines)
