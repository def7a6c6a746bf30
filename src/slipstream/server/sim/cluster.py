"""Replicas on a virtual clock behind the gateway's router, with the operator's autoscaling
policy in the loop (``slipstream simulate``).

Each replica is the engine's real :class:`Scheduler` and :class:`KVCacheManager` (prefix caching
on, as a pod runs it); a step takes the cost model's time on the replica's own clock instead of
running a model, so hours of traffic simulate in seconds and every scheduling effect (token
budget, seat limit, KV exhaustion, preemption, prefix-cache hits) is the engine's own. A prefix
hit advances a request's ``num_computed_tokens`` at admission, so the cost model charges prefill
only for the uncached tokens, as it does for ``--model sim:`` pods. Requests are routed by the
gateway's own :class:`~slipstream.server.gateway.routing.Router` (``routing``: round-robin,
least-loaded, prefix or kv-events). Every ``tick`` seconds the cluster does what the operator
does: read each ready replica's gauges, call :func:`slipstream.operator.autoscaler.decide`, and
create (ready after ``startup_delay`` seconds) or drain replicas to match. Requests that arrive
while no replica is ready wait, as in the gateway, and are the gateway's waiting requests the
policy reads, so ``minReplicas: 0`` scales from zero and, after ``scaleToZeroAfterSeconds``
idle, back to it.

Simplifications, each a choice: requests are routed when they arrive, to ready replicas only,
with the replicas' gauges as they are at that instant (a perfectly fresh scrape); under
``kv-events`` the router's block index is every replica's KV cache as it is at that instant
(perfect, instant event delivery: every block stored or evicted reaches the index before the next
decision); a replica asked to go away first stops getting requests, finishes what it holds, then
leaves; every step's outputs land at its end; a request's output tokens are its content's reply
(or zeros), so a later turn that repeats them hits the cache as a real conversation would.
"""
from __future__ import annotations

import bisect
import functools
import itertools
import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from slipstream.api_types.load import GatewayLoad, PodLoad
from slipstream.api_types.autoscaling import AutoscalingSpec
from slipstream.api_types.engine import DEFAULT_LONG_PREFILL_TOKEN_THRESHOLD
from slipstream.api_types.tenancy import DEFAULT_SCHEDULING_POLICY, DEFAULT_TENANT
from slipstream.operator.autoscaler import Decision
from slipstream.operator.fleet import Fleet
from slipstream.operator.policy import Tick

from ..engine.fairness import WaitingQueue
from ..engine.kv_cache import STORED, KVCacheManager
from ..engine.outputs import RequestMetrics
from ..engine.request import Request
from ..engine.sampling_params import SamplingParams
from ..engine.scheduler import Scheduler
from ..gateway.routing import EndpointLoad, RouteRequest, Router
from ..kv_hash import block_hash
from ..metrics import TTFT_BUCKETS
from .cost_model import Profile, batch_shape, step_time
from .scalers import PolicyScaler, Scaler
from .trace import Arrival, Content
from .workloads import distinct_prompt

_SERIALS = itertools.count(1)  # distinct prompts for requests without content


@functools.lru_cache(maxsize=4096)
def _params(output_tokens: int) -> SamplingParams:
    """What the scheduler reads of a simulated request: it ends after ``output_tokens`` (at least
    one: a step that completes the prompt samples a token); shared per length."""
    return SamplingParams(max_tokens=max(1, output_tokens), ignore_eos=True)


@dataclass(frozen=True, slots=True)
class ReplicaConfig:
    """Engine settings of every replica (token counts; bytes for the KV cache; the engine's
    scheduling policy and tenant weights; its long-prefill threshold, 0 for none)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_bytes: int
    block_size: int = 16
    prefix_caching: bool = True
    scheduling_policy: str = DEFAULT_SCHEDULING_POLICY
    tenant_weights: Mapping[str, float] | None = None
    long_prefill_token_threshold: int = DEFAULT_LONG_PREFILL_TOKEN_THRESHOLD

    @classmethod
    def for_profile(cls, profile: Profile, **overrides) -> ReplicaConfig:
        values = dict(max_num_seqs=profile.max_num_seqs, max_num_batched_tokens=profile.max_num_batched_tokens,
                      kv_cache_bytes=profile.kv_cache_bytes)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


@dataclass(eq=False, slots=True)
class SimRequest:
    """One request's life in virtual seconds; ``first_token`` and ``finished`` None until then.

    content: its token ids (None: a distinct prompt of ``prompt_tokens`` tokens).
    cached_tokens: prompt tokens its replica found in the prefix cache when it was admitted.
    """

    arrival: float
    prompt_tokens: int
    output_tokens: int
    content: Content | None = None
    first_token: float | None = None
    finished: float | None = None
    replica: str = ""
    cached_tokens: int = 0
    tenant: str = DEFAULT_TENANT
    serial: int = field(default_factory=lambda: next(_SERIALS))

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    def prompt_ids(self) -> list[int]:
        return self.content.prompt_ids() if self.content is not None else distinct_prompt(self.serial,
                                                                                            self.prompt_tokens)

    @property
    def session(self) -> str | None:
        return self.content.session_key if self.content is not None else None


class BlockHashes:
    """Chained block hashes of prompts (:func:`~slipstream.server.kv_hash.prompt_block_hashes`'s),
    memoized by (parent hash, block tokens): prompts of a group or a session share their head, so
    most of a prompt's blocks were hashed before. A speed-up of the simulator only; at
    ``capacity`` entries the memo starts over."""

    def __init__(self, block_size: int, capacity: int = 200_000):
        self.block_size, self.capacity = block_size, capacity
        self._memo: dict[tuple[bytes | None, tuple[int, ...]], bytes] = {}

    def __call__(self, token_ids: list[int]) -> tuple[bytes, ...]:
        bs, memo = self.block_size, self._memo
        hashes: list[bytes] = []
        parent = None
        for start in range(0, len(token_ids) - bs + 1, bs):
            key = (parent, tuple(token_ids[start:start + bs]))
            parent = memo.get(key)
            if parent is None:
                if len(memo) >= self.capacity:
                    memo.clear()
                parent = memo[key] = block_hash(key[0], key[1])
            hashes.append(parent)
        return tuple(hashes)


class VirtualReplica:
    """One pod: a scheduler and KV pool whose steps take the cost model's time.

    ``time`` is when its device is next free; ``ready_at`` when it starts taking requests.
    kv_events: record the KV pool's block events (what a pod publishes for ``kv-events``).
    """

    def __init__(self, name: str, profile: Profile, config: ReplicaConfig, created: float, ready_at: float,
                 kv_events: bool = False):
        self.name = name
        self.profile = profile
        num_blocks = config.kv_cache_bytes // (config.block_size * profile.model.kv_bytes_per_token)
        if num_blocks < 1:
            raise ValueError(f"kv_cache_bytes={config.kv_cache_bytes} holds no KV block of {config.block_size} tokens")
        self.kv = KVCacheManager(num_blocks, config.block_size, enable_prefix_caching=config.prefix_caching)
        self.kv.record_events(kv_events)
        waiting = WaitingQueue(config.scheduling_policy, config.tenant_weights,
                               cached_blocks=self.kv.cached_prefix_blocks)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   max_model_len=profile.model.max_model_len, waiting=waiting,
                                   long_prefill_token_threshold=config.long_prefill_token_threshold)
        self.time = created
        self.created = created
        self.ready_at = ready_at
        self.draining = False
        self.stopped: float | None = None
        self._requests: dict[str, SimRequest] = {}
        self._replies: dict[str, list[int]] = {}
        self._ids = itertools.count()
        self.num_steps = 0
        # The counters and the TTFT histogram a pod's /metrics exports, as the engine counts them:
        # prompt tokens at the first token, each generated token as it is made, requests at finish.
        self.prompt_tokens_total = self.generation_tokens_total = self.requests_total = 0
        # The tokens of finished requests: what the gateway counts, from each answer's usage.
        self.answered_prompt_tokens = self.answered_generation_tokens = 0
        self._ttft_counts = [0] * (len(TTFT_BUCKETS) + 1)

    def ready(self, now: float) -> bool:
        return now >= self.ready_at and not self.draining

    @property
    def idle(self) -> bool:
        return not self._requests

    @property
    def load(self) -> int:
        return self.scheduler.num_waiting + self.scheduler.num_running

    def sample(self, now: float) -> PodLoad:
        """The gauges, counters and TTFT histogram a scrape would read now."""
        cumulative = list(itertools.accumulate(self._ttft_counts))
        buckets = tuple(zip(TTFT_BUCKETS + (math.inf,), map(float, cumulative)))
        return PodLoad(self.name, now, self.scheduler.num_waiting, self.scheduler.num_running, self.kv.usage,
                       prompt_tokens_total=self.prompt_tokens_total,
                       generation_tokens_total=self.generation_tokens_total,
                       requests_total=self.requests_total, ttft_buckets=buckets)

    def add(self, sim: SimRequest, now: float, prompt_ids: list[int] | None = None,
            block_hashes: tuple[bytes, ...] = ()) -> None:
        """Queue a request that arrived at ``now``. ``prompt_ids`` (default ``sim.prompt_ids()``)
        and ``block_hashes``, when the caller already has them (the same chained hashes the pool
        would compute). Raises ValueError if it can never fit."""
        total = sim.prompt_tokens + sim.output_tokens
        if self.kv.blocks_needed(total) > self.kv.num_blocks or total > self.profile.model.max_model_len:
            raise ValueError(f"a request of {total} tokens does not fit one replica "
                             f"({self.kv.num_blocks} KV blocks, max_model_len {self.profile.model.max_model_len})")
        rid = f"{self.name}-{next(self._ids)}"
        sim.replica = self.name
        self._requests[rid] = sim
        if sim.content is not None:
            self._replies[rid] = sim.content.reply_ids()
        req = Request(rid, rid, 0, prompt_ids if prompt_ids is not None else sim.prompt_ids(),
                      _params(sim.output_tokens), None, RequestMetrics(now), tenant=sim.tenant)
        req.block_hashes = list(block_hashes)
        self.scheduler.add(req)
        self.time = max(self.time, now)

    def _next_token(self, req: Request) -> int:
        """The token a step samples for ``req``: the next of its content's reply (zeros past it)."""
        reply = self._replies.get(req.request_id)
        position = req.num_output_tokens
        return reply[position] if reply is not None and position < len(reply) else 0

    def advance(self, until: float) -> None:
        """Run every step that starts before ``until``; an idle replica's clock jumps to it."""
        while self.time < until:
            batch = self.scheduler.schedule()
            if not batch:
                self.time = until
                return
            end = self.time + step_time(self.profile, batch_shape(
                (r.num_computed_tokens, n) for r, n in zip(batch.requests, batch.num_new_tokens)))
            sampled = {batch.requests[i]: self._next_token(batch.requests[i]) for i in batch.sample_indices()}
            for req in self.scheduler.update_from_output(batch, sampled):  # the engine's own after-step update
                sim = self._requests[req.request_id]
                self.generation_tokens_total += 1
                if sim.first_token is None:
                    sim.first_token = end
                    sim.cached_tokens = req.num_cached_tokens
                    self.prompt_tokens_total += sim.prompt_tokens
                    self._ttft_counts[bisect.bisect_left(TTFT_BUCKETS, end - sim.arrival)] += 1
                if req.finished:  # at max_tokens = its output length
                    sim.finished = end
                    self.answered_prompt_tokens += sim.prompt_tokens
                    self.answered_generation_tokens += sim.output_tokens
                    self.requests_total += 1
                    del self._requests[req.request_id]
                    self._replies.pop(req.request_id, None)
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
    decisions: list[tuple[float, Decision]] = field(default_factory=list)  # every tick's, when kept
    replica_seconds: float = 0.0  # pod time paid for, starting included
    end_time: float = 0.0
    prefix_queries: int = 0  # prompt tokens looked up in the replicas' prefix caches at admission
    prefix_hits: int = 0     # of those, tokens found cached (``slipstream:prefix_cache_*_total``)

    @property
    def prefix_hit_ratio(self) -> float:
        """Prompt tokens found in the prefix cache / tokens looked up, over every replica, 0..1."""
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

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
        scaler: what decides the count each tick (default: the operator's policy that
            ``spec.policy`` names, :class:`~.scalers.PolicyScaler`; ``simulate --compare``
            passes baselines).
        routing: a :data:`~slipstream.server.gateway.routing.POLICIES` name (round-robin is what a
            ClusterIP Service does; the rest are the gateway's), or a :class:`Router` to use.
        weights: the router's score weights by scorer name (default the gateway's; not with a
            :class:`Router`, which has its own).
    Raises ValueError for an unknown policy or weight, or a bad tick or delay.
    """

    def __init__(self, profile: Profile, config: ReplicaConfig, spec: AutoscalingSpec, *,
                 startup_delay: float = 60.0, tick: float = 2.0, initial: int | None = None,
                 routing: str | Router = "round-robin", weights: Mapping[str, float] | None = None,
                 scaler: Scaler | None = None):
        if not (0 < tick < math.inf and 0 <= startup_delay < math.inf):  # nan too: it never ticks on
            raise ValueError(f"tick must be a finite number > 0 and startup_delay a finite number >= 0, got "
                             f"{tick}, {startup_delay}")
        if isinstance(routing, Router) and weights is not None:
            raise ValueError("give the weights to the Router, not beside it")
        self.router = routing if isinstance(routing, Router) else Router(routing, weights=weights)
        self.profile, self.config, self.spec = profile, config, spec
        self.startup_delay, self.tick, self.routing = startup_delay, tick, self.router.policy
        self.keep_decisions = False  # SimResult.decisions: every tick's decision (for tests and plots)
        self.scaler = scaler if scaler is not None else PolicyScaler(spec)
        self.replicas: list[VirtualReplica] = []
        self.retired: list[VirtualReplica] = []
        self.pending: list[SimRequest] = []  # arrived while no replica was ready
        self._names = itertools.count()
        self._hashes = BlockHashes(config.block_size)
        for _ in range(initial if initial is not None else spec.min_replicas):
            self._create(0.0, ready_at=0.0)

    # --- replicas -----------------------------------------------------------------------------
    def _create(self, now: float, ready_at: float) -> None:
        self.replicas.append(VirtualReplica(f"pod-{next(self._names)}", self.profile, self.config, now, ready_at,
                                            kv_events=self.router.reads_kv_events))

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
            self.router.forget(replica.name)

    # --- requests -----------------------------------------------------------------------------
    def _route(self, sim: SimRequest, now: float) -> bool:
        """Hand ``sim`` to the replica the router picks among the ready ones; False if none is."""
        ready = {r.name: r for r in self.replicas if r.ready(now)}
        if not ready:
            return False
        ids, hashes = None, ()
        if sim.content is not None:  # hashed here once (memoized) for the router and the replica's pool
            ids = sim.prompt_ids()
            hashes = self._hashes(ids)
        request = RouteRequest(hashes, sim.session)
        self._deliver_kv_events()
        loads = [EndpointLoad(r.name, r.scheduler.num_waiting, r.scheduler.num_running, r.kv.usage, r.load)
                 for r in ready.values()]
        choice = self.router.pick(request, loads)
        if choice is None:  # no capacity limits here, so only with no endpoint at all
            return False
        ready[choice.endpoint].add(sim, now, ids, hashes)
        self.router.record(request, choice)
        return True

    def _deliver_kv_events(self) -> None:
        """Apply every replica's KV events since the last decision to the router's block index
        (kv-events only: perfect, instant delivery)."""
        index = self.router.block_index
        for replica in self.replicas:
            for event in replica.kv.take_events():
                if event.kind == STORED:
                    index.stored(replica.name, event.block_hashes)
                else:
                    index.removed(replica.name, event.block_hashes)

    def _advance(self, until: float) -> None:
        for replica in self.replicas:
            replica.advance(until)
        if self.pending and any(r.ready(until) for r in self.replicas):
            waiting, self.pending = self.pending, []
            for sim in waiting:
                self._route(sim, until)

    # --- the loop -----------------------------------------------------------------------------
    def gateway_load(self) -> GatewayLoad:
        """What the gateway would report: requests held for want of a ready replica (the demand
        signal at zero replicas), requests on replicas, and the demand counters (requests
        answered and their tokens, counted at the end of each request)."""
        every = self.replicas + self.retired
        return GatewayLoad(waiting=float(len(self.pending)), in_flight=float(sum(r.load for r in self.replicas)),
                           requests_total=float(sum(r.requests_total for r in every)),
                           prompt_tokens_total=float(sum(r.answered_prompt_tokens for r in every)),
                           generation_tokens_total=float(sum(r.answered_generation_tokens for r in every)),
                           answered_total=float(sum(r.requests_total for r in every)))  # none fails here

    def fleet(self, now: float) -> Fleet:
        """Ready replicas, the starting ones' ages, and the starts (created → ready) of those that
        became ready since the previous tick."""
        ready = [r for r in self.replicas if r.ready(now)]
        starting = [r for r in self.active if not r.ready(now)]
        started = tuple(r.ready_at - r.created for r in ready
                        if now - self.tick < r.ready_at <= now and r.ready_at > r.created)
        return Fleet(len(ready), tuple(now - r.created for r in starting), started)

    def _autoscale(self, now: float, arrivals: int, result: SimResult) -> None:
        ready = [r for r in self.replicas if r.ready(now)]
        starting = [r for r in self.active if not r.ready(now)]
        samples = [r.sample(now) for r in ready]
        current = len(self.active)
        desired = current
        if self.spec.enabled:
            decision = self.scaler.decide(Tick(now, current, self.fleet(now), samples, self.gateway_load()))
            desired = decision.desired_replicas
            if self.keep_decisions:
                result.decisions.append((now, decision))
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
                sim = SimRequest(arrival.time, arrival.prompt_tokens, arrival.output_tokens, arrival.content,
                                 tenant=arrival.tenant)
                result.requests.append(sim)
                if not self._route(sim, arrival.time):
                    self.pending.append(sim)
            i += count
            self._advance(now)
            self._retire_idle_drained(now)
            self._autoscale(now, count, result)
            busy = self.pending or any(not r.idle for r in self.replicas)
            # every arrival played: one at exactly a tick is counted on the next tick (bisect_left)
            if now >= end and i == len(arrivals) and (not busy or now >= end + drain_limit):
                break
        result.end_time = now
        for replica in self.replicas + self.retired:
            result.replica_seconds += (replica.stopped if replica.stopped is not None else now) - replica.created
            result.prefix_queries += replica.kv.prefix_queries
            result.prefix_hits += replica.kv.prefix_hits
        return result
