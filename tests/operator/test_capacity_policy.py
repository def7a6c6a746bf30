"""The capacity policy rule by rule, on synthetic counters and a synthetic clock."""
from __future__ import annotations

import json
import math

import pytest

from slipstream.api_types.autoscaling import AutoscalingSpec
from slipstream.api_types.load import GatewayLoad, PodLoad
from slipstream.operator import capacity_policy as cp
from slipstream.operator.capacity_policy import CapacityPrior, CapacityState, decide, drain_seconds, \
    learn_capacity, plan_backlog
from slipstream.operator.demand import Totals, interval, met_within
from slipstream.operator.fleet import Fleet, fleet_from_pods
from slipstream.operator.policy import Tick, decide as policy_decide, load_state

PRIOR = CapacityPrior(tokens_per_second=1000.0, generation_weight=2.0, start_seconds=60.0,
                      request_tokens=100.0, drain_tokens_per_second=2000.0)


def spec(**fields) -> AutoscalingSpec:
    return AutoscalingSpec(**{"enabled": True, "max_replicas": 10, **fields})


def gateway(requests: float, held: float = 0.0, waiting: float = 0.0) -> GatewayLoad:
    """A gateway that answered ``requests`` of 100 prompt tokens each, none generated."""
    return GatewayLoad(waiting=waiting, in_flight=held, requests_total=requests,
                       prompt_tokens_total=100.0 * requests, generation_tokens_total=0.0)


def run_rate(rate: float, seconds: float, fleet: Fleet, current: int, s: AutoscalingSpec | None = None,
             state: CapacityState | None = None, start: float = 0.0):
    """Tick every 2 s for ``seconds`` with ``rate`` requests/s of 100 tokens; the last decision."""
    state = state or CapacityState()
    decision = None
    for k in range(int(seconds / 2) + 1):
        now = start + 2.0 * k
        decision = decide(s or spec(), state, [], now, current, fleet, gateway(rate * now), PRIOR)
        state = decision.state
    return decision


def test_need_is_demand_over_capacity_with_headroom_spread_over_the_objective():
    # 31 req/s x 100 tokens = 3,100 tokens/s; a minute's arrivals may finish up to the objective
    # (2 s) after it: x 60 / 62, x 1.3 headroom / 1,000 per pod -> 4 pods (5 without the spread)
    d = run_rate(31.0, 60, Fleet(4), 4)
    assert d.recommendation == math.ceil(3100 * 60 / 62 * (1 + cp.HEADROOM) / 1000) == 4
    assert math.ceil(3100 * (1 + cp.HEADROOM) / 1000) == 5
    assert d.details["demandRequestsPerSecond"] == pytest.approx(31.0)
    assert d.details["capacityTokensPerSecond"] == 1000.0


def test_a_looser_objective_needs_fewer_pods_for_the_same_demand():
    # 40 req/s of 100 tokens: 60 s of it may finish within 62 s at a 2 s objective (6 pods), within
    # 120 s at a 60 s one (3 pods), the slack a looser objective gives
    needs = {}
    for objective in (2, 60):
        s = spec(objectives={"ttftP90Seconds": objective})
        needs[objective] = run_rate(40.0, 60, Fleet(4), 4, s).recommendation
    assert needs == {2: math.ceil(4000 * 60 / 62 * (1 + cp.HEADROOM) / 1000),
                     60: math.ceil(4000 * 60 / 120 * (1 + cp.HEADROOM) / 1000)} == {2: 6, 60: 3}


def test_a_backlog_may_take_the_objective_to_drain_when_that_is_longer_than_drain_seconds():
    # 1,000,000 tokens on 2 pods draining 2,000 tokens/s against 1,000 arriving: done by 90 s
    # needs 10 pods; by 60 + 120 s, 6 (the backlog left at 60 s, 820,000, over 120 s: 6,833/s)
    assert plan_backlog(1_000_000, 1000, 2000, Fleet(2), 2, 60.0, 10)[0] == 8
    extra, took = plan_backlog(1_000_000, 1000, 2000, Fleet(2), 2, 60.0, 10, drain_for=120.0)
    assert extra == 2 and took <= 180


def test_a_step_up_reads_at_the_short_windows_rate_until_the_long_window_catches_up():
    # Knative's panic mode: 10 req/s for 60 s, then 40 req/s, ticks of 2 s. The first tick's
    # short-window rate is under twice the long one's; from the next tick on the short window
    # is read (the long one alone would read 12-15 req/s, and ask for pods a minute late), and
    # once it holds only the step, it reads 40.
    state = run_rate(10.0, 60, Fleet(1), 1).state
    seen, reasons = [], []
    ticks = [60.0 + 2 * k for k in range(1, int(cp.PANIC_SECONDS / 2) + 1)]
    for now in ticks:
        d = decide(spec(), state, [], now, 1, Fleet(1), gateway(600 + 40.0 * (now - 60)), PRIOR)
        state = d.state
        seen.append(d.details["demandRequestsPerSecond"])
        reasons.append(d.reason)
    long_first = (600 - 20 + 80) / 60  # the interval ending at 0 s is outside the window
    assert seen[0] == pytest.approx(long_first) and f"(last {cp.PANIC_SECONDS:g}s)" not in reasons[0]
    assert all(f"(last {cp.PANIC_SECONDS:g}s)" in r for r in reasons[1:])
    assert seen[1:-1] == sorted(seen[1:-1]) and seen[1] > 2 * long_first and seen[-1] == pytest.approx(40.0)
    window = cp.PANIC_SECONDS
    assert d.recommendation == math.ceil(4000 * window / (window + 2) * (1 + cp.HEADROOM) / 1000)
    # long after the step the 60 s window holds only it, and is read
    d = run_rate(40.0, 120, Fleet(5), 5, state=state, start=ticks[-1] + 2)
    assert d.details["demandRequestsPerSecond"] == pytest.approx(40.0) and "(last" not in d.reason


def test_a_rise_under_the_panic_ratio_is_read_over_the_long_window():
    state = run_rate(10.0, 60, Fleet(1), 1).state
    for now in (62.0, 64.0, 66.0, 68.0, 70.0):  # 10 -> 15 req/s: the short rate reaches 15, under 2 x 10.x
        d = decide(spec(), state, [], now, 1, Fleet(1), gateway(600 + 15.0 * (now - 60)), PRIOR)
        state = d.state
    assert d.details["demandRequestsPerSecond"] == pytest.approx((50 * 10 + 10 * 15) / 60, abs=1e-3)  # rounded
    assert "(last" not in d.reason


def test_an_interval_longer_than_a_window_counts_for_its_part_inside_it():
    # an operator restart: one 60 s interval at 1 req/s, then 2 s at 20 req/s. Whole, the long
    # interval made the 8 s window read (60 + 40) / 62 = 1.6 req/s; cut, (6 + 40) / 8 = 5.75,
    # against (58 + 40) / 60 over the 60 s window: a step up, read as one
    state = CapacityState()
    for now, total in ((0.0, 0.0), (60.0, 60.0), (62.0, 100.0)):
        d = decide(spec(), state, [], now, 1, Fleet(1), gateway(total), PRIOR)
        state = d.state
    assert d.details["demandRequestsPerSecond"] == pytest.approx(46 / 8, abs=1e-3)
    assert f"(last {cp.PANIC_SECONDS:g}s)" in d.reason


def test_arrivals_are_finished_requests_plus_the_change_in_held_ones():
    before, after = Totals(10, 1000, 0, 5, 10), Totals(14, 1400, 0, 11, 13)
    step = interval(before, after, 2.0)
    assert (step.arrivals, step.finished, step.sized) == (4 + 6, 4, 3)
    assert interval(after, before, 2.0) is None  # a counter went down: a restart, not demand


def test_refused_requests_arrive_but_add_no_tokens_to_the_size_of_a_request():
    # Each 2 s the gateway answers 20 requests of 100 prompt tokens and refuses 20 (429): 20
    # req/s arrive, of 100 tokens each as far as anyone knows; over every code 50 (1,000 tokens/s).
    state = CapacityState()
    for k in range(31):
        now = 2.0 * k
        gw = GatewayLoad(waiting=0.0, in_flight=0.0, requests_total=40.0 * k, prompt_tokens_total=2000.0 * k,
                         generation_tokens_total=0.0, answered_total=20.0 * k)
        d = decide(spec(), state, [], now, 2, Fleet(2), gw, PRIOR)
        state = d.state
    assert d.details["demandRequestsPerSecond"] == pytest.approx(20.0)
    assert d.details["demandPromptTokensPerSecond"] == pytest.approx(2000.0)


def test_a_state_from_before_the_sized_count_keeps_its_learning_and_skips_one_tick():
    old = CapacityState(time=10.0, totals=Totals(10, 1000, 0, 0, 10), source="gateway", capacity=1234.0).to_dict()
    old["totals"] = old["totals"][:4]  # what an operator before the sized count wrote
    state = CapacityState.from_dict(old)
    assert state.totals is None and state.capacity == 1234.0 and state.time == 10.0


def pod(name: str, requests: float) -> PodLoad:
    """A model pod that has answered ``requests`` of 100 prompt tokens each."""
    return PodLoad(name, 0.0, 0, 0, 0.1, prompt_tokens_total=100.0 * requests, generation_tokens_total=0.0,
                   requests_total=requests)


def test_a_pod_or_gateway_pod_missing_one_scrape_is_not_read_as_its_lifetime_of_demand():
    """Two long-lived pods at 1 req/s each; one scrape of one of them (or of one of two gateway
    pods) times out. The sum drops and comes back: neither step is an interval."""
    for reading in ("pods", "gateway"):
        state = CapacityState()
        for k in range(60):
            now, answered = 2.0 * k, 1e5 + 2.0 * k
            if reading == "pods":
                samples, gw = [pod("a", answered), pod("b", answered)][k == 35:], None
            else:
                samples, gw = [], gateway(2 * answered) if k != 35 else GatewayLoad(
                    0.0, 0.0, complete=False, requests_total=answered, prompt_tokens_total=100.0 * answered,
                    generation_tokens_total=0.0)
            d = decide(spec(), state, samples, now, 2, Fleet(2), gw, PRIOR)
            state = d.state
            assert d.details["demandRequestsPerSecond"] == pytest.approx(2.0 if k else 0.0), (reading, k)
            assert d.desired_replicas == 2, (reading, k)


def test_without_a_gateway_a_request_in_flight_adds_no_tokens_to_the_size_of_a_request():
    """A pod counts a prompt when it first schedules the request (and its TTFT when the first
    token comes) but the request when it finishes. Two pods each take 10 requests of 100
    prompt tokens a tick and finish 2: 10 req/s of 1,000 prompt tokens/s, not 5,000 (the
    prompt tokens over the 4 finished)."""
    state = CapacityState()
    for k in range(31):
        now, started, finished = 2.0 * k, 10.0 * k, 2.0 * k
        samples = [PodLoad(name, now, 0, started - finished, 0.1, prompt_tokens_total=100.0 * started,
                           generation_tokens_total=started, requests_total=finished,
                           ttft_buckets=((1.0, started), (math.inf, started))) for name in ("a", "b")]
        d = decide(spec(), state, samples, now, 2, Fleet(2), None, PRIOR)
        state = d.state
    assert d.details["demandRequestsPerSecond"] == pytest.approx(10.0)
    assert d.details["demandPromptTokensPerSecond"] == pytest.approx(1000.0)
    assert d.details["demandGenerationTokensPerSecond"] == pytest.approx(10.0)


def test_starting_pods_count_as_capacity_arriving_and_are_not_asked_for_again():
    # Demand needs 4; 1 ready and 3 starting (30 s old of a 60 s start): the count stays 4 even
    # with a backlog, because the starting pods drain it before another pod could arrive.
    fleet = Fleet(1, (30.0, 30.0, 30.0))
    d = run_rate(25.0, 60, fleet, 4)
    final = decide(spec(), d.state, [PodLoad("p", 62.0, 40, 8, 0.2)], 62.0, 4, fleet,
                   gateway(25.0 * 62.0), PRIOR)
    assert final.desired_replicas == 4 and "drains in" in final.reason
    assert final.details["podsStarting"] == 3


def test_a_backlog_gets_extra_pods_only_if_they_arrive_before_it_drains():
    # 20,000 tokens, 2 ready pods draining 2,000 tokens/s each against 1,000 tokens/s of demand:
    # 20,000 / 3,000 = 6.7 s, before a pod started now (60 s) could help.
    assert plan_backlog(20_000, 1000, 2000, Fleet(2), 2, 60.0, 10) == (0, pytest.approx(20_000 / 3000))
    # 1,000,000 tokens: 333 s with 2 pods; each extra pod joins at 60 s; to be done by 90 s the
    # backlog left at 60 s (820,000) needs 27,333 tokens/s over 30 s -> 14 pods, capped at 10.
    extra, took = plan_backlog(1_000_000, 1000, 2000, Fleet(2), 2, 60.0, 10)
    assert extra == 8 and took == pytest.approx(60 + (1_000_000 - 3000 * 60) / (10 * 2000 - 1000))
    # A pod starting (40 s old) is counted from its expected ready time, 20 s from now.
    assert drain_seconds(100_000, 1000, 2000, 1, [20.0]) == pytest.approx(20 + (100_000 - 1000 * 20) / 3000)


def test_scale_down_waits_hold_starts_of_the_measured_start_time():
    busy = run_rate(30.0, 60, Fleet(4), 4)
    state, last = busy.state, None
    for k in range(1, 200):
        now = 60.0 + 2 * k
        last = decide(spec(), state, [], now, 4, Fleet(4), gateway(30.0 * 60), PRIOR)
        state = last.state
        if last.desired_replicas < 4:
            break
    # 30 req/s needs 4 (3,000 tokens/s x 60 / 62 x 1.3 / 1,000); demand falls to 0 over the 60 s
    # window; the need of 4 is held for 5 starts of 60 s
    assert 60 + cp.HOLD_STARTS * 60 <= now <= 60 + cp.DEMAND_SECONDS + cp.HOLD_STARTS * 60 + 2
    # a measured start replaces the prior, later ones are blended in; the hold follows it
    quick = decide(spec(), busy.state, [], 62.0, 4, Fleet(4, (), (10.0,)), gateway(30.0 * 60), PRIOR)
    assert quick.details["startSeconds"] == 10.0
    later = decide(spec(), quick.state, [], 64.0, 4, Fleet(4, (), (30.0,)), gateway(30.0 * 60), PRIOR)
    assert later.details["startSeconds"] == 20.0
    state = later.state
    for k in range(1, 200):
        now = 64.0 + 2 * k
        last = decide(spec(), state, [], now, 4, Fleet(4), gateway(30.0 * 60), PRIOR)
        state = last.state
        if last.desired_replicas < 4:
            break
    assert now <= 64 + cp.DEMAND_SECONDS + cp.HOLD_STARTS * 20 + 2


def test_a_fresh_state_keeps_the_replicas_it_finds_for_the_hold_before_scaling_down():
    # no demand measured at the first tick (one reading) is not a reason to give 3 pods back
    first = decide(spec(), CapacityState(), [], 0.0, 3, Fleet(3), gateway(0.0), PRIOR)
    assert first.desired_replicas == 3
    still = run_rate(0.0, cp.HOLD_STARTS * 60 - 2, Fleet(3), 3)
    assert still.desired_replicas == 3
    assert run_rate(0.0, cp.HOLD_STARTS * 60 + 2, Fleet(3), 3).desired_replicas == 1


def test_queue_and_kv_guard_scale_down_but_queue_never_sizes_up():
    idle = run_rate(0.0, 700, Fleet(3), 3)
    assert idle.desired_replicas == 1
    queued = [PodLoad(f"p{i}", 702.0, 20, 4, 0.3) for i in range(3)]  # 20 waiting per pod > 5
    d = decide(spec(), idle.state, queued, 702.0, 3, Fleet(3), gateway(0.0), PRIOR)
    assert d.desired_replicas == 3 and "no scale-down" in d.reason
    kv = [PodLoad(f"p{i}", 702.0, 0, 4, 0.95) for i in range(3)]  # 2.85 pods' worth / 0.8 -> 4
    assert decide(spec(), idle.state, kv, 702.0, 3, Fleet(3), gateway(0.0), PRIOR).desired_replicas == 4
    few = [PodLoad("p0", 702.0, 20, 4, 0.3)]
    assert decide(spec(), idle.state, few, 702.0, 1, Fleet(1), gateway(0.0), PRIOR).desired_replicas == 1


def test_capacity_learns_down_on_a_miss_and_up_when_pods_did_more_and_met_it():
    window = lambda prompt, met, total: [(60.0, 60.0, prompt, 0.0, met, total, 1.0)]  # noqa: E731
    # 60 pod-seconds at 600 tokens/s with 50% met: capacity moves halfway to 600
    assert learn_capacity(1000.0, window(36_000, 50, 100), PRIOR) == pytest.approx(1000 + cp.LEARN_RATE * (600 - 1000))
    # met at 1,500 tokens/s: up halfway
    assert learn_capacity(1000.0, window(90_000, 100, 100), PRIOR) == pytest.approx(1000 + cp.LEARN_RATE * 500)
    # evidence that agrees, or too few requests: unchanged
    assert learn_capacity(1000.0, window(36_000, 100, 100), PRIOR) == 1000.0
    assert learn_capacity(1000.0, window(90_000, 1, 10), PRIOR) == 1000.0


def test_a_window_with_pods_starting_only_raises_the_capacity():
    window = lambda prompt, met, total: [(60.0, 60.0, prompt, 0.0, met, total, 0.0)]  # noqa: E731
    # a miss while pods start may be the start's backlog: no move down
    assert learn_capacity(1000.0, window(36_000, 50, 100), PRIOR, down=False) == 1000.0
    # met at 1,500 tokens/s while pods start: the pods did that, up halfway
    assert learn_capacity(1000.0, window(90_000, 100, 100), PRIOR, down=False) == pytest.approx(1250.0)


def test_ttft_within_the_objective_reads_the_largest_bucket_below_it():
    buckets = ((0.5, 10.0), (1.0, 30.0), (2.5, 38.0), (math.inf, 40.0))
    assert met_within(buckets, 1.0) == (30.0, 40.0)
    assert met_within(buckets, 2.0) == (30.0, 40.0)  # 2 s lies inside (1, 2.5]: counted as not met
    assert met_within((), 1.0) == (0.0, 0.0)


def test_the_state_survives_json_and_another_policys_state_is_not_read():
    d = run_rate(25.0, 20, Fleet(2), 2)
    data = json.loads(json.dumps(d.state.to_dict()))
    assert CapacityState.from_dict(data) == d.state
    assert load_state(spec(), {"observations": [[1, 2, 3]]}) == CapacityState()
    assert type(load_state(spec(policy="queue"), data)).__name__ == "AutoscalerState"


@pytest.mark.parametrize("stored", [
    {"totals": [1, 2]}, {"totals": "x"}, {"needs": [[1]]}, {"needs": [[1, "x"]]}, {"pods": [1, 2]},
    {"pods": {"a": 5}}, {"pods": {"a": [1, 2]}}, {"intervals": 5}, {"intervals": [[1, 2]]}, {"work": [["a"]]},
    {"work": [[1, 2, 3, 4, 5, 6]]}, {"capacity": "abc"}, {"capacity": math.nan}, {"capacity": -5.0},
    {"capacity": 0}, {"startSeconds": math.nan}, {"startSeconds": -10}, {"time": "yesterday"},
    {"learnedAt": "x"}, {"lastActive": True},
])
def test_a_stored_state_that_does_not_read_is_a_fresh_one_not_a_failing_tick(stored):
    """status.autoscaler as another operator version (or a hand edit) left it: the tick goes on
    from a fresh state, and the state it writes is JSON again."""
    data = {**json.loads(json.dumps(run_rate(25.0, 20, Fleet(2), 2).state.to_dict())), **stored}
    for policy in ("capacity", "queue"):
        state = load_state(spec(policy=policy), data)
        assert state == type(state)(), stored
    assert load_state(spec(), [1, 2]) == CapacityState() and load_state(spec(policy="queue"), "x") == \
        load_state(spec(policy="queue"), {"observations": [[1]], "recommendations": [[1, "x"]]})
    tick = Tick(100.0, 2, Fleet(2), [PodLoad("p", 0.0, 1, 1, 0.5)], gateway(10.0))
    for policy in ("capacity", "queue"):
        d = policy_decide(spec(policy=policy), load_state(spec(policy=policy), data), tick)
        assert d.desired_replicas == 2
        json.dumps(d.state.to_dict(), allow_nan=False)


def test_the_policy_entry_point_runs_the_named_policy():
    tick = Tick(0.0, 2, Fleet(2), [PodLoad("p", 0.0, 30, 4, 0.2)], None)
    assert "queue depth" in policy_decide(spec(policy="queue"), None, tick).reason
    assert "demand" in policy_decide(spec(), None, tick).reason


def test_fleet_measures_starts_from_creation_to_ready():
    pods = [{"metadata": {"name": "a", "creationTimestamp": "2026-01-01T00:00:00Z"},
             "status": {"conditions": [{"type": "Ready", "status": "True",
                                        "lastTransitionTime": "2026-01-01T00:00:42Z"}]}},
            {"metadata": {"name": "b", "creationTimestamp": "2026-01-01T00:01:00Z"}, "status": {}},
            {"metadata": {"name": "c", "deletionTimestamp": "x"}, "status": {}}]
    now = 1767225600.0 + 75  # 2026-01-01T00:01:15Z
    assert fleet_from_pods(pods, now, ["a"]) == Fleet(1, (15.0,), (42.0,))


@pytest.mark.parametrize("field", ["tokens_per_second", "generation_weight", "start_seconds", "request_tokens",
                                   "drain_tokens_per_second"])
@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf")])
def test_a_prior_that_would_divide_by_zero_or_nan_is_refused(field, value):
    with pytest.raises(ValueError, match=field):
        CapacityPrior(**{field: value})


# --- spec.autoscaling's windows (unset: this policy's own) ---------------------------------------

def test_scale_down_delay_seconds_replaces_the_hold_of_measured_starts():
    def first_scale_down(s: AutoscalingSpec):
        state, held = run_rate(30.0, 60, Fleet(4), 4, s).state, ""
        for k in range(1, 300):
            now = 60.0 + 2 * k
            d = decide(s, state, [], now, 4, Fleet(4), gateway(30.0 * 60), PRIOR)
            state = d.state
            if d.desired_replicas < 4:
                return now, held
            held = d.reason
        raise AssertionError("never scaled down")

    # unset: five starts of 60 s after the need of 4 last held; set: that many seconds
    assert first_scale_down(spec())[0] >= 60 + cp.HOLD_STARTS * 60
    now, reason = first_scale_down(spec(scale_down_delay_seconds=20))
    assert now <= 60 + cp.DEMAND_SECONDS + 20 + 2 and "needed within 20s (scaleDownDelaySeconds)" in reason
    assert first_scale_down(spec(scale_down_delay_seconds=0))[0] < first_scale_down(
        spec(scale_down_delay_seconds=20))[0]


def test_the_stable_and_panic_windows_and_the_threshold_are_the_specs():
    def after_step(s: AutoscalingSpec, seconds: float):
        """10 req/s for 60 s, then 40 req/s for ``seconds``: the last decision."""
        state = run_rate(10.0, 60, Fleet(1), 1, s).state
        for k in range(1, int(seconds / 2) + 1):
            now = 60.0 + 2 * k
            d = decide(s, state, [], now, 1, Fleet(1), gateway(600 + 40.0 * (now - 60)), PRIOR)
            state = d.state
        return d

    # a 20 s stable window holds only the step 20 s after it (the default 60 s one reads 20 req/s)
    d = after_step(spec(stable_window_seconds=20, panic_threshold=100), 20)
    assert d.details["demandRequestsPerSecond"] == pytest.approx(40.0) and "(last" not in d.reason
    d = after_step(spec(panic_threshold=100), 20)
    assert d.details["demandRequestsPerSecond"] == pytest.approx((40 * 20 + 10 * 40) / 60, abs=1e-3)
    assert "(last" not in d.reason  # a threshold of 100 x: no panic at a 4 x step
    # the panic window is the spec's, or the default while unset
    assert "(last 4s)" in after_step(spec(panic_window_seconds=4), 6).reason
    assert f"(last {cp.PANIC_SECONDS:g}s)" in after_step(spec(), 6).reason
    # a stable window shorter than the default panic window cuts it
    assert cp.spec_windows(spec(stable_window_seconds=5)) == cp.Windows(5.0, 5.0, cp.PANIC_RATIO, None)


def test_a_tolerance_keeps_a_count_whose_need_is_within_it():
    # 25 req/s x 100 tokens x 60 / 62 x 1.3 / 1,000 per pod = 3.15 pods: 4 without a dead band,
    # the 3 running within ±0.1 of it
    assert run_rate(25.0, 60, Fleet(3), 3).recommendation == 4
    d = run_rate(25.0, 60, Fleet(3), 3, spec(tolerance=0.1))
    assert d.recommendation == 3 and "within ±0.1 of 3" in d.reason
    assert run_rate(25.0, 60, Fleet(3), 3, spec(tolerance=0.04)).recommendation == 4


def test_the_crd_descriptions_name_each_policys_defaults():
    from slipstream.operator import autoscaler as queue
    fields = AutoscalingSpec.model_fields
    described = {name: fields[name].description for name in
                 ("stable_window_seconds", "panic_window_seconds", "panic_threshold", "scale_down_delay_seconds")}
    assert cp.DEMAND_SECONDS == 60 and "Unset: 60." in described["stable_window_seconds"]
    assert (f"Unset: {cp.PANIC_SECONDS:g} (capacity) or {queue.PANIC_WINDOW_SECONDS:g} (queue"
            in described["panic_window_seconds"])
    assert cp.PANIC_RATIO == queue.PANIC_THRESHOLD and f"Unset: {cp.PANIC_RATIO:g}." in described["panic_threshold"]
    assert cp.HOLD_STARTS == 5 and "five measured pod starts" in described["scale_down_delay_seconds"]
    assert f"or {queue.SCALE_DOWN_DELAY_SECONDS} (queue)" in described["scale_down_delay_seconds"]
    assert queue.TOLERANCE == 0.1 and cp.spec_windows(spec()).tolerance == 0
    assert "Unset: 0.1 (queue, HPA's) or 0 (capacity" in fields["tolerance"].description
