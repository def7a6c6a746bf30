"""``slipstream simulate``: arrival traces, replicas on a virtual clock, the autoscaling policy in
the loop, the head-of-line example and the command itself."""
from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

import yaml

from slipstream.api_types.autoscaling import CRD_KEYS, AutoscalingSpec
from slipstream.operator.spec import SpecError, parse_spec
from slipstream.server import cli, simulate
from slipstream.server.sim import compare as sim_compare
from slipstream.server.sim.clairvoyant import by_minute
from slipstream.server.sim.cluster import Cluster, ReplicaConfig, SimRequest, VirtualReplica
from slipstream.server.sim.cost_model import PROFILES, batch_shape, step_time
from slipstream.server.sim.head_of_line import continuous_batching, static_batching
from slipstream.server.sim.trace import Arrival, Phase, cap_lengths, parse_length, parse_rate_schedule, \
    poisson_arrivals, read_trace, scale_times
from slipstream.server.sim.scalers import HPAScaler
from slipstream.api_types.load import GatewayLoad, PodLoad
from slipstream.operator.fleet import Fleet
from slipstream.operator.policy import Tick

H100 = PROFILES["llama3-8b-h100"]
TINY = PROFILES["tiny"]


# --- traces -------------------------------------------------------------------------------------

def test_rate_schedule_reads_phases_with_units():
    assert parse_rate_schedule("10rps for 60s, 40 rps for 2m,5rps for 1h") == [
        Phase(10, 60), Phase(40, 120), Phase(5, 3600)]


@pytest.mark.parametrize("text", ["10 for 60s", "10rps for 0s", "fast", "10rps for 60s,"])
def test_bad_rate_schedules_say_how_to_write_one(text):
    with pytest.raises(ValueError, match="rate schedule"):
        parse_rate_schedule(text)


def test_poisson_arrivals_follow_each_phase_rate_and_the_seed():
    arrivals = poisson_arrivals([Phase(20, 50), Phase(2, 50)], (10, 20), (5, 5), seed=7)
    first = [a for a in arrivals if a.time < 50]
    assert 850 < len(first) < 1150 and 60 < len(arrivals) - len(first) < 140
    assert all(10 <= a.prompt_tokens <= 20 and a.output_tokens == 5 for a in arrivals)
    assert arrivals == poisson_arrivals([Phase(20, 50), Phase(2, 50)], (10, 20), (5, 5), seed=7)
    assert arrivals != poisson_arrivals([Phase(20, 50), Phase(2, 50)], (10, 20), (5, 5), seed=8)


def test_trace_file_skips_header_and_comments_and_fills_missing_lengths(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text("time,prompt,output\n2.5,100,7\n# a comment\n1.0 30\n\n0.5\n")
    arrivals = read_trace(path, (64, 64), (9, 9))
    assert arrivals == [Arrival(0.5, 64, 9), Arrival(1.0, 30, 9), Arrival(2.5, 100, 7)]
    path.write_text("1.0,10,5\n2.0,ten\n")
    with pytest.raises(ValueError, match="trace.csv:2"):
        read_trace(path, (1, 1), (1, 1))


@pytest.mark.parametrize("line", ["nan 10 10", "inf 10 10", "1e999 10 10"])
def test_a_trace_time_that_is_not_a_finite_number_names_its_line(tmp_path, line):
    path = tmp_path / "trace.txt"
    path.write_text(f"0 10 10\n{line}\n")
    with pytest.raises(ValueError, match="trace.txt:2"):
        read_trace(path, (1, 1), (1, 1))


@pytest.mark.parametrize("text", ["", "# nothing\n\n", "TIMESTAMP,ContextTokens,GeneratedTokens\n",
                                  '{"time": 1, "prompt": 10}\n'])
def test_a_trace_without_arrivals_is_refused(tmp_path, text, capsys):
    path = tmp_path / "trace.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match="no arrivals"):
        read_trace(path, (1, 1), (1, 1))
    assert simulate.main(["--profile", "tiny", "--trace", str(path), "--no-plot"]) == 2
    assert "no arrivals" in capsys.readouterr().err


@pytest.mark.parametrize("flags, says", [
    (["--trace", "TRACE", "--time-scale", "inf"], "time scale"),
    (["--trace", "TRACE", "--time-scale", "1e308"], "time scale"),
    (["--rate", "1rps for 5s", "--time-scale", "0.5"], "--time-scale"),
])
def test_a_time_scale_must_stretch_a_trace_to_finite_times(tmp_path, flags, says, capsys):
    trace = tmp_path / "trace.txt"
    trace.write_text("0 10 10\n5 10 10\n")
    flags = [str(trace) if f == "TRACE" else f for f in flags]
    assert simulate.main(["--profile", "tiny", "--no-plot", *flags]) == 2
    assert says in capsys.readouterr().err


def test_lengths_are_a_count_or_a_range():
    assert parse_length("256") == (256, 256) and parse_length("64-1024") == (64, 1024)
    with pytest.raises(ValueError, match="A-B"):
        parse_length("0")


# --- one replica --------------------------------------------------------------------------------

def test_a_replica_times_each_step_with_the_cost_model():
    replica = VirtualReplica("pod-0", H100, ReplicaConfig.for_profile(H100), created=0.0, ready_at=0.0)
    sim = SimRequest(arrival=1.0, prompt_tokens=100, output_tokens=3)
    replica.add(sim, 1.0)
    replica.advance(10.0)
    prefill = step_time(H100, batch_shape([(0, 100)]))
    decodes = step_time(H100, batch_shape([(100, 1)])) + step_time(H100, batch_shape([(101, 1)]))
    assert sim.first_token == pytest.approx(1.0 + prefill)
    assert sim.finished == pytest.approx(1.0 + prefill + decodes)
    assert replica.idle and replica.kv.num_free_blocks == replica.kv.num_blocks


def test_a_full_replica_queues_and_a_small_kv_cache_preempts():
    config = ReplicaConfig(max_num_seqs=2, max_num_batched_tokens=512, kv_cache_bytes=12 * 16 * 8192)
    replica = VirtualReplica("pod-0", TINY, config, created=0.0, ready_at=0.0)
    requests = [SimRequest(0.0, 40, 60) for _ in range(4)]
    for r in requests:
        replica.add(r, 0.0)
    replica.advance(0.001)
    assert replica.sample(0.001).num_requests_waiting == 2  # two seats
    replica.advance(1e6)
    assert all(r.finished is not None for r in requests)
    assert replica.scheduler.num_preemptions > 0  # 2 × 100 tokens > 12 blocks × 16
    with pytest.raises(ValueError, match="does not fit"):
        replica.add(SimRequest(0.0, 4000, 4000), 0.0)


def test_a_replica_with_a_long_prefill_threshold_answers_a_short_prompt_beside_a_long_one():
    """The same two arrivals on the H100 profile at a budget of 2,048: a 7,000-token prompt and,
    10 ms later (during its first step), a 50-token one. Capped at 512 tokens a step beside it,
    the short prompt's first token comes in the next step instead of after the long prefill's
    four; the flag reaches the replicas' scheduler."""
    args = simulate.parser().parse_args(["--long-prefill-token-threshold", "512", "--max-num-batched-tokens", "2048"])
    first_tokens = {}
    for threshold in (0, 512):
        config = replace(simulate.replica_config(args), long_prefill_token_threshold=threshold)
        replica = VirtualReplica("pod-0", H100, config, created=0.0, ready_at=0.0)
        assert replica.scheduler.long_prefill_token_threshold == threshold
        long, short = SimRequest(0.0, 7000, 4), SimRequest(0.01, 50, 4)
        replica.add(long, 0.0)
        replica.advance(0.01)
        replica.add(short, 0.01)
        replica.advance(100.0)
        first_tokens[threshold] = (long.first_token, short.first_token)
    assert simulate.replica_config(args).long_prefill_token_threshold == 512
    (long_0, short_0), (long_512, short_512) = first_tokens[0], first_tokens[512]
    assert short_0 == long_0  # it waited for the whole prefill, admitted beside its last chunk
    assert short_512 < long_512 and short_512 - 0.01 < (short_0 - 0.01) / 2
    assert long_512 > long_0  # the long prompt pays: 512 a step beside the short one's decodes


# --- the cluster with the policy in the loop -----------------------------------------------------

def _spec(**overrides) -> AutoscalingSpec:
    values = dict(enabled=True, policy="queue", min_replicas=1, max_replicas=4, target_queue_depth=4, stable_window_seconds=20,
                  panic_window_seconds=4, scale_down_delay_seconds=30)
    return AutoscalingSpec(**{**values, **overrides})


def _overload(rate: float = 60.0, seconds: float = 30.0, then: float = 120.0):
    """A tiny-profile burst far past one replica's capacity, then nothing for ``then`` seconds."""
    return poisson_arrivals([Phase(rate, seconds), Phase(0.0, then)], (32, 32), (64, 64), seed=1)


def test_overload_scales_up_after_the_startup_delay_and_back_down_after_the_delay():
    cluster = Cluster(TINY, ReplicaConfig.for_profile(TINY), _spec(), startup_delay=10.0, tick=1.0)
    result = cluster.run(_overload(), duration=150.0)
    ups = [(t, d) for t, d in result.scalings if d.desired_replicas > d.current_replicas]
    downs = [(t, d) for t, d in result.scalings if d.desired_replicas < d.current_replicas]
    assert ups and ups[0][0] <= 5.0 and max(d.desired_replicas for _, d in ups) == 4
    ready_at = {tick.time: tick.ready for tick in result.ticks}
    assert ready_at[ups[0][0] + 9.0] == 1 and ready_at[ups[0][0] + 11.0] > 1  # starting pods take no requests
    assert downs and downs[0][0] >= 30.0 + 30.0  # no scale-down before the delay after the burst
    assert result.ticks[-1].desired == 1
    assert all(r.finished is not None for r in result.requests)
    # every request went to a replica that was ready when it arrived, and new replicas took some
    ready_since = {r.name: r.ready_at for r in cluster.replicas + cluster.retired}
    assert all(ready_since[r.replica] <= r.arrival for r in result.requests)
    assert len({r.replica for r in result.requests}) == 4


def test_without_autoscaling_the_count_stays_and_the_queue_only_grows_during_the_burst():
    fixed = Cluster(TINY, ReplicaConfig.for_profile(TINY), _spec(enabled=False), initial=1, tick=1.0)
    result = fixed.run(_overload(then=0.0), duration=30.0)
    assert not result.scalings and {t.desired for t in result.ticks} == {1}
    scaled = Cluster(TINY, ReplicaConfig.for_profile(TINY), _spec(), startup_delay=5.0, tick=1.0)
    better = scaled.run(_overload(then=0.0), duration=30.0)
    assert better.ttft_percentiles(quantiles=(0.99,))[0] < 0.5 * result.ttft_percentiles(quantiles=(0.99,))[0]


def test_an_arrival_on_the_last_tick_is_played_not_dropped():
    """Whole-second traces put the last arrival on a tick: the run ends after it, not before it."""
    cluster = Cluster(TINY, ReplicaConfig.for_profile(TINY), _spec(enabled=False), initial=1, tick=2.0)
    result = cluster.run([Arrival(0.0, 10, 10), Arrival(2.0, 10, 10), Arrival(4.0, 10, 10)])
    assert [r.arrival for r in result.requests] == [0.0, 2.0, 4.0]
    assert all(r.finished is not None for r in result.requests)


def test_from_zero_the_first_arrival_starts_a_replica_all_finish_and_idle_returns_to_zero():
    cluster = Cluster(TINY, ReplicaConfig.for_profile(TINY), _spec(min_replicas=0, scale_to_zero_after_seconds=30),
                      startup_delay=10.0, tick=1.0)
    arrivals = poisson_arrivals([Phase(0.0, 20.0), Phase(5.0, 10.0), Phase(0.0, 100.0)], (32, 32), (64, 64), seed=1)
    result = cluster.run(arrivals, duration=130.0)

    first = arrivals[0].time
    assert first >= 20.0 and {t.desired for t in result.ticks if t.time < first} == {0}
    up_time, up = result.scalings[0]
    assert up.current_replicas == 0 and up.desired_replicas >= 1 and first < up_time <= first + 1.0
    held = sum(1 for a in arrivals if a.time < up_time)
    assert up.reason.startswith(f"scaling from zero: {held} request{'s' * (held > 1)} waiting in the gateway")
    # Every request waited for the first replica instead of failing, and finished.
    assert all(r.finished is not None for r in result.requests) and len(result.requests) == len(arrivals)
    ready_at = min(r.ready_at for r in cluster.replicas + cluster.retired)
    assert ready_at == up_time + 10.0 and min(r.first_token for r in result.requests) > ready_at
    # Back to zero once nothing ran or waited for scaleToZeroAfterSeconds, and not before.
    last_finish = max(r.finished for r in result.requests)
    down_time, down = result.scalings[-1]
    assert down.desired_replicas == 0 and last_finish + 29.0 <= down_time <= last_finish + 31.0, down.reason
    assert "scaled to zero after 30s idle" in down.reason
    assert result.ticks[-1].desired == 0 and result.ticks[-1].ready == 0
    assert not cluster.active


def test_least_loaded_routing_drains_a_backlog_faster_than_round_robin():
    arrivals = _overload(rate=40.0, seconds=40.0, then=0.0)
    p99 = {}
    for routing in ("round-robin", "least-loaded"):
        cluster = Cluster(TINY, ReplicaConfig.for_profile(TINY), _spec(), startup_delay=10.0, tick=1.0,
                          routing=routing)
        p99[routing] = cluster.run(arrivals, duration=40.0).ttft_percentiles(20.0, 60.0, (0.99,))[0]
    assert p99["least-loaded"] < p99["round-robin"]


# --- head-of-line blocking ----------------------------------------------------------------------

def test_static_batching_spends_2000_steps_on_2270_useful_tokens():
    run = static_batching((20, 50, 200, 2000) * 4, slots=4)
    assert run.first_batch_steps == 2000 and run.total_steps == 8000
    assert run.utilization == pytest.approx(2270 / 8000)  # 28.4%
    assert run.finish_steps[:4] == (20, 50, 200, 2000)


def test_continuous_batching_makes_the_same_tokens_in_568_steps_while_the_queue_lasts():
    run = continuous_batching((20, 50, 200, 2000) * 4, slots=4)
    assert run.steps_to_first_batch_tokens == 568 and run.idle_before == 0  # ceil(2270 / 4)
    assert run.first_batch_steps == 2000  # the long request still needs its 2000 steps
    alone = continuous_batching((20, 50, 200, 2000), slots=4)
    assert alone.steps_to_first_batch_tokens == 2000 and alone.idle_before > 0  # no queue to refill from


# --- the command ----------------------------------------------------------------------------------

def test_head_of_line_example_prints_both_totals(capsys):
    assert cli.main(["simulate", "--example", "head-of-line"]) == 0
    out = capsys.readouterr().out
    assert "2,000 steps = 100.0 s" in out and "28.4%" in out
    assert "568 steps = 28.4 s" in out and "567.5" in out


def test_simulate_prints_a_table_and_the_scaling_and_writes_a_png(tmp_path, capsys):
    png = tmp_path / "run.png"
    code = cli.main(["simulate", "--profile", "tiny", "--rate", "5rps for 20s, 60rps for 30s, 1rps for 60s",
                     "--prompt-tokens", "32", "--output-tokens", "32-96", "--startup-delay", "10",
                     "--max-replicas", "4", "--panic-window", "4", "--stable-window", "20",
                     "--scale-down-delay", "30", "--report-every", "10", "--plot", str(png)])
    out = capsys.readouterr().out
    assert code == 0
    header, *rows = out.split("\n\n")[0].splitlines()
    assert header.split()[:4] == ["time_s", "rps", "desired", "ready"]
    assert len(rows) >= 10 and max(int(r.split()[2]) for r in rows) == 4
    assert "scaling 1 -> " in out and png.read_bytes()[:4] == b"\x89PNG"


def test_simulate_reads_the_autoscaling_spec_from_an_inference_service(tmp_path, capsys):
    spec = tmp_path / "isvc.yaml"
    spec.write_text("apiVersion: slipstream.dev/v1alpha1\nkind: InferenceService\nmetadata: {name: x}\n"
                    "spec:\n  autoscaling: {enabled: true, minReplicas: 2, maxReplicas: 2}\n")
    assert cli.main(["simulate", "--profile", "tiny", "--rate", "1rps for 10s", "--autoscaling", str(spec),
                     "--no-plot"]) == 0
    rows = capsys.readouterr().out.split("\n\n")[0].splitlines()[1:]
    assert {int(r.split()[3]) for r in rows} == {2}


def _simulated_spec(*argv: str) -> AutoscalingSpec:
    return simulate.autoscaling_spec(simulate.parser().parse_args(list(argv)))


def test_an_unknown_autoscaling_key_gets_the_operators_message_in_the_simulator(tmp_path, capsys):
    isvc = {"apiVersion": "slipstream.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": "x"},
            "spec": {"autoscaling": {"enabled": True, "targetQueueDepht": 4}}}
    path = tmp_path / "isvc.yaml"
    path.write_text(yaml.safe_dump(isvc))
    with pytest.raises(SpecError) as operator_error:
        parse_spec(isvc["spec"], name="x")
    with pytest.raises(ValueError) as simulator_error:
        _simulated_spec("--autoscaling", str(path))
    assert str(simulator_error.value) == operator_error.value.message
    assert operator_error.value.message.startswith("spec.autoscaling has unknown field(s) targetQueueDepht; known:")
    assert cli.main(["simulate", "--autoscaling", str(path), "--no-plot"]) == 2
    assert "unknown field(s) targetQueueDepht" in capsys.readouterr().err


@pytest.mark.parametrize("text, flags, says", [
    ("a: [\n", [], "not YAML"),
    ("spec: 5\n", [], "spec must be an object, got 5"),
    ("objectives: 5\n", ["--ttft-p90-objective", "1"], "spec.autoscaling.objectives must be an object, got 5"),
    (b"\xff\xfe\n", [], "not UTF-8"),
])
def test_a_bad_autoscaling_file_is_one_line_naming_what_is_wrong(tmp_path, text, flags, says, capsys):
    path = tmp_path / "isvc.yaml"
    path.write_bytes(text) if isinstance(text, bytes) else path.write_text(text)
    with pytest.raises(ValueError, match=says):
        _simulated_spec("--autoscaling", str(path), *flags)
    assert cli.main(["simulate", "--autoscaling", str(path), "--no-plot", *flags]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1


def test_an_inference_service_without_autoscaling_gets_the_defaults(tmp_path):
    path = tmp_path / "isvc.yaml"
    for spec in ({}, {"model": {"uri": "hf://x/y"}}):
        path.write_text(yaml.safe_dump({"kind": "InferenceService", "spec": spec}))
        assert _simulated_spec("--autoscaling", str(path)) == _simulated_spec()


def test_the_simulator_defaults_are_the_operators_but_for_max_replicas():
    operator = parse_spec({"autoscaling": {"enabled": True, "maxReplicas": 8}}).autoscaling
    assert _simulated_spec() == operator
    assert _simulated_spec("--no-autoscaling") == parse_spec({"autoscaling": {"maxReplicas": 8}}).autoscaling


def test_every_flag_sets_the_crd_field_the_operator_reads(tmp_path):
    """Flags and files go through the operator's parser; tolerance is a CRD field like the others."""
    path = tmp_path / "autoscaling.yaml"
    path.write_text("autoscaling: {tolerance: 0.3, stableWindowSeconds: 30, panicThreshold: 3}\n")
    spec = _simulated_spec("--autoscaling", str(path), "--tolerance", "0.2", "--panic-window", "5")
    assert spec == parse_spec({"autoscaling": {"enabled": True, "maxReplicas": 8, "tolerance": 0.2,
                                               "stableWindowSeconds": 30, "panicThreshold": 3,
                                               "panicWindowSeconds": 5}}).autoscaling
    assert set(simulate._SPEC_FLAGS) <= set(CRD_KEYS.values())
    with pytest.raises(ValueError, match=r"spec.autoscaling.tolerance must be a number in \[0, 1\), got 1.5"):
        _simulated_spec("--tolerance", "1.5")


def test_simulate_reports_bad_input_with_exit_code_2(capsys):
    assert cli.main(["simulate", "--rate", "lots", "--no-plot"]) == 2
    assert "rate schedule" in capsys.readouterr().err
    assert cli.main(["simulate", "--max-replicas", "0", "--no-plot"]) == 2
    assert "maxReplicas" in capsys.readouterr().err
    # the flags' own names, not the simulator's parameters
    for flags, says in ((["--tick", "0"], "--tick must be a finite number of seconds > 0, got 0"),
                        (["--tick", "nan"], "--tick must be a finite number of seconds > 0, got nan"),
                        (["--startup-delay", "-1"], "--startup-delay must be a finite number of seconds ≥ 0, got -1"),
                        (["--startup-delay", "inf"], "--startup-delay must be a finite number of seconds ≥ 0, got inf")):
        assert cli.main(["simulate", *flags, "--no-plot"]) == 2
        assert capsys.readouterr().err == f"slipstream simulate: {says}\n"


@pytest.mark.parametrize("flags, says", [
    (["--json", "NOWHERE/run.json", "--no-plot"], "--json NOWHERE/run.json: no directory"),
    (["--json", "HERE", "--no-plot"], "--json HERE: a directory"),
    (["--plot", "NOWHERE/run.png"], "--plot NOWHERE/run.png: no directory"),
    (["--plot", "HERE"], "--plot HERE: a directory"),
])
def test_an_output_file_that_cannot_be_written_is_a_usage_error_before_the_run(tmp_path, flags, says, capsys):
    flags = [f.replace("NOWHERE", str(tmp_path / "nowhere")).replace("HERE", str(tmp_path)) for f in flags]
    says = says.replace("NOWHERE", str(tmp_path / "nowhere")).replace("HERE", str(tmp_path))
    assert simulate.main(["--profile", "tiny", "--rate", "1rps for 5s", *flags]) == 2
    out, err = capsys.readouterr()
    assert says in err and "Traceback" not in err and not out


def test_a_json_file_that_fails_to_write_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(tmp_path / "run.json"))
    monkeypatch.setattr(Path, "write_text", refuse)
    assert simulate.main(["--profile", "tiny", "--rate", "1rps for 5s", "--no-plot",
                          "--json", str(tmp_path / "run.json")]) == 2
    assert "Permission denied" in capsys.readouterr().err


def test_plotting_without_matplotlib_says_to_install_it_or_skips_the_default_plot(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.chdir(tmp_path)
    assert simulate.main(["--profile", "tiny", "--rate", "1rps for 5s", "--plot", str(tmp_path / "run.png")]) == 2
    assert "needs matplotlib" in capsys.readouterr().err
    # the plot nobody asked for is skipped with a note, the run is not refused
    assert simulate.main(["--profile", "tiny", "--rate", "1rps for 5s"]) == 0
    assert "no plot: matplotlib is not installed" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
    assert simulate.main(["--profile", "tiny", "--rate", "1rps for 5s", "--no-plot"]) == 0


@pytest.mark.parametrize("flags, says", [
    (["--max-output-tokens", "0"], "--max-output-tokens"),
    (["--max-output-tokens", "-5"], "--max-output-tokens"),
    (["--max-num-seqs", "0"], "--max-num-seqs"),
    (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens"),
    (["--prompt-tokens", "10-5"], "--prompt-tokens: token count must be N or A-B with 1 <= A <= B, got '10-5'"),
    (["--output-tokens", "many"], "--output-tokens: token count must be N or A-B, got 'many'"),
    (["--tenants", "a"], "--tenants: tenant weights are NAME=WEIGHT"),
])
def test_bad_counts_lengths_and_tenant_shares_are_argparse_errors_in_the_parsers_words(flags, says, capsys):
    with pytest.raises(SystemExit) as exit_:
        simulate.main(["--profile", "tiny", "--rate", "1rps for 5s", "--no-plot", *flags])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and says in err and "invalid" not in err, err


@pytest.mark.parametrize("flags", [["--tick", "nan"], ["--tick", "inf"], ["--startup-delay", "nan"],
                                   ["--startup-delay", "inf"]])
def test_a_tick_or_startup_delay_that_is_not_finite_is_refused(flags, capsys):
    assert simulate.main(["--profile", "tiny", "--rate", "1rps for 5s", "--no-plot", *flags]) == 2
    assert "finite number" in capsys.readouterr().err


def test_simulate_takes_the_gateways_weight_flags_by_scorer_name(monkeypatch):
    built = []
    real = simulate.Cluster

    def spy(*args, **kwargs):
        built.append(real(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(simulate, "Cluster", spy)
    args = simulate.parser().parse_args(["--routing", "prefix", "--weight-queue", "2", "--weight-kv-cache", "0",
                                         "--rate", "1rps for 1s", "--no-plot", "--no-autoscaling"])
    simulate.run(args)
    assert dict(built[0].router.weights) == {"prefix": 3.0, "queue": 2.0, "kv_cache": 0.0, "affinity": 0.5}
    assert [w for _, w in built[0].router.scorers] == [3.0, 2.0, 0.0, 0.5]
    with pytest.raises(ValueError, match="Router, not beside it"):
        real(TINY, ReplicaConfig.for_profile(TINY), _spec(), routing=built[0].router, weights={"queue": 1.0})


# --- Azure CSV, capping, --json, --compare -------------------------------------------------------

AZURE_SAMPLE = Path(__file__).parent / "traces" / "azure-code-sample.csv"


def test_the_azure_csv_is_read_by_its_header_with_seconds_from_the_first_request():
    arrivals = read_trace(AZURE_SAMPLE, (1, 1), (1, 1))
    assert [(round(a.time, 3), a.prompt_tokens, a.output_tokens) for a in arrivals][:3] == \
        [(0.0, 4808, 10), (0.052, 3180, 8), (0.764, 110, 27)]
    assert arrivals[4].output_tokens == 1  # 0 generated tokens: a request makes at least one
    assert [round(a.time, 3) for a in scale_times(arrivals, 0.5)][:2] == [0.0, 0.026]


def test_an_azure_csv_saved_by_a_spreadsheet_reads_the_same(tmp_path):
    """A byte-order mark, other header case, other column order and an extra column."""
    lines = AZURE_SAMPLE.read_text().splitlines()
    rows = [line.split(",") for line in lines[1:]]
    edited = tmp_path / "edited.csv"
    edited.write_text("\ufeffgeneratedtokens,Timestamp,Region,contexttokens\n"
                      + "".join(f"{g},{t},westus,{c}\n" for t, c, g in rows), encoding="utf-8")
    assert read_trace(edited, (1, 1), (1, 1)) == read_trace(AZURE_SAMPLE, (1, 1), (1, 1))
    short = tmp_path / "short.csv"
    short.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03,12\n")
    with pytest.raises(ValueError, match="short.csv:2: expected TIMESTAMP"):
        read_trace(short, (1, 1), (1, 1))
    binary = tmp_path / "binary.trace"
    binary.write_bytes(b"\x00\xc0\xff" * 10)
    with pytest.raises(ValueError, match="binary.trace: not a text trace"):
        read_trace(binary, (1, 1), (1, 1))


def test_over_long_requests_are_capped_prompt_first_and_counted():
    arrivals = read_trace(AZURE_SAMPLE, (1, 1), (1, 1))
    capped, changed = cap_lengths(arrivals, 8192)
    assert changed == 1 and (capped[3].prompt_tokens, capped[3].output_tokens) == (6192, 2000)
    capped, changed = cap_lengths(arrivals, 8192, max_output_tokens=32)
    assert changed == 2 and capped[3].output_tokens == 32 and capped[3].prompt_tokens == 7000


def test_simulate_writes_its_numbers_as_json_and_says_how_many_were_capped(tmp_path, capsys):
    out = tmp_path / "run.json"
    code = cli.main(["simulate", "--trace", str(AZURE_SAMPLE), "--profile", "tiny", "--no-plot",
                     "--ttft-p90-objective", "5", "--json", str(out)])
    assert code == 0
    numbers = json.loads(out.read_text())
    assert numbers["requests"] == 6 and numbers["capped_requests"] == 2  # tiny's max_model_len is 4096
    assert set(numbers) >= {"ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "replica_hours", "peak_replicas",
                            "objective_attainment"}
    assert numbers["objective_ttft_p90_s"] == 5 and 0 <= numbers["objective_attainment"] <= 1
    assert "2 requests capped to max_model_len 4096" in capsys.readouterr().out


def test_compare_runs_every_scaler_on_the_same_arrivals_and_fixed_counts_up_to_the_first_that_meets(
        tmp_path, capsys):
    out, png = tmp_path / "compare.json", tmp_path / "compare.png"
    code = cli.main(["simulate", "--profile", "tiny", "--rate", "2rps for 60s, 30rps for 60s, 2rps for 60s",
                     "--prompt-tokens", "64", "--output-tokens", "16", "--startup-delay", "10",
                     "--max-replicas", "3", "--ttft-p90-objective", "0.2", "--compare", "--json", str(out),
                     "--plot", str(png)])
    assert code == 0
    rows = json.loads(out.read_text())
    # fixed 1 misses, fixed 2 meets: fixed 3 would only cost more
    assert list(rows) == ["capacity", "queue", "hpa-queue", "fixed-1", "fixed-2", "clairvoyant"]
    assert [rows[f"fixed-{n}"]["objective_met"] for n in (1, 2)] == [False, True]
    assert simulate.best_fixed(rows) == "fixed-2"
    assert len({r["requests"] for r in rows.values()}) == 1
    assert [rows[f"fixed-{n}"]["peak_replicas"] for n in (1, 2)] == [1, 2]
    counts = rows["clairvoyant"]["minute_counts"]
    assert len(counts) == 3 and counts[1] >= counts[0] and counts[1] >= counts[2]
    table = capsys.readouterr().out
    assert table.splitlines()[0].split()[:3] == ["scaler", "attain%", "ttft_p50_ms"]
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_each_minute_is_played_from_its_own_start_and_empty_minutes_are_kept():
    arrivals = [Arrival(5.0, 10, 1), Arrival(65.0, 10, 1), Arrival(130.5, 10, 1), Arrival(250.0, 10, 1)]
    minutes = by_minute(arrivals)
    assert [[a.time for a in m] for m in minutes] == [[5.0], [5.0], [10.5], [], [10.0]]
    assert by_minute([]) == []


def test_a_clairvoyant_schedule_that_misses_gets_pods_added_to_every_minute_until_it_meets(monkeypatch):
    monkeypatch.setattr(sim_compare, "minute_counts", lambda *a, **k: [1])  # too few: it misses
    args = simulate.parser().parse_args(["--profile", "tiny", "--rate", "60rps for 20s",
                                         "--prompt-tokens", "256", "--output-tokens", "16", "--startup-delay",
                                         "10", "--max-replicas", "6", "--ttft-p90-objective", "0.3"])
    rows = simulate.compare_runs(args)
    added = [name for name in rows if name.startswith("clairvoyant")]
    assert added[0] == "clairvoyant" and len(added) >= 2
    assert [rows[name]["objective_met"] for name in added] == [False] * (len(added) - 1) + [True]
    assert added[-1] == f"clairvoyant+{len(added) - 1}"


def test_compare_runs_once_per_routing_policy_and_reports_tenants(tmp_path, capsys):
    out = tmp_path / "compare.json"
    code = simulate.main(["--profile", "tiny", "--rate", "20rps for 30s", "--prompt-tokens", "64",
                          "--output-tokens", "16", "--max-replicas", "2", "--routing", "round-robin,least-loaded",
                          "--tenants", "a=1,b=1", "--compare", "--no-plot", "--json", str(out)])
    assert code == 0
    rows = json.loads(out.read_text())
    assert list(rows) == ["round-robin", "least-loaded"]
    assert set(rows["least-loaded"]["capacity"]["tenants"]) == {"a", "b"}
    printed = capsys.readouterr().out
    assert "routing least-loaded:" in printed and "tenant p90 ms" in printed


@pytest.mark.parametrize("flags, says", [
    (["--compare", "--no-autoscaling"], "--no-autoscaling"),
    (["--initial-replicas", "9", "--max-replicas", "8"], "--initial-replicas 9"),
])
def test_contradicting_flags_are_usage_errors(flags, says, capsys):
    assert simulate.main(["--profile", "tiny", "--rate", "1rps for 5s", "--no-plot", *flags]) == 2
    assert says in capsys.readouterr().err


def test_the_hpa_baseline_scales_by_the_ratio_outside_the_tolerance_and_holds_down_for_five_minutes():
    hpa = HPAScaler(AutoscalingSpec(enabled=True, max_replicas=10, target_queue_depth=5))
    tick = lambda now, waiting, current: Tick(now, current, Fleet(current),  # noqa: E731
                                              [PodLoad("p", now, waiting, 0, 0.0)], None)
    assert hpa.decide(tick(0, 10.5, 2)).desired_replicas == 2  # 5.25 per pod: within 10%
    assert hpa.decide(tick(15, 30, 2)).desired_replicas == 6  # ratio 3
    assert hpa.decide(tick(20, 300, 6)).desired_replicas == 6  # between syncs
    assert hpa.decide(tick(30, 0, 6)).desired_replicas == 6  # down waits for the window
    assert hpa.decide(tick(330, 0, 6)).desired_replicas == 1
    # from zero (minReplicas 0): the queue held in the gateway as an external metric, ceil(12 / 5)
    hpa = HPAScaler(AutoscalingSpec(enabled=True, min_replicas=0, max_replicas=10, target_queue_depth=5))
    held = lambda now, waiting: Tick(now, 0, Fleet(0), [], GatewayLoad(waiting, 0.0))  # noqa: E731
    assert hpa.decide(held(0, 0)).desired_replicas == 0
    assert hpa.decide(held(15, 12)).desired_replicas == 3


def test_tenants_in_the_workload_and_the_fair_policy_protect_the_small_tenant(tmp_path):
    """An overloaded replica, 90% of the arrivals from one tenant: first-come makes the small
    tenant wait behind the flood; fair (the engine's VTC) admits it next."""
    p90 = {}
    for policy in ("fcfs", "fair"):
        out = tmp_path / f"{policy}.json"
        assert simulate.main(["--profile", "tiny", "--rate", "40rps for 20s", "--prompt-tokens", "256",
                              "--output-tokens", "64", "--no-autoscaling", "--initial-replicas", "1",
                              "--tenants", "batch=9,chat=1", "--scheduling-policy", policy, "--no-plot",
                              "--json", str(out)]) == 0
        tenants = json.loads(out.read_text())["tenants"]
        assert set(tenants) == {"batch", "chat"} and 0.05 < tenants["chat"]["requests"] / 800 < 0.15
        p90[policy] = tenants["chat"]["ttft_p90_s"]
    assert p90["fair"] < 0.3 * p90["fcfs"], p90


@pytest.mark.parametrize("text", ["batch", "batch=0", "=1"])
def test_a_bad_tenant_share_is_a_usage_error(text, capsys):
    with pytest.raises(SystemExit) as exit_:
        simulate.main(["--tenants", text, "--no-plot"])
    assert exit_.value.code == 2 and "--tenants" in capsys.readouterr().err


def test_compare_without_arrivals_and_a_fixed_count_of_none_are_refused(capsys):
    assert simulate.main(["--profile", "tiny", "--no-plot", "--compare", "--rate", "1rps for 1s"]) == 2
    assert "--compare needs arrivals" in capsys.readouterr().err
    assert simulate.main(["--profile", "tiny", "--no-plot", "--no-autoscaling", "--initial-replicas", "0"]) == 2
    assert "serves nothing" in capsys.readouterr().err


def test_the_gateway_counts_tokens_at_the_answer_and_a_pod_as_it_makes_them_as_the_real_ones_do():
    # The real gateway adds a request's tokens from its usage when the answer ends
    # (gateway/proxy.py); the engine counts prompt tokens when it first schedules a request and
    # each generated token as it makes it (engine.py). Counting the gateway's at the first token
    # made a request in flight read as demand that never arrived (tokens over requests finished).
    cluster = Cluster(H100, ReplicaConfig.for_profile(H100), AutoscalingSpec(), initial=1)
    replica = cluster.replicas[0]
    sim = SimRequest(arrival=0.0, prompt_tokens=100, output_tokens=50)
    replica.add(sim, 0.0)
    replica.advance(step_time(H100, batch_shape([(0, 100)])) + 1e-6)
    assert sim.first_token is not None and sim.finished is None
    pod = replica.sample(0.1)  # the pod's own counters, as the engine keeps them
    assert (pod.prompt_tokens_total, pod.generation_tokens_total, pod.requests_total) == (100, replica.num_steps, 0)
    assert 1 <= replica.num_steps < 50  # one token a step, the first with the prefill
    gateway = cluster.gateway_load()
    assert (gateway.requests_total, gateway.prompt_tokens_total, gateway.generation_tokens_total,
            gateway.in_flight) == (0, 0, 0, 1)
    replica.advance(10.0)
    pod = replica.sample(10.0)
    assert (pod.prompt_tokens_total, pod.generation_tokens_total, pod.requests_total) == (100, 50, 1)
    gateway = cluster.gateway_load()
    assert (gateway.requests_total, gateway.prompt_tokens_total, gateway.generation_tokens_total) == (1, 100, 50)
