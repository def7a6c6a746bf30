"""Replicas on a virtual clock with the operator's autoscaling policy in the loop (``slipstream simulate``).

Each replica is the engine's real :class:`Scheduler` and :class:`KVCacheManager`; a step takes
the cost model's time on the replica's own clock instead of running a model, so hours of traffic
simulate in seconds and every scheduling effect (token budget, seat limit, KV exhaustion,
preemption) is the engine's own. Every ``tick`` seconds the cluster does what the operator does:
read each ready replica's gauges, call :func:`slipstream.operator.autoscaler.decide`, and
create (ready after ``startup_delay`` seconds) or drain replicas to match.

Simplifications, each a choice: requests are routed when they arrive, to ready replicas only
(round-robin like a ClusterIP Service, or least-loaded like an inference-aware gateway); a
replica asked to go away first stops getting requests, finishes what it holds, then leaves;
prompts are distinct (prefix caching off) and every step's outputs land at its end.
"""
from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass, field
from typing import Iterable

from slipstream.operator.autoscaler import AutoscalerState, AutoscalingSpec, Decision, PodSample, decide

from ..engine.kv_cache import KVCacheManager
from ..engine.outputs import RequestMetrics
from ..engine.request import Request
from ..engine.sampling_params import SamplingParams
from ..engine.scheduler import Scheduler
from .cost_model import Profile, batch_shape, step_time
from .trace import Arrival

_PARAMS = SamplingParams()  # the scheduler never reads them; one shared instance
ROUTING = ("round-robin", "least-loaded")


@dataclass(frozen=True, slots=True)
class ReplicaConfig:
    """Engine settings of every replica (token counts; bytes for the KV cache)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_bytes: int
    block_size: int = 16

    @classmethod
    def for_profile(cls, profile: Profile, **overrides) -> ReplicaConfig:
        values = dict(max_num_seqs=profile.max_num_seqs, max_num_batched_tokens=profile.max_num_batched_tokens,
                      kv_cache_bytes=profile.kv_cache_bytes)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


@dataclass(eq=False, slots=True)
class SimRequest:
    """One request's life in virtual seconds; ``first_token`` and ``finished`` None until then."""

    arrival: float
    prompt_tokens: int
    output_tokens: int
    first_token: float | None = None
    finished: float | None = None
    replica: str = ""

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival


class VirtualReplica:
    """One pod: a scheduler and KV pool whose steps take the cost model's time.

    ``time`` is when its device is next free; ``ready_at`` when it starts taking requests.
    """

    def __init__(self, name: str, profile: Profile, config: ReplicaConfig, created: float, ready_at: float):
        self.name = name
        self.profile = profile
        num_blocks = config.kv_cache_bytes // (config.block_size * profile.model.kv_bytes_per_token)
        if num_blocks < 1:
            raise ValueError(f"kv_cache_bytes={config.kv_cache_bytes} holds no KV block of {config.block_size} tokens")
        self.kv = KVCacheManager(num_blocks, config.block_size, enable_prefix_caching=False)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens)
        self.time = created
        self.created = created
        self.ready_at = ready_at
        self.draining = False
        self.stopped: float | None = None
        self._requests: dict[str, SimRequest] = {}
        self._ids = itertools.count()
        self.num_steps = 0

    def ready(self, now: float) -> bool:
        return now >= self.ready_at and not self.draining

    @property
    def idle(self) -> bool:
        return not self._requests

    @property
    def load(self) -> int:
        return self.scheduler.num_waiting + self.scheduler.num_running

    def sample(self, now: float) -> PodSample:
        """The gauges a scrape would read now."""
        return PodSample(self.name, now, self.scheduler.num_waiting, self.scheduler.num_running, self.kv.usage)

    def add(self, sim: SimRequest, now: float) -> None:
        """Queue a request that arrived at ``now``. Raises ValueError if it can never fit."""
        total = sim.prompt_tokens + sim.output_tokens
        if self.kv.blocks_needed(total) > self.kv.num_blocks or total > self.profile.model.max_model_len:
            raise ValueError(f"a request of {total} tokens does not fit one replica "
                             f"({self.kv.num_blocks} KV blocks, max_model_len {self.profile.model.max_model_len})")
        rid = f"{self.name}-{next(self._ids)}"
        sim.replica = self.name
        self._requests[rid] = sim
        self.scheduler.add(Request(rid, rid, 0, [0] * sim.prompt_tokens, _PARAMS, None, RequestMetrics(now)))
        self.time = max(self.time, now)

    def advance(self, until: float) -> None:
        """Run every step that starts before ``until``; an idle replica's clock jumps to it."""
        while self.time < until:
            batch = self.scheduler.schedule()
            if not batch:
                self.time = until
                return
            end = self.time + step_time(self.profile, batch_shape(
                (r.num_computed_tokens, n) for r, n in zip(batch.requests, batch.num_new_tokens)))
            for req, n in zip(batch.requests, batch.num_new_tokens):
                req.num_computed_tokens += n
                if req.num_computed_tokens < req.num_tokens:
                    continue  # mid-prompt chunk: nothing sampled
                req.token_ids.append(0)
                sim = self._requests[req.request_id]
                if sim.first_token is None:
                    sim.first_token = end
                if req.num_output_tokens >= sim.output_tokens:
                    self.scheduler.finish(req)
                    sim.finished = end
                    del self._requests[req.request_id]
            self.time = end
            self.num_steps += 1


@dataclass(frozen=True, slots=True)
class TickRecord:
    """The cluster at one autoscaler tick (virtual seconds; counts summed over replicas).

    desired: replicas asked for after this tick's decision. ready / starting: before it.
    queue_depth: requests waiting (in replicas and for a ready replica). kv_cache_utilization:
    mean over ready replicas, 0..1. arrivals: since the previous tick.
    """

    time: float
    desired: int
    ready: int
    starting: int
    queue_depth: int
    running: int
    kv_cache_utilization: float
    arrivals: int


@dataclass
class SimResult:
    """What a run produced: one record per tick, every request, and each replica-count change."""

    ticks: list[TickRecord] = field(default_factory=list)
    requests: list[SimRequest] = field(default_factory=list)
    scalings: list[tuple[float, Decision]] = field(default_factory=list)
    replica_seconds: float = 0.0  # pod time paid for, starting included
    end_time: float = 0.0

    def ttft_percentiles(self, start: float = -math.inf, end: float = math.inf,
                         quantiles: Iterable[float] = (0.5, 0.99)) -> list[float | None]:
        """TTFT quantiles (seconds, nearest rank) of requests whose first token came in [start, end)."""
        values = sorted(r.ttft for r in self.requests if r.first_token is not None and start <= r.first_token < end)
        return [values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))] if values else None
                for q in quantiles]


class Cluster:
    """Replicas, a router and the autoscaling policy, stepped on one virtual clock.

    Args:
        profile, config: what each replica is.
        spec: the autoscaling policy's spec (``enabled`` False: the count stays ``initial``).
        startup_delay: seconds from creating a replica to its taking requests (image pull, model
            load, warm-up). tick: seconds between autoscaler decisions (the operator's 2 s).
        initial: replicas ready at time 0 (default ``spec.min_replicas``).
        routing: ``round-robin`` or ``least-loaded``.
    """

    def __init__(self, profile: Profile, config: ReplicaConfig, spec: AutoscalingSpec, *,
                 startup_delay: float = 60.0, tick: float = 2.0, initial: int | None = None,
                 routing: str = "round-robin"):
        if routing not in ROUTING:
            raise ValueError(f"routing must be one of {', '.join(ROUTING)}, got {routing!r}")
        if tick <= 0 or startup_delay < 0:
            raise ValueError(f"tick must be > 0 and startup_delay >= 0, got {tick}, {startup_delay}")
        self.profile, self.config, self.spec = profile, config, spec
        self.startup_delay, self.tick, self.routing = startup_delay, tick, routing
        self.state = AutoscalerState()
        self.replicas: list[VirtualReplica] = []
        self.retired: list[VirtualReplica] = []
        self.pending: list[SimRequest] = []  # arrived while no replica was ready
        self._names = itertools.count()
        self._rr = 0
        for _ in range(initial if initial is not None else spec.min_replicas):
            self._create(0.0, ready_at=0.0)

    # --- replicas -----------------------------------------------------------------------------
    def _create(self, now: float, ready_at: float) -> None:
        self.replicas.append(VirtualReplica(f"pod-{next(self._names)}", self.profile, self.config, now, ready_at))

    @property
    def active(self) -> list[VirtualReplica]:
        """Replicas that count toward the Deployment's replicas (not draining)."""
        return [r for r in self.replicas if not r.draining]

    def _scale_to(self, desired: int, now: float) -> None:
        active = self.active
        for _ in range(desired - len(active)):
            self._create(now, now + self.startup_delay)
        # Like a ReplicaSet: not-ready pods go first, then the newest.
        for replica in sorted(active, key=lambda r: (r.ready(now), -r.created))[:max(0, len(active) - desired)]:
            replica.draining = True

    def _retire_idle_drained(self, now: float) -> None:
        for replica in [r for r in self.replicas if r.draining and r.idle]:
            replica.stopped = now
            self.replicas.remove(replica)
            self.retired.append(replica)

    # --- requests -----------------------------------------------------------------------------
    def _route(self, sim: SimRequest, now: float) -> bool:
        ready = [r for r in self.replicas if r.ready(now)]
        if not ready:
            return False
        if self.routing == "least-loaded":
            target = min(ready, key=lambda r: r.load)
        else:
            target = ready[self._rr % len(ready)]
            self._rr += 1
        target.add(sim, now)
        return True

    def _advance(self, until: float) -> None:
        for replica in self.replicas:
            replica.advance(until)
        if self.pending and any(r.ready(until) for r in self.replicas):
            waiting, self.pending = self.pending, []
            for sim in waiting:
                self._route(sim, until)

    # --- the loop -----------------------------------------------------------------------------
    def _autoscale(self, now: float, arrivals: int, result: SimResult) -> None:
        ready = [r for r in self.replicas if r.ready(now)]
        starting = [r for r in self.active if not r.ready(now)]
        samples = [r.sample(now) for r in ready]
        current = len(self.active)
        desired = current
        if self.spec.enabled:
            decision = decide(self.spec, self.state, samples, now, current, len(ready), len(starting))
            self.state = decision.state
            desired = decision.desired_replicas
            if decision.scaled:
                result.scalings.append((now, decision))
                self._scale_to(desired, now)
        result.ticks.append(TickRecord(
            now, desired, len(ready), len(starting),
            sum(s.num_requests_waiting for s in samples) + len(self.pending),
            sum(s.num_requests_running for s in samples),
            sum(s.kv_cache_usage_perc for s in samples) / len(samples) if samples else 0.0, arrivals))

    def run(self, arrivals: list[Arrival], duration: float | None = None, drain_limit: float = 3600.0) -> SimResult:
        """Play ``arrivals`` (sorted by time); tick until ``duration`` (default: the last
        arrival) and then until every request has finished, at most ``drain_limit`` more seconds."""
        result = SimResult()
        times = [a.time for a in arrivals]
        end = max(duration or 0.0, times[-1] if times else 0.0)
        i, now = 0, 0.0
        while True:
            now += self.tick
            count = bisect.bisect_left(times, now, lo=i) - i
            for arrival in arrivals[i:i + count]:
                self._advance(arrival.time)
                sim = SimRequest(arrival.time, arrival.prompt_tokens, arrival.output_tokens)
                result.requests.append(sim)
                if not self._route(sim, arrival.time):
                    self.pending.append(sim)
            i += count
            self._advance(now)
            self._retire_idle_drained(now)
            self._autoscale(now, count, result)
            busy = self.pending or any(not r.idle for r in self.replicas)
            if now >= end and (not busy or now >= end + drain_limit):
                break
        result.end_time = now
        for replica in self.replicas + self.retired:
            result.replica_seconds += (replica.stopped if replica.stopped is not None else now) - replica.created
        return result
