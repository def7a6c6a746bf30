"""``slipstream bench``: the workload, the arrival process, the trace summary and an offline run."""
from __future__ import annotations

import json
import math

import pytest

from slipstream.server.bench import main
from slipstream.server.bench.client import arrival_offsets, pct
from slipstream.server.bench.throughput import summarize
from slipstream.server.bench.workload import make_workload, parse_range
from slipstream.server.engine.trace import StepRecord


def test_parse_range_reads_one_length_or_a_range():
    assert parse_range("32-256") == (32, 256)
    assert parse_range("7") == (7, 7)
    for bad in ("0", "9-3", "a-b", "", "-5"):
        with pytest.raises(ValueError):
            parse_range(bad)


def test_workload_is_seeded_and_respects_its_bounds():
    a = make_workload(20, seed=3, vocab_size=100, max_output=64, prompt_range=(5, 9))
    assert a == make_workload(20, seed=3, vocab_size=100, max_output=64, prompt_range=(5, 9))
    assert a != make_workload(20, seed=4, vocab_size=100, max_output=64, prompt_range=(5, 9))
    assert all(5 <= len(r.prompt) <= 9 and max(r.prompt) < 100 and 1 <= r.max_tokens <= 64 for r in a)


def test_arrivals_are_poisson_at_the_rate_or_all_at_once():
    offsets = arrival_offsets(4000, 20.0, seed=1)
    assert offsets[0] == 0 and offsets == sorted(offsets)
    assert offsets[-1] / len(offsets) == pytest.approx(1 / 20, rel=0.05)  # mean gap 1/rate
    assert arrival_offsets(3, math.inf, seed=1) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        arrival_offsets(3, 0.0, seed=1)


def test_percentile_is_nearest_rank_and_nan_when_empty():
    assert pct([3.0, 1.0, 2.0], 50) == 2.0
    assert pct(list(map(float, range(101))), 99) == 99.0
    assert math.isnan(pct([], 50))


def test_summary_counts_steps_preemptions_and_utilization_once_nothing_waits():
    trace = [
        StepRecord(0, num_prefill_tokens=40, num_running=2, num_waiting=1, kv_utilization=0.5,
                   forward_time=0.3, step_time=0.4),
        StepRecord(1, num_decode_tokens=2, num_preemptions=1, num_running=3, num_waiting=0, kv_utilization=0.9,
                   forward_time=0.1, step_time=0.1),
        StepRecord(2, num_decode_tokens=1, num_running=1, num_waiting=0, kv_utilization=0.7,
                   forward_time=0.1, step_time=0.1),
    ]
    s = summarize(trace, elapsed=2.0, num_requests=4, prompt_tokens=40, output_tokens=10)
    assert (s["steps"], s["prefill_steps"], s["preemptions"], s["peak_running"]) == (3, 1, 1, 3)
    assert s["output_tokens_per_s"] == 5.0 and s["total_tokens_per_s"] == 25.0 and s["requests_per_s"] == 2.0
    assert s["kv_utilization_mean"] == pytest.approx(0.8) and s["kv_utilization_min"] == 0.7
    assert s["mean_step_ms"] == pytest.approx(200.0) and s["forward_share"] == pytest.approx(5 / 6)


@pytest.mark.slow
def test_bench_throughput_generates_every_requested_token(tmp_path, capsys):
    out = tmp_path / "result.json"
    code = main(["throughput", "--num-requests", "6", "--max-output", "16", "--prompt-len", "8-40",
                 "--max-num-seqs", "4", "--kv-cache-memory-bytes", "8MiB", "--output-json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    wanted = make_workload(6, 0, 49152, 16, (8, 40))
    assert result["output_tokens"] == sum(r.max_tokens for r in wanted)
    assert result["prompt_tokens"] == sum(len(r.prompt) for r in wanted)
    assert result["peak_running"] == 4 and result["steps"] >= max(r.max_tokens for r in wanted)
    assert 0 < result["kv_utilization_min"] <= result["kv_utilization_mean"] <= 1
    assert result["engine"]["max_num_seqs"] == 4 and result["prompt_len"] == [8, 40]
    assert "output tokens/s" in capsys.readouterr().out


def test_bench_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--request-rate", "0"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit):
        main(["throughput", "--prompt-len", "9-3"])
    assert "low <= high" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["throughput", "--model", "/nonexistent.gguf"], "/nonexistent.gguf"),
    (["throughput", "--num-requests", "2", "--prompt-len", "9000"], "maximum context length"),
    (["throughput", "--kv-cache-memory-bytes", "1KiB"], "holds no KV block"),
])
def test_bench_throughput_reports_what_cannot_run_in_one_line(argv, message, capsys):
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err


def test_bench_checks_the_output_path_and_arguments_before_running(tmp_path, capsys):
    for argv in (["serve", "--output-json", str(tmp_path)],
                 ["throughput", "--output-json", str(tmp_path / "missing" / "x.json")],
                 ["serve", "--vocab-size", "0"],
                 ["throughput", "--bogus"]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "cannot write --output-json" in err and "must be > 17" in err
    assert "usage: slipstream bench throughput" in err and "unrecognized arguments: --bogus" in err
