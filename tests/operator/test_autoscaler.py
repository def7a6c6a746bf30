"""The autoscaling policy driven by synthetic sample sequences on a synthetic clock."""
from __future__ import annotations

import json
import math
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

from slipstream.api_types.autoscaling import AutoscalingSpec
from slipstream.api_types.load import GatewayLoad, PodLoad
from slipstream.operator.autoscaler import AutoscalerState, Decision, append_scaling_history, decide, \
    with_windows

TICK = 2.0


def samples(n: int, waiting_total: float, kv_total: float = 0.0, now: float = 0.0) -> list[PodLoad]:
    """n pods sharing the load evenly; kv_total in pods' worth (2 pods at 0.9 are 1.8)."""
    return [PodLoad(f"pod-{i}", now, waiting_total / n, 1.0, min(1.0, kv_total / n)) for i in range(n)]


@dataclass
class Cluster:
    """Pods that become ready `startup` seconds after the policy asks for them.

    load(t) -> (waiting requests in all, KV-cache use in pods' worth), independent of the
    pod count, so a test states what the policy should do for a known demand.
    """

    spec: AutoscalingSpec
    replicas: int
    startup: float = 0.0
    created: list[float] = field(default_factory=list)
    state: AutoscalerState = field(default_factory=AutoscalerState)
    log: list[tuple[float, Decision]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.created = [-math.inf] * self.replicas

    def run(self, load: Callable[[float], tuple[float, float]], start: float, end: float) -> None:
        t = start
        while t < end:
            ready = sum(1 for c in self.created if c + self.startup <= t)
            waiting, kv = load(t)
            d = decide(self.spec, self.state, samples(ready, waiting, kv, t) if ready else [], t,
                       self.replicas, ready, len(self.created) - ready)
            self.state, self.replicas = d.state, d.desired_replicas
            self.created = (self.created + [t] * d.desired_replicas)[:d.desired_replicas]
            self.log.append((t, d))
            t += TICK

    def replicas_at(self, t: float) -> int:
        return [d.desired_replicas for when, d in self.log if when <= t][-1]

    def changes(self) -> list[tuple[float, int, int]]:
        return [(t, d.current_replicas, d.desired_replicas) for t, d in self.log if d.scaled]


def spec(**fields) -> AutoscalingSpec:
    return AutoscalingSpec(**{"enabled": True, "max_replicas": 20, "target_queue_depth": 4.0,
                              "target_kv_cache_utilization": 0.8, **fields})


def test_step_up_reaches_the_needed_count_within_a_stable_window_and_no_more():
    c = Cluster(spec(panic_threshold=100.0), replicas=1, startup=20.0)  # panic off: stable path
    c.run(lambda t: (16.0, 0.0) if t >= 100 else (4.0, 0.0), 0, 400)

    assert c.replicas_at(98) == 1
    assert c.replicas_at(100 + 60) == 4  # 16 waiting / 4 per pod
    assert max(d.desired_replicas for _, d in c.log) == 4
    assert not any(d.panicking for _, d in c.log)


def test_ramp_is_followed_upward_without_a_scale_down_or_overshoot():
    c = Cluster(spec(), replicas=1, startup=10.0)
    c.run(lambda t: (4.0 + 36.0 * min(t, 180.0) / 180.0, 0.0), 0, 300)  # 1 -> 10 pods' worth

    counts = [d.desired_replicas for _, d in c.log]
    assert counts == sorted(counts), "scaled down during a ramp"
    assert counts[-1] == 10
    assert max(counts) == 10


def test_spike_enters_panic_scales_up_at_once_and_holds_while_panicking():
    c = Cluster(spec(), replicas=2, startup=30.0)
    c.run(lambda t: (80.0 if 100 <= t < 110 else 8.0, 0.0), 0, 100)
    assert c.replicas == 2 and not c.log[-1][1].panicking

    c.run(lambda t: (80.0 if 100 <= t < 110 else 8.0, 0.0), 100, 102)
    first = c.log[-1][1]
    # panic window mean (8 + 8 + 80) / 3 = 32 waiting -> 8 pods >= 2.0 x 2; +4 at most per tick
    assert first.panicking and first.desired_replicas == 6 and "panic" in first.reason
    stable_only = decide(spec(panic_threshold=100.0), c.log[-2][1].state, samples(2, 80.0, now=100), 100, 2, 2)
    assert stable_only.desired_replicas < first.desired_replicas

    c.run(lambda t: (80.0 if 100 <= t < 110 else 8.0, 0.0), 102, 300)
    peak = max(d.desired_replicas for _, d in c.log)
    last_trigger = max(d.state.panic_time for _, d in c.log if d.panicking)
    assert all(d.desired_replicas == peak for t, d in c.log if 110 <= t <= last_trigger + 58)
    assert not c.log[-1][1].panicking
    assert c.replicas == peak, "scaled down before the scale-down delay"


def test_panic_alone_blocks_scale_down_until_a_stable_window_after_the_last_trigger():
    c = Cluster(spec(scale_down_delay_seconds=0), replicas=2)
    c.run(lambda t: (24.0 if 20 <= t < 24 else 8.0, 0.0), 0, 200)  # 6 pods' worth for two ticks

    assert c.replicas_at(22) == 5  # panic window mean (8 + 24 + 24) / 3 waiting
    last_trigger = max(d.state.panic_time for _, d in c.log if d.panicking)
    held = [d.desired_replicas for t, d in c.log if 22 <= t < last_trigger + 60]
    assert set(held) == {5} and len(held) >= 25
    assert c.replicas == 2


def test_panic_lasts_a_stable_window_after_the_condition_last_held():
    # maxReplicas 3 keeps 28 waiting (7 pods' worth) over 2x capacity from t=20 until the
    # tick at t=60, whose panic window still averages (28 + 28 + 8) / 3 -> 6 pods
    c = Cluster(spec(max_replicas=3, scale_down_delay_seconds=0), replicas=2)
    c.run(lambda t: (28.0 if 20 <= t < 60 else 8.0, 0.0), 0, 200)

    assert c.replicas_at(20) == 3
    assert all(d.panicking and d.desired_replicas == 3 for t, d in c.log if 20 <= t < 120)
    assert not dict(c.log)[120.0].panicking
    assert c.replicas == 2


def test_reasons_say_durations_not_clock_readings():
    """The operator's clock is epoch seconds: a reason that printed it read `at 1.79608e+09`."""
    start = 1_796_080_000.0
    c = Cluster(spec(max_replicas=3, scale_down_delay_seconds=0), replicas=2)
    c.run(lambda t: (28.0 if t < start + 6 else 8.0, 0.0), start, start + 30)
    held = [d.reason for t, d in c.log if t >= start + 10 and d.panicking]
    assert held and "after the last trigger 4s ago" in held[0]  # last trigger at +6, tick +10
    for _, d in c.log:
        assert "e+09" not in d.reason and "1796" not in d.reason, d.reason


def test_noise_within_the_tolerance_band_never_rescales():
    rng = random.Random(6)
    c = Cluster(spec(), replicas=3)
    c.run(lambda t: (12.0 * rng.uniform(0.92, 1.08), 2.4 * rng.uniform(0.92, 1.08)), 0, 1200)
    assert c.changes() == []


def test_slow_decline_scales_down_only_after_the_delay_and_at_most_halving():
    c = Cluster(spec(), replicas=8)
    c.run(lambda t: (32.0 - 24.0 * min(max(t - 60.0, 0.0), 120.0) / 120.0, 0.0), 0, 1200)

    first_lower = min(t for t, d in c.log if d.recommendation < 8)
    first_down = min(t for t, old, new in c.changes() if new < old)
    assert first_down >= first_lower + 300 - TICK
    assert all(new >= math.ceil(old / 2) for _, old, new in c.changes())
    assert c.replicas == 2  # 8 waiting / 4 per pod


def test_scale_down_to_zero_load_halves_per_tick_to_min_replicas():
    s = spec(scale_down_delay_seconds=0, min_replicas=2)
    c = Cluster(s, replicas=16)
    c.run(lambda t: (0.0, 0.0), 0, 20)
    assert [new for _, _, new in c.changes()] == [8, 4, 2]


def test_a_pod_that_stops_reporting_is_not_taken_for_lost_load():
    s = spec(scale_down_delay_seconds=0)
    state = AutoscalerState()
    for tick in range(60):
        now = tick * TICK
        reporting = samples(4, 16.0, now=now)[: 3 if tick >= 10 else 4]  # pod-3 goes silent
        d = decide(s, state, reporting, now, 4, 4)
        state = d.state
        assert d.desired_replicas == 4, d.reason
    assert d.queue_depth == 12.0  # what the three reporting pods hold


def test_no_metrics_at_all_holds_the_count():
    s = spec(scale_down_delay_seconds=0)
    d = decide(s, AutoscalerState(), samples(4, 16.0), 0.0, 4, 4)
    for tick in range(1, 100):
        d = decide(s, d.state, [], tick * TICK, 4, 4)
        assert d.desired_replicas == 4
    assert "no metrics" in d.reason and d.queue_depth is None and d.kv_cache_utilization is None


def test_starting_pods_count_as_capacity_in_flight():
    # 2 ready, 6 loading the model, 32 waiting: 8 pods' worth is already on its way
    d = decide(spec(), AutoscalerState(), samples(2, 32.0), 0.0, 8, 2, 6)
    assert not d.panicking and d.desired_replicas == 8
    # 17 waiting is within 10% of 4 pods x 4: no fifth pod while two of the four start
    d = decide(spec(), AutoscalerState(), samples(2, 17.0), 0.0, 4, 2, 2)
    assert d.desired_replicas == 4


def test_kv_cache_signal_scales_when_the_queue_is_empty():
    d = decide(spec(), AutoscalerState(), samples(2, 0.0, kv_total=2.0), 0.0, 2, 2)
    assert d.desired_replicas == 3  # 2 x 1.0 / 0.8 = 2.5 pods
    assert d.kv_cache_utilization == 1.0 and d.queue_depth == 0.0


def test_kv_cache_spike_alone_enters_panic():
    s = spec(target_kv_cache_utilization=0.25)
    state = AutoscalerState()
    for tick in range(30):
        state = decide(s, state, samples(2, 0.0, kv_total=0.5), tick * TICK, 2, 2).state
    d = decide(s, state, samples(2, 0.0, kv_total=2.0), 60.0, 2, 2)
    # panic window mean (0.5 + 0.5 + 2.0) / 3 = 1.0 -> 4 pods at 0.25, 2x the 2 running
    assert d.panicking and d.desired_replicas == 4


def test_exact_multiples_of_the_target_do_not_round_up():
    # 3 x 0.8 sums to 2.4000000000000004 in floats: still 3 pods, not 4
    pods = [PodLoad(f"pod-{i}", 0.0, 0.0, 1.0, 0.8) for i in range(3)]
    d = decide(spec(), AutoscalerState(), pods, 0.0, 5, 3, 2)
    assert d.recommendation == 3


def test_scale_up_is_limited_to_doubling_or_plus_four_per_tick():
    assert decide(spec(max_replicas=100), AutoscalerState(), samples(2, 400.0), 0.0, 2, 2).desired_replicas == 6
    d = decide(spec(max_replicas=100), AutoscalerState(), samples(10, 400.0), 0.0, 10, 10)
    assert d.desired_replicas == 20 and "rate-limited" in d.reason


def test_min_and_max_replicas_bound_the_count():
    assert decide(spec(max_replicas=5), AutoscalerState(), samples(4, 200.0), 0.0, 4, 4).desired_replicas == 5
    c = Cluster(spec(min_replicas=3), replicas=6)
    c.run(lambda t: (0.0, 0.0), 0, 800)
    assert c.replicas == 3
    # maxReplicas lowered under the running count: the bound wins over delay and halving
    assert decide(spec(max_replicas=5), AutoscalerState(), samples(12, 48.0), 0.0, 12, 12).desired_replicas == 5


def test_a_fresh_state_waits_the_full_delay_before_scaling_down():
    c = Cluster(spec(), replicas=8)
    c.run(lambda t: (0.0, 0.0), 0, 400)
    assert c.replicas_at(300 - TICK) == 8
    assert c.replicas_at(300) == 4


def test_state_survives_a_json_round_trip_and_decide_does_not_mutate_it():
    s = spec()
    c = Cluster(s, replicas=2)
    c.run(lambda t: (80.0 if t > 20 else 8.0, 1.0), 0, 40)
    before = c.state.to_dict()

    stored = AutoscalerState.from_dict(json.loads(json.dumps(before)))
    direct = decide(s, c.state, samples(2, 30.0), 40.0, c.replicas, 2)
    revived = decide(s, stored, samples(2, 30.0), 40.0, c.replicas, 2)

    assert stored == c.state and c.state.to_dict() == before
    assert revived == direct
    assert AutoscalerState.from_dict(None) == AutoscalerState()


def test_spec_from_the_crd_dict():
    s = AutoscalingSpec.from_dict({"enabled": True, "minReplicas": 2, "maxReplicas": 9, "targetQueueDepth": 8,
                                   "targetKVCacheUtilization": 0.7, "panicThreshold": 3.0,
                                   "scaleDownDelaySeconds": 120, "tolerance": 0.25, "panicWindowSeconds": None})
    assert (s.enabled, s.min_replicas, s.max_replicas, s.target_queue_depth) == (True, 2, 9, 8)
    assert (s.target_kv_cache_utilization, s.panic_threshold, s.scale_down_delay_seconds) == (0.7, 3.0, 120)
    assert (s.stable_window_seconds, s.panic_window_seconds, s.tolerance) == (None, None, 0.25)  # null: unset
    # unset windows are each policy's; this one's are Knative KPA's and HPA's
    w = with_windows(s)
    assert (w.stable_window_seconds, w.panic_window_seconds, w.panic_threshold, w.scale_down_delay_seconds) \
        == (60, 6, 3.0, 120)
    w = with_windows(AutoscalingSpec(stable_window_seconds=4))
    assert (w.stable_window_seconds, w.panic_window_seconds, w.panic_threshold, w.scale_down_delay_seconds,
            w.tolerance) == (4, 4, 2.0, 300, 0.1)  # the panic window cut to the stable one
    assert with_windows(AutoscalingSpec(tolerance=0.0)).tolerance == 0.0  # 0 is a value, not unset
    assert AutoscalingSpec.from_dict(s.to_dict()) == s
    assert AutoscalingSpec.from_dict(None) == AutoscalingSpec.from_dict({}) == AutoscalingSpec()
    assert not AutoscalingSpec.from_dict({"maxReplicas": 3}).enabled  # the CRD's default


def test_an_unknown_key_is_refused_naming_it_and_the_known_ones():
    with pytest.raises(ValueError) as caught:
        AutoscalingSpec.from_dict({"enabled": True, "targetQueueDepht": 4, "futureKnob": 1})
    assert str(caught.value) == (
        "spec.autoscaling has unknown field(s) futureKnob, targetQueueDepht; known: enabled, policy, objectives, "
        "minReplicas, "
        "maxReplicas, targetQueueDepth, targetKVCacheUtilization, stableWindowSeconds, panicWindowSeconds, "
        "panicThreshold, scaleDownDelaySeconds, scaleToZeroAfterSeconds, tolerance")
    with pytest.raises(ValueError, match=r"spec.autoscaling must be an object, got \[1\]"):
        AutoscalingSpec.from_dict([1])


def test_the_spec_clamps_replicas_into_min_and_max():
    s = AutoscalingSpec(min_replicas=2, max_replicas=5)
    assert [s.clamp(n) for n in (0, 2, 3, 5, 9)] == [2, 2, 3, 5, 5]


def test_replica_counts_have_one_clamp():
    """status.py and autoscaler.py each had their own; every caller now uses AutoscalingSpec.clamp."""
    src = Path(__file__).resolve().parents[2] / "src" / "slipstream"
    defined = [(p.relative_to(src).as_posix(), m.group(0))
               for p in sorted([*src.glob("operator/*.py"), *src.glob("api_types/*.py")])
               for m in re.finditer(r"def _?clamp\w*\(\w*", p.read_text())]
    assert defined == [("api_types/autoscaling.py", "def clamp(self")]


@pytest.mark.parametrize("bad, message", [
    ({"minReplicas": -1}, r"spec.autoscaling.minReplicas must be an integer ≥ 0 \(0: scale to zero\), got -1"),
    ({"maxReplicas": 0}, r"spec.autoscaling.maxReplicas must be an integer ≥ 1, got 0"),
    ({"scaleToZeroAfterSeconds": -1}, r"scaleToZeroAfterSeconds must be an integer ≥ 0, got -1"),
    ({"scaleToZeroAfterSeconds": 1.5}, r"scaleToZeroAfterSeconds must be an integer ≥ 0, got 1.5"),
    ({"minReplicas": 5, "maxReplicas": 3}, r"minReplicas \(5\) must be ≤ maxReplicas \(3\)"),
    ({"maxReplicas": True}, "maxReplicas must be an integer"),
    ({"targetQueueDepth": 0}, "targetQueueDepth must be a number > 0"),
    ({"targetQueueDepth": "5"}, "targetQueueDepth must be a number > 0 .*got '5'"),
    ({"targetKVCacheUtilization": 1.5}, r"targetKVCacheUtilization must be a number in \(0, 1\]"),
    ({"panicWindowSeconds": 90}, r"panicWindowSeconds \(90\) must be ≤ stableWindowSeconds \(60, its default\)"),
    ({"panicWindowSeconds": 40, "stableWindowSeconds": 30},
     r"panicWindowSeconds \(40\) must be ≤ stableWindowSeconds \(30\)"),
    ({"panicThreshold": 0.5}, "panicThreshold must be a number ≥ 1"),
    ({"enabled": "yes"}, "enabled must be true or false"),
    ({"tolerance": 1}, r"tolerance must be a number in \[0, 1\)"),
    ({"tolerance": -0.1}, r"tolerance must be a number in \[0, 1\)"),
    ({"stableWindowSeconds": 60.5}, r"spec.autoscaling.stableWindowSeconds must be an integer ≥ 1, got 60.5"),
    ({"panicWindowSeconds": 0}, r"panicWindowSeconds must be an integer ≥ 1, got 0"),
    ({"scaleDownDelaySeconds": -1}, r"scaleDownDelaySeconds must be an integer ≥ 0, got -1"),
])
def test_spec_rejects_out_of_range_values_naming_the_field(bad, message):
    with pytest.raises(ValueError, match=message):
        AutoscalingSpec.from_dict(bad)


def test_disabled_autoscaling_holds_the_count():
    d = decide(AutoscalingSpec(enabled=False), AutoscalerState(), samples(2, 400.0), 0.0, 2, 2)
    assert d.desired_replicas == 2 and not d.scaled and d.reason == "autoscaling disabled"


def test_scaling_history_keeps_the_newest_entries():
    history: list[dict] = []
    for n in range(12):
        d = Decision(n + 1, n, f"step {n}", AutoscalerState())
        new = append_scaling_history(history, d, time=f"t{n}", limit=10)
        assert len(history) == min(n, 10)  # the input list is left alone
        history = new
    assert len(history) == 10
    assert history[0] == {"time": "t2", "fromReplicas": 2, "toReplicas": 3, "reason": "step 2"}
    assert history[-1]["time"] == "t11"


# --- scale to zero and from zero -------------------------------------------------------------

def idle(n: int, now: float) -> list[PodLoad]:
    """n ready pods with nothing running or waiting."""
    return [PodLoad(f"pod-{i}", now, 0.0, 0.0, 0.0) for i in range(n)]


def busy(n: int, now: float, running: float = 1.0) -> list[PodLoad]:
    return [PodLoad(f"pod-{i}", now, 0.0, running / n, 0.1) for i in range(n)]


def zero_spec(**fields) -> AutoscalingSpec:
    return spec(**{"min_replicas": 0, "max_replicas": 3, "target_queue_depth": 5.0,
                   "scale_to_zero_after_seconds": 30, **fields})


QUIET = GatewayLoad(waiting=0.0, in_flight=0.0)


def quiet_pods(t: float, n: int) -> list[PodLoad]:
    return idle(n, t)


def test_min_replicas_zero_and_the_idle_delay_parse_from_the_crd_dict():
    s = AutoscalingSpec.from_dict({"enabled": True, "minReplicas": 0, "scaleToZeroAfterSeconds": 45})
    assert (s.min_replicas, s.scale_to_zero_after_seconds) == (0, 45)
    assert AutoscalingSpec().scale_to_zero_after_seconds == 300
    assert AutoscalingSpec.from_dict(s.to_dict()) == s
    assert [s.clamp(n) for n in (0, 2, 9)] == [0, 2, 4]


def test_at_zero_the_first_request_waiting_in_the_gateway_scales_to_one_at_the_same_tick():
    s = zero_spec()
    state = AutoscalerState()
    for tick in range(30):  # a minute at zero: nothing waits, the count holds
        d = decide(s, state, [], tick * TICK, 0, 0, 0, QUIET)
        state = d.state
        assert d.desired_replicas == 0 and not d.scaled
    assert d.reason == ("holding 0: scaled to zero after 30s idle; no request waiting in the gateway")

    d = decide(s, state, [], 60.0, 0, 0, 0, GatewayLoad(waiting=1.0, in_flight=0.0))
    assert d.desired_replicas == 1 and d.queue_depth == 1.0
    assert d.reason == "scaling from zero: 1 request waiting in the gateway; 0 -> 1"


def test_from_zero_the_gateways_backlog_sizes_the_first_step():
    d = decide(zero_spec(), AutoscalerState(), [], 0.0, 0, 0, 0, GatewayLoad(waiting=50.0))
    assert d.desired_replicas == 3  # 50 / 5 per pod = 10 pods, rate limit 4, maxReplicas 3
    assert d.reason.startswith("scaling from zero: 50 requests waiting in the gateway")
    d = decide(zero_spec(max_replicas=20), AutoscalerState(), [], 0.0, 0, 0, 0, GatewayLoad(waiting=50.0))
    assert d.desired_replicas == 4


def test_at_zero_without_a_gateway_reading_the_count_holds():
    d = decide(zero_spec(), AutoscalerState(), [], 0.0, 0, 0, 0, None)
    assert d.desired_replicas == 0 and "no gateway answered" in d.reason


def test_requests_waiting_in_the_gateway_add_to_the_pods_queue():
    # 2 idle pods and 16 requests the gateway could not place: 16 / 4 per pod = 4 pods
    d = decide(spec(), AutoscalerState(), idle(2, 0.0), 0.0, 2, 2, 0, GatewayLoad(waiting=16.0))
    assert d.desired_replicas == 4 and d.queue_depth == 16.0


def run_quiet_after(s: AutoscalingSpec, last_request: float, end: float,
                    gateway: Callable[[float], GatewayLoad | None] = lambda t: QUIET,
                    pods: Callable[[float, int], list[PodLoad]] = quiet_pods) -> list[tuple[float, Decision]]:
    """One ready pod serving a request until ``last_request``, then idle; ticks every 2 s."""
    state, replicas, log = AutoscalerState(), 1, []
    t = 0.0
    while t <= end:
        samples = busy(1, t) if t <= last_request else pods(t, replicas)
        d = decide(s, state, samples if replicas else [], t, replicas, replicas, 0, gateway(t))
        state, replicas = d.state, d.desired_replicas
        log.append((t, d))
        t += TICK
    return log


def test_scale_to_zero_comes_exactly_the_idle_delay_after_the_last_request():
    log = run_quiet_after(zero_spec(scale_down_delay_seconds=300), last_request=10.0, end=100.0)
    [(when, down)] = [(t, d) for t, d in log if d.scaled]
    assert when == 10.0 + 30.0 and (down.current_replicas, down.desired_replicas) == (1, 0)
    assert down.reason == ("scaled to zero after 30s idle (no request ran or waited in the pods or the "
                           "gateway); 1 -> 0")
    assert all(d.desired_replicas == 0 for t, d in log if t > when)


def test_scale_to_zero_drops_every_pod_at_once_not_by_halves():
    s = zero_spec(max_replicas=8, scale_down_delay_seconds=0)
    state = AutoscalerState(last_active=0.0)
    d = decide(s, state, idle(8, 30.0), 30.0, 8, 8, 0, QUIET)
    assert d.desired_replicas == 0


def test_no_scale_to_zero_while_anything_is_in_flight_or_unseen():
    s = zero_spec()
    cases = {
        "the gateway has a request on a pod": (lambda t: GatewayLoad(0.0, in_flight=1.0), quiet_pods),
        "the gateway holds a request": (lambda t: GatewayLoad(1.0, in_flight=0.0), quiet_pods),
        "a pod runs a request": (lambda t: QUIET, lambda t, n: busy(n, t)),
        "a ready pod did not answer": (lambda t: QUIET, lambda t, n: []),
        "a gateway pod did not answer": (lambda t: GatewayLoad(0.0, 0.0, complete=False), quiet_pods),
        "no gateway": (lambda t: None, quiet_pods),
    }
    for what, (gateway, pods) in cases.items():
        log = run_quiet_after(s, last_request=10.0, end=200.0, gateway=gateway, pods=pods)
        assert min(d.desired_replicas for _, d in log) == 1, what


def test_a_request_in_the_idle_delay_starts_it_over():
    s = zero_spec()
    log = run_quiet_after(s, last_request=10.0, end=100.0,
                          gateway=lambda t: GatewayLoad(0.0, in_flight=1.0 if t == 30.0 else 0.0))
    [(when, _)] = [(t, d) for t, d in log if d.scaled]
    assert when == 30.0 + 30.0


def test_min_replicas_one_never_scales_to_zero_and_an_idle_gateway_changes_nothing():
    s = spec(scale_to_zero_after_seconds=0, scale_down_delay_seconds=20)
    with_gateway, without = [], []
    for gateway, log in ((QUIET, with_gateway), (None, without)):
        state, replicas = AutoscalerState(), 4
        for tick in range(100):
            t = tick * TICK
            load = 24.0 if 20 <= t < 40 else 0.0
            d = decide(s, state, samples(replicas, load, now=t), t, replicas, replicas, 0, gateway)
            state, replicas = d.state, d.desired_replicas
            log.append((d.desired_replicas, d.reason, d.queue_depth))
    assert with_gateway == without
    assert min(n for n, _, _ in with_gateway) == 1 and with_gateway[-1][0] == 1


def test_at_zero_a_raised_min_replicas_brings_the_count_up():
    d = decide(spec(min_replicas=2), AutoscalerState(), [], 0.0, 0, 0, 0, QUIET)
    assert d.desired_replicas == 2


def test_a_state_persisted_before_scale_to_zero_loads_and_starts_the_idle_clock_now():
    old = {"observations": [[100.0, 0.0, 0.0]], "recommendations": [[100.0, 1]], "trackingSince": 50.0,
           "panicTime": None, "lastScaleTime": 40.0}
    state = AutoscalerState.from_dict(old)
    assert state.last_active is None and state.tracking_since == 50.0
    d = decide(zero_spec(), state, idle(1, 102.0), 102.0, 1, 1, 0, QUIET)
    assert d.desired_replicas == 1 and d.state.last_active == 102.0  # waits the full delay from here
    assert AutoscalerState.from_dict(json.loads(json.dumps(d.state.to_dict()))) == d.state
    later = decide(zero_spec(), d.state, idle(1, 132.0), 132.0, 1, 1, 0, QUIET)
    assert later.desired_replicas == 0
