"""The ``capacity`` autoscaling policy (the default): replicas = demand ÷ one pod's capacity at
the latency objective, with the pods on their way counted as capacity (pure).

The operator (:mod:`slipstream.operator.autoscaling_loop`) and ``slipstream simulate`` call
:func:`decide` through :mod:`slipstream.operator.policy` once per tick with the samples read,
the fleet (ready pods, starting pods' ages, measured start times) and the clock; nothing here
reads a clock or the network.

Units: demand in requests/s and tokens/s; a pod's capacity in prompt-equivalent tokens/s
(``prompt + κ × generated``: κ, :attr:`CapacityPrior.generation_weight`, is how much more pod
time a generated token takes than a prompt token); times in seconds.

Why not queue depth: a backlog grows while new pods start, so a policy that sizes from queue
per ready pod keeps adding pods for the same backlog until it hits the maximum (the cascade of
aibrix#2670 and knative/serving#13284). Here the backlog is a quantity of work with a plan to
drain it, and the pods already starting are part of that plan.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

from slipstream.api_types.autoscaling import STABLE_WINDOW_SECONDS, AutoscalingSpec
from slipstream.api_types.load import GatewayLoad, PodLoad

from .autoscaler import Decision, stored_number, stored_row
from .demand import Interval, PodWork, Totals, demand_totals, interval, pod_readings, \
    pod_work, totals_from
from .fleet import Fleet

OBJECTIVE_QUANTILE = 0.9         # the objective is a p90: met while ≥ 90% of requests meet it
# The windows while spec.autoscaling leaves them unset (stableWindowSeconds, panicWindowSeconds,
# panicThreshold, scaleDownDelaySeconds; :func:`spec_windows`):
DEMAND_SECONDS = float(STABLE_WINDOW_SECONDS)  # demand: the arrival rate over this window ...
PANIC_SECONDS = 8.0              # ... or over this one while it is PANIC_RATIO × that or more
PANIC_RATIO = 2.0                # (Knative's panic mode; its 6 s window was twitchier on the Azure trace)
LEARN_SECONDS = 60.0             # capacity is re-estimated once per window of this length
LEARN_RATE = 0.5                 # weight of a new window's estimate against the old one
LEARN_MIN_REQUESTS = 20          # a window with fewer TTFT observations teaches nothing
CAPACITY_BOUNDS = (0.1, 10.0)    # the learned capacity stays within these multiples of the prior
HEADROOM = 0.3                   # pods are sized for demand × (1 + HEADROOM)
DRAIN_SECONDS = 30.0             # a backlog should be gone this long (or the objective, if longer)
                                 # after new pods are ready
HOLD_STARTS = 5.0                # scale-down waits this many start times of lower need
ATTAINMENT_SECONDS = 300.0       # status.objectiveAttainment's window
_EPS = 1e-9


@dataclass(frozen=True, slots=True)
class CapacityPrior:
    """What the policy assumes before it has measured anything.

    tokens_per_second: one pod's throughput at the objective, prompt-equivalent tokens/s
        (``slipstream simulate`` derives it from the cost-model profile; the operator uses
        the last learned value, persisted in ``status.autoscaler``, or this default).
    generation_weight: κ, pod time of a generated token over that of a prompt token.
    start_seconds: a pod's start, created → Ready, until one has been measured.
    request_tokens: prompt-equivalent tokens of one request, until one has finished.
    drain_tokens_per_second: how fast one busy pod works through a backlog (its throughput
        flat out, above the capacity at the objective, which leaves room for bursts); None:
        2 × ``tokens_per_second``.

    Raises:
        ValueError: a value that is not a finite number > 0 (it would divide by zero every tick).
    """

    tokens_per_second: float = 8000.0
    generation_weight: float = 2.0
    start_seconds: float = 60.0
    request_tokens: float = 1000.0
    drain_tokens_per_second: float | None = None

    def __post_init__(self) -> None:
        for name in ("tokens_per_second", "generation_weight", "start_seconds", "request_tokens",
                     "drain_tokens_per_second"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"capacity prior: {name} must be a finite number > 0, got {value!r}")

    @property
    def drain_rate(self) -> float:
        return self.drain_tokens_per_second or 2 * self.tokens_per_second


@dataclass(frozen=True, slots=True)
class CapacityState:
    """What the policy remembers between ticks; plain data (:meth:`to_dict` is JSON-ready).

    time: the previous tick. totals: demand counters then (:class:`~.demand.Totals`) and
    their source. pods: per pod, cumulative [prompt, generated, TTFT met, TTFT total].
    intervals: recent (end time, arrivals, sized, prompt, generated, seconds); sized: the
    requests whose tokens the row counts (answered, from the gateway; first tokens, from pods).
    work: recent (end time, pod-seconds, prompt, generated, TTFT met, TTFT total, 1 if no pod
    was starting else 0).
    capacity: learned tokens/s per pod (None: the prior). learned_at: last re-estimate.
    start_seconds: measured pod start (None: the prior). needs: recent (time, pods needed).
    last_active: last time a request was held or arrived (scale to zero).
    """

    time: float | None = None
    totals: Totals | None = None
    source: str | None = None
    pods: Mapping[str, Sequence[float]] = field(default_factory=dict)
    intervals: tuple[tuple[float, ...], ...] = ()
    work: tuple[tuple[float, ...], ...] = ()
    capacity: float | None = None
    learned_at: float | None = None
    start_seconds: float | None = None
    needs: tuple[tuple[float, int], ...] = ()
    last_active: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"policy": "capacity", "time": self.time,
                "totals": self.totals.to_list() if self.totals else None, "source": self.source,
                "pods": {k: list(v) for k, v in self.pods.items()},
                "intervals": [list(i) for i in self.intervals], "work": [list(w) for w in self.work],
                "capacity": self.capacity, "learnedAt": self.learned_at,
                "startSeconds": self.start_seconds, "needs": [list(n) for n in self.needs],
                "lastActive": self.last_active}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> CapacityState:
        """The state :meth:`to_dict` wrote; anything else (None, the queue policy's, or one that
        does not read as the numbers it holds: another operator version's, or edited) is a
        fresh state."""
        if not isinstance(data, Mapping) or data.get("policy") != "capacity":
            return cls()
        try:
            pods = data.get("pods") or {}
            if not isinstance(pods, Mapping):
                raise ValueError(f"status.autoscaler.pods: expected an object, got {pods!r}")
            return cls(time=stored_number(data.get("time")),
                       totals=_stored_totals(data.get("totals")),
                       source=data.get("source"),
                       pods={str(k): stored_row(v, 4) for k, v in pods.items()},
                       intervals=tuple(stored_row(i, 6) for i in data.get("intervals") or ()),
                       work=tuple(stored_row(w, 7) for w in data.get("work") or ()),
                       capacity=stored_number(data.get("capacity"), positive=True),
                       learned_at=stored_number(data.get("learnedAt")),
                       start_seconds=stored_number(data.get("startSeconds"), positive=True),
                       needs=tuple((t, int(n)) for t, n in (stored_row(n, 2) for n in data.get("needs") or ())),
                       last_active=stored_number(data.get("lastActive")))
        except (TypeError, ValueError):
            return cls()


def _stored_totals(row: Any) -> Totals | None:
    """The stored demand counters; None for none, or for the 4 numbers an operator before the
    sized count wrote (its next tick is then no interval; the rest of its state is kept)."""
    if not row or (isinstance(row, (list, tuple)) and len(row) == 4):
        return None
    return totals_from(stored_row(row, 5))


@dataclass(frozen=True, slots=True)
class Windows:
    """``spec.autoscaling``'s windows as this policy reads them, seconds: demand is the arrival
    rate over ``demand``, or over ``panic`` while that rate is ``ratio`` × the other or more;
    ``hold``: how long lower needs must last before a scale-down (None: :data:`HOLD_STARTS`
    measured pod starts); ``tolerance``: the dead band around the current count (a fraction)."""

    demand: float
    panic: float
    ratio: float
    hold: float | None = None
    tolerance: float = 0.0


def spec_windows(spec: AutoscalingSpec) -> Windows:
    """The fields ``spec`` sets, this module's defaults for those it leaves unset (no dead band:
    the headroom and the hold do that job); the panic window cut to the demand window."""
    demand = float(spec.stable_window_seconds or DEMAND_SECONDS)
    return Windows(demand, min(float(spec.panic_window_seconds or PANIC_SECONDS), demand),
                   float(spec.panic_threshold or PANIC_RATIO),
                   None if spec.scale_down_delay_seconds is None else float(spec.scale_down_delay_seconds),
                   spec.tolerance or 0.0)


@dataclass(frozen=True, slots=True)
class Demand:
    """Arrival rate (requests/s), prompt and generated tokens/s, and the prompt-equivalent
    work rate (tokens/s) of those; ``request_tokens``: work of one request (tokens);
    ``panic``: the rate is the panic window's."""

    requests: float
    prompt_tokens: float
    generation_tokens: float
    work: float
    request_tokens: float
    panic: bool = False


def _inside(row: tuple[float, ...], start: float) -> tuple[float, ...]:
    """An interval ``(end, arrivals, sized, prompt, generated, seconds)`` cut to its part after
    ``start``, its counts pro rata: a long one (after a missed scrape or an operator restart)
    would else put its own average, over more than the window, in a window it ended in."""
    span = row[5]
    cut = min(1.0, (row[0] - start) / span) if span > 0 else 1.0
    return (row[0], *(v * cut for v in row[1:5]), span * cut)


def estimate_demand(intervals: Sequence[tuple[float, ...]], now: float, prior: CapacityPrior,
                    windows: Windows | None = None) -> Demand:
    """Demand over the recent intervals ``(end, arrivals, sized, prompt, generated, seconds)``
    (``sized``: the requests whose tokens the row counts); ``windows``: the spec's
    (None: the defaults, :data:`DEMAND_SECONDS`, :data:`PANIC_SECONDS`, :data:`PANIC_RATIO`).

    The arrival rate is the one over the last :data:`DEMAND_SECONDS`, or over the last
    :data:`PANIC_SECONDS` while that is at least :data:`PANIC_RATIO` × the longer one (the
    shape of Knative KPA's stable and panic windows: the long window alone reads a step up at a
    fraction of its height for a whole window; the short one alone chased second-long bursts on
    the Azure code trace that are over before a pod starts). Unlike Knative's, which compares
    the panic window's pods with the ready ones and stays in panic a stable window, this reads
    the step only while the long window, which contains the short one, lags it: a step of r ×
    a steady rate is read for 30 (r − 2) / (r − 1) s after the short window fills (20 s for
    4 ×, none under about 2.4 ×); the pods asked for then are kept by the scale-down hold. An
    interval that began before a window counts for its part inside it. Token rates are the arrival rate × the mean
    lengths of the requests sized in the long window (the prior's ``request_tokens`` when none
    were). Holt's forecast one start time ahead, in place of this rate or above it, was tried
    (issue 33, commit 07c8553) and cost more replica-hours in every run measured
    (benchmarks/README.md, autoscaling)."""
    win = windows or Windows(DEMAND_SECONDS, PANIC_SECONDS, PANIC_RATIO)

    def window(seconds: float) -> list[tuple[float, ...]]:
        start = now - seconds
        return [_inside(i, start) for i in intervals if i[0] > start + _EPS]  # ended inside the window

    def rate(rows: list[tuple[float, ...]]) -> float:
        span = sum(r[5] for r in rows)
        return sum(r[1] for r in rows) / span if span > 0 else 0.0

    long = window(win.demand)
    requests = rate(long)
    short = rate(window(win.panic))
    panic = short > 0 and short >= win.ratio * requests
    if panic:
        requests = short
    sized = sum(r[2] for r in long)
    if sized > 0:
        prompt = sum(r[3] for r in long) / sized
        generated = sum(r[4] for r in long) / sized
        per_request = prompt + prior.generation_weight * generated
    else:
        prompt, generated, per_request = prior.request_tokens, 0.0, prior.request_tokens
    return Demand(requests, requests * prompt, requests * generated, requests * per_request, per_request, panic)


def learn_capacity(capacity: float, work: Sequence[tuple[float, ...]], prior: CapacityPrior,
                   down: bool = True) -> float:
    """A new estimate of one pod's capacity at the objective (tokens/s) from a window of pod
    work ``(end, pod_seconds, prompt, generated, met, total)``.

    Rules: where the objective was missed (< 90% met), the capacity is at most what the pods
    did (throughput per pod), so the estimate moves toward it; where it was met at more than
    the estimate, the pods showed more, so the estimate moves up to it. Either move is
    :data:`LEARN_RATE` of the way (an exponentially weighted average, so one odd window does
    not swing it); a window with fewer than :data:`LEARN_MIN_REQUESTS` observations, or
    whose evidence agrees with the estimate, leaves it. ``down`` False (pods were starting in
    the window, so a miss may be the start's backlog rather than the pods) allows only the
    upward move. The result stays within :data:`CAPACITY_BOUNDS` × the prior.
    """
    pod_seconds = sum(w[1] for w in work)
    total = sum(w[5] for w in work)
    if pod_seconds <= 0 or total < LEARN_MIN_REQUESTS:
        return capacity
    throughput = (sum(w[2] for w in work) + prior.generation_weight * sum(w[3] for w in work)) / pod_seconds
    met = sum(w[4] for w in work) / total
    missed = met < OBJECTIVE_QUANTILE
    if missed and throughput < capacity and down:
        capacity += LEARN_RATE * (throughput - capacity)
    elif not missed and throughput > capacity:
        capacity += LEARN_RATE * (throughput - capacity)
    low, high = CAPACITY_BOUNDS
    return min(max(capacity, low * prior.tokens_per_second), high * prior.tokens_per_second)


def drain_seconds(backlog: float, demand: float, capacity: float, ready: int,
                  arrivals: Sequence[float], horizon: float = 3600.0) -> float:
    """Seconds until ``backlog`` tokens of work are done, with ``ready`` pods now and one more
    at each of ``arrivals`` (seconds from now), each doing ``capacity`` tokens/s, while new work
    comes at ``demand`` tokens/s. math.inf when not within ``horizon``."""
    if backlog <= 0:
        return 0.0
    t, left = 0.0, backlog
    pods = ready + sum(1 for a in arrivals if a <= 0)
    for at in sorted(a for a in arrivals if a > 0) + [horizon]:
        rate = pods * capacity - demand  # negative: the backlog grows
        if rate > 0 and t + left / rate <= at:
            return t + left / rate
        left -= rate * (at - t)
        t, pods = at, pods + 1
    return math.inf


def plan_backlog(backlog: float, demand: float, capacity: float, fleet: Fleet, pods: int,
                 start: float, most: int, drain_for: float = DRAIN_SECONDS) -> tuple[int, float]:
    """(extra pods, drain seconds): the fewest pods to add beyond ``pods`` so that
    ``backlog`` tokens drain within ``drain_for`` seconds after a new pod would be ready
    (``capacity``: tokens/s one pod works through a backlog at; ``demand``: tokens/s arriving).

    The fleet's ready pods work now; its starting pods arrive at their expected ready time
    (``start`` − age) and the ``pods − len(fleet)`` asked for now at ``start``. No pod is added
    when the backlog drains before a new one could be ready (it would arrive to no work), nor
    beyond ``most`` pods in all.
    """
    arrivals = [max(0.0, start - age) for age in fleet.starting_ages]
    arrivals += [start] * max(0, pods - fleet.ready - len(fleet.starting_ages))
    base = drain_seconds(backlog, demand, capacity, fleet.ready, arrivals)
    if base <= start:
        return 0, base
    extra, took = 0, base
    while took > start + drain_for and pods + extra < most:
        extra += 1
        took = drain_seconds(backlog, demand, capacity, fleet.ready, arrivals + [start] * extra)
    return extra, took


def _measured_start(state: CapacityState, fleet: Fleet, prior: CapacityPrior) -> float:
    """The expected start time: the mean of the starts measured this tick blended into the
    one remembered (half each), or the prior."""
    known = state.start_seconds
    if fleet.start_seconds:
        seen = sum(fleet.start_seconds) / len(fleet.start_seconds)
        known = seen if known is None else 0.5 * known + 0.5 * seen
    return known if known is not None else prior.start_seconds


def decide(spec: AutoscalingSpec, state: CapacityState, samples: Sequence[PodLoad], now: float,
           current_replicas: int, fleet: Fleet, gateway: GatewayLoad | None = None,
           prior: CapacityPrior = CapacityPrior()) -> Decision:
    """One tick of the capacity policy; pure (``state`` is not changed; the new one is
    ``Decision.state``).

    samples: this tick's :class:`PodLoad` of the ready pods that answered, with their counters
    and TTFT histograms. current_replicas: the workload's ``spec.replicas``. fleet: ready pods,
    starting pods' ages and the start times measured (:mod:`.fleet`). gateway: the gateway
    pods' gauges and counters (None: none answered, or routing off). prior: what to assume
    before anything is measured.

    Rules, in order:

    1. Demand (:func:`estimate_demand`): arrivals = finished + Δ held, from the gateway's
       counters, else the pods' own (:mod:`.demand`). Counters are summed over pods, so a tick
       is an interval only when the same pods answered at both ends (every gateway pod, or the
       same model pods): else one pod's lifetime would read as a tick's demand. The rate is
       the stable window's, or the panic window's on a step up (:func:`spec_windows`: the spec's
       fields, unset :data:`DEMAND_SECONDS`, :data:`PANIC_SECONDS`, :data:`PANIC_RATIO`); a
       request's size is tokens over the requests they were counted for (:mod:`.demand`).
    2. Capacity per pod: the prior, then re-estimated once per :data:`LEARN_SECONDS` from the
       pods' counters and TTFT histograms (:func:`learn_capacity`); a window in which a pod
       was starting only raises it (a backlog built while pods start says nothing about the
       pods, but a met window shows what they did: without that, a fleet sized above need
       never shows more than the prior and the count at a step up stays the prior's).
    3. Need = ceil(work rate × W / (W + objective) × (1 + :data:`HEADROOM`) / capacity), W the
       window the rate was read over: a window's arrivals may finish as late as the objective
       after it ends, so the objective is slack to spread them over (with a loose objective a
       burst needs fewer pods; at 1 s over 60 s it changes little). With ``tolerance`` set, a
       need whose unrounded count is within ±tolerance of the current one is the current one.
    4. Backlog (waiting requests × work per request) drained on a plan
       (:func:`plan_backlog`): pods already starting count as capacity from their expected
       ready time (start measured: pod created → Ready); extra pods only if they arrive
       before the backlog would drain anyway, and then the fewest that drain it within
       :data:`DRAIN_SECONDS` (or the objective, if longer) of a new pod's ready time, against
       rule 3's spread work rate.
    5. Guards: KV-cache use per pod above ``targetKVCacheUtilization`` asks for
       ceil(KV in pods' worth / target) pods and, like waiting requests per ready pod above
       ``targetQueueDepth``, blocks any scale-down. Neither sizes the count otherwise.
    6. Scale-down weighs the start time: to the highest need of the last
       :data:`HOLD_STARTS` start times (a pod removed now takes a start time to come back,
       so it stays while the load is likely back within that), or of the last
       ``scaleDownDelaySeconds`` where the spec sets it. A fresh state counts the
       replicas it finds as needed at its first tick (its demand reads 0 until a second
       reading), so a service started above its need comes down only after that hold.
    7. [minReplicas, maxReplicas]; zero as the queue policy does it (``minReplicas: 0``: up
       from 0 on a request held in the gateway, down to 0 after ``scaleToZeroAfterSeconds``
       with no request held or arriving, every pod and gateway having answered).

    The decision carries the attainment over :data:`ATTAINMENT_SECONDS` and its numbers
    (``details``: demand, capacity per pod, pods starting, desired, reason).
    """
    if not spec.enabled:
        return Decision(current_replicas, current_replicas, "autoscaling disabled", state)
    objective = spec.objectives.ttft_p90_seconds
    win = spec_windows(spec)

    # 1. counters -> the interval since the last tick
    found = demand_totals(samples, gateway)
    readings = pod_readings(samples, objective)
    if found is not None and found[0] == "gateway" and not gateway.complete:
        found = None  # a silent gateway pod's counters are missing from the sum: no baseline either
    intervals = [i for i in state.intervals if i[0] > now - max(win.demand, ATTAINMENT_SECONDS) - _EPS]
    step: Interval | None = None
    # summed over other pods than last tick (one that missed a scrape, or joined), the totals
    # differ by a pod's lifetime counts: not an interval
    same = found is not None and (found[0] != "pods" or set(readings) == set(state.pods))
    if same and state.totals is not None and state.source == found[0] and state.time is not None:
        step = interval(state.totals, found[1], now - state.time)
    if step is not None:
        intervals.append((now, step.arrivals, step.sized, step.prompt_tokens, step.generation_tokens,
                          step.seconds))
    demand = estimate_demand(intervals, now, prior, win)

    # 2. capacity
    work = [w for w in state.work if w[0] > now - ATTAINMENT_SECONDS - _EPS]
    if state.time is not None and readings:
        did: PodWork = pod_work(state.pods, readings, now - state.time)
        if did.pod_seconds > 0:
            work.append((now, did.pod_seconds, did.prompt_tokens, did.generation_tokens, did.ttft_met,
                         did.ttft_total, float(fleet.starting == 0)))
    capacity, learned_at = state.capacity or prior.tokens_per_second, state.learned_at
    if learned_at is None:
        learned_at = now
    elif now - learned_at >= LEARN_SECONDS:
        window = [w for w in work if w[0] > learned_at]
        # with pods starting a miss may be the start's backlog, but a met window still shows what a pod did
        capacity = learn_capacity(capacity, window, prior, down=all(w[6] for w in window))
        learned_at = now
    total = sum(w[5] for w in work)
    attainment = sum(w[4] for w in work) / total if total > 0 else None

    # 3. need from demand
    start = _measured_start(state, fleet, prior)
    read_over = win.panic if demand.panic else win.demand
    spread = demand.work * read_over / (read_over + objective)  # a window's work, done by objective after it
    pods_worth = spread * (1 + HEADROOM) / capacity
    need = max(0, math.ceil(pods_worth - _EPS))
    why = (f"demand {demand.requests:.2f} req/s{f' (last {win.panic:g}s)' if demand.panic else ''} "
           f"({demand.prompt_tokens:.0f} prompt + "
           f"{demand.generation_tokens:.0f} generated tokens/s) / {capacity:.0f} tokens/s per pod "
           f"-> {need}")
    if win.tolerance and current_replicas > 0 and need != current_replicas \
            and abs(pods_worth / current_replicas - 1) <= win.tolerance:
        need, why = current_replicas, why + f"; within ±{win.tolerance:g} of {current_replicas}: {current_replicas}"

    # 4. backlog plan
    waiting = sum(s.num_requests_waiting for s in samples) + (gateway.waiting if gateway else 0.0)
    backlog = waiting * demand.request_tokens
    pods = max(current_replicas, need, 1)
    extra, took = plan_backlog(backlog, spread, max(capacity, prior.drain_rate), fleet, pods, start,
                               spec.max_replicas, max(DRAIN_SECONDS, objective))
    if backlog > 0:
        why += (f"; backlog {waiting:.0f} requests drains in {took:.0f}s" if extra == 0
                else f"; backlog {waiting:.0f} requests: +{extra} to drain it by {took:.0f}s")
    need = max(need, (pods + extra) if extra else need)

    # 5. guards
    kv_total = sum(s.kv_cache_usage_perc for s in samples) / len(samples) * fleet.ready if samples else 0.0
    kv_need = math.ceil(kv_total / spec.target_kv_cache_utilization - _EPS) if samples else 0
    if kv_need > need:
        need, why = kv_need, why + f"; KV cache {kv_total:.2f} pods' worth -> {kv_need}"
    queue_per_pod = sum(s.num_requests_waiting for s in samples) / len(samples) if samples else 0.0
    guarded = (samples and (queue_per_pod > spec.target_queue_depth
                            or kv_total / len(samples) > spec.target_kv_cache_utilization))

    # 6. scale-down weighs the start time
    need = spec.clamp(max(need, 1))
    hold = HOLD_STARTS * start if win.hold is None else win.hold
    # a fresh state has measured no demand yet (it reads 0): the pods running count as needed now
    before = state.needs if state.time is not None else ((now, current_replicas),)
    needs = tuple(n for n in before if n[0] > now - hold - _EPS) + ((now, need),)
    desired = need
    if need < current_replicas:
        held = max(n for _, n in needs)
        if guarded:
            desired, why = current_replicas, why + (f"; no scale-down while {queue_per_pod:.1f} requests "
                                                   f"wait per pod or the KV cache is above target")
        elif held > need:
            desired = min(current_replicas, held)
            why += (f"; keeps {desired}: needed within {hold:.0f}s "
                    + (f"({HOLD_STARTS:g} starts of {start:.0f}s)" if win.hold is None else "(scaleDownDelaySeconds)"))

    # 7. zero
    held_now = waiting + (gateway.in_flight or 0.0 if gateway else 0.0) + sum(
        s.num_requests_running for s in samples)
    busy = held_now > 0 or (step is not None and step.arrivals > 0)
    last_active = now if state.last_active is None or busy else state.last_active
    idle = (gateway is not None and gateway.complete and len(samples) >= fleet.ready and not busy)
    if spec.min_replicas == 0 and current_replicas == 0:
        if gateway is not None and gateway.waiting > 0:
            desired = spec.clamp(max(desired, 1))
            why = f"scaling from zero: {gateway.waiting:g} requests waiting in the gateway; " + why
        else:
            desired, why = 0, f"scaled to zero after {spec.scale_to_zero_after_seconds}s idle"
    elif spec.min_replicas == 0 and idle and now - last_active >= spec.scale_to_zero_after_seconds:
        desired, why = 0, (f"scaled to zero after {spec.scale_to_zero_after_seconds}s idle (no request "
                           f"ran, waited or arrived)")
    desired = max(0, min(desired, spec.max_replicas))
    verb = f"scaling {current_replicas} -> {desired}" if desired != current_replicas else f"holding {desired}"
    reason = f"{verb}: {why}"
    new_state = replace(
        state, time=now, totals=found[1] if found else None, source=found[0] if found else None,
        pods=readings, intervals=tuple(intervals), work=tuple(work), capacity=capacity,
        learned_at=learned_at, start_seconds=start if (fleet.start_seconds or state.start_seconds) else None,
        needs=needs, last_active=last_active)
    details = {"policy": "capacity", "demandRequestsPerSecond": round(demand.requests, 3),
               "demandPromptTokensPerSecond": round(demand.prompt_tokens, 1),
               "demandGenerationTokensPerSecond": round(demand.generation_tokens, 1),
               "capacityTokensPerSecond": round(capacity, 1), "startSeconds": round(start, 1),
               "podsStarting": len(fleet.starting_ages), "desiredReplicas": desired, "reason": reason}
    return Decision(desired, current_replicas, reason, new_state, queue_depth=waiting if samples or gateway else None,
                    kv_cache_utilization=kv_total / len(samples) if samples else None,
                    recommendation=need, attainment=attainment, details=details)
