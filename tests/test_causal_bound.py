"""benchmarks/causal_bound.py: its exact minimum against every schedule of small tables, so the
bounds in benchmarks/README.md ("Autoscaling") rest on a checked search."""
from __future__ import annotations

import itertools
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import causal_bound as cb  # noqa: E402


def brute_force(misses, budget, overlap=None, ends=None):
    minutes, most = len(misses), len(misses[0])
    overlap = overlap or [0.0] * minutes
    ends = ends or [None] * minutes
    best = None
    for schedule in itertools.product(range(1, most + 1), repeat=minutes):
        if sum(misses[m][n - 1] for m, n in enumerate(schedule)) <= budget:
            paid = cb.paid_seconds(list(schedule), overlap, ends)
            best = paid if best is None else min(best, paid)
    return best


def table(rng, minutes, most):
    rows = []
    for _ in range(minutes):
        late = sorted((rng.randint(0, 9) for _ in range(most)), reverse=True)
        rows.append(late)
    return rows


@pytest.mark.parametrize("seed", range(12))
def test_the_foresight_bound_is_the_cheapest_schedule_within_the_budget(seed):
    rng = random.Random(seed)
    misses = table(rng, 5, 3)
    budget = sum(row[-1] for row in misses) + rng.randint(0, 20)  # the most pods everywhere fit it
    expected = brute_force(misses, budget)
    paid, schedule = cb.bound(misses, budget)
    assert paid == pytest.approx(expected)
    assert cb.paid_seconds(schedule, [0.0] * 5, [None] * 5) == pytest.approx(paid)
    assert sum(misses[m][n - 1] for m, n in enumerate(schedule)) <= budget


@pytest.mark.parametrize("seed", range(12))
def test_a_lull_is_paid_at_the_count_of_the_minute_it_ends_in(seed):
    rng = random.Random(100 + seed)
    misses = table(rng, 6, 3)
    misses[1] = misses[2] = [0, 0, 0]  # no arrivals inside the lull
    gaps = [(50.0, 190.0)]  # ends in minute 3, covering 10 s of minute 0 and minutes 1-2
    overlap, ends = cb.lull_overlap(gaps, 6)
    assert overlap[:4] == [10.0, 60.0, 60.0, 0.0] and ends[:4] == [3, 3, 3, None]
    budget = sum(row[-1] for row in misses) + rng.randint(0, 20)
    expected = brute_force(misses, budget, overlap, ends)
    paid, schedule = cb.bound(misses, budget, overlap, ends)
    assert paid == pytest.approx(expected)
    assert cb.paid_seconds(schedule, overlap, ends) == pytest.approx(paid)


def test_holding_through_a_lull_costs_the_burst_after_it():
    # one pod is enough everywhere but minute 3, which needs 3; the lull before it (minutes 1-2)
    # is paid at 3 without foresight of its end, at 1 with it (only minute 2 pays 3: the start)
    misses = [[0, 0, 0], [0, 0, 0], [0, 0, 0], [9, 9, 0], [0, 0, 0]]
    overlap, ends = cb.lull_overlap([(30.0, 185.0)], 5)
    foresight, _ = cb.bound(misses, 0)
    blind, _ = cb.bound(misses, 0, overlap, ends)
    assert foresight == 60 * (1 + 1 + 3 + 3 + 1)
    assert blind == 30 * 1 + 30 * 3 + 60 * 3 + 60 * 3 + 60 * 3 + 60 * 1


def test_no_foresight_of_a_minute_deals_counts_without_regard_to_need():
    # two busy minutes, one needing 2 pods and one needing 1: not knowing which is which, both
    # must get 2 when nothing may be late (with foresight: 2 + 1)
    misses = [[5, 0], [0, 0]]
    paid, given = cb.blind_bound(misses, [10, 10], 0, [0.0, 0.0], [None, None])
    assert paid == 60 * 4 and given["other"] == {2: 2}
    # with 2.5 late allowed on average, one minute may get 1 pod (mean misses at 1 pod: 2.5)
    paid, given = cb.blind_bound(misses, [10, 10], 3, [0.0, 0.0], [None, None])
    assert paid == 60 * 3 and given["other"] == {1: 1, 2: 1}


@pytest.mark.parametrize("argv", [["--trace", "{tmp}/missing.txt"], ["--trace", "{tmp}/empty.txt"],
                                  ["--rate", "0rps for 60s"], ["--time-scale", "0.5"],
                                  ["--max-replicas", "0"]])
def test_a_bad_input_is_one_line_and_exit_2(argv, tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("")
    assert cb.main([a.format(tmp=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("causal_bound.py: ") and "\n" not in err


def test_no_schedule_within_the_budget_is_an_error_not_an_index():
    # 3 late at best (one pod too few in minute 0, whatever the count), 2 allowed
    with pytest.raises(ValueError, match="no schedule"):
        cb.bound([[5, 3], [0, 0]], 2)
    with pytest.raises(ValueError, match="no schedule"):
        cb.bound([[5, 3], [0, 0]], 2, [0.0, 0.0], [None, None])


def test_an_objective_no_count_meets_is_one_line_and_exit_1(tmp_path, capsys):
    trace = tmp_path / "three.txt"
    trace.write_text("0.5 100 10\n1.0 200 20\n30.0 300 30\n")
    assert cb.main(["--trace", str(trace), "--ttft-p90-objective", "0.000001", "--max-replicas", "2"]) == 1
    captured = capsys.readouterr()
    assert "fixed-2" in captured.out and "Traceback" not in captured.err
    err = captured.err.strip()
    assert err.startswith("causal_bound.py: no schedule of 1 … 2 replicas") and "\n" not in err


def test_a_trace_too_short_for_correlations_still_prints_its_table(tmp_path, capsys):
    # one busy minute: no pair of busy minutes to correlate
    trace = tmp_path / "three.txt"
    trace.write_text("0.5 100 10\n1.0 200 20\n30.0 300 30\n")
    assert cb.main(["--trace", str(trace), "--max-replicas", "3"]) == 0
    out = capsys.readouterr().out
    assert "bound: foresight" in out
    assert "need 1 minute(s) before: r = undefined (too few pairs, or a need that does not vary) (0 pairs)" in out


@pytest.mark.parametrize("most", [1, 2, 3])
def test_the_causal_rules_include_every_floor_up_to_the_most(most):
    # a floor of most is the fixed count most, a rule that sees only the past: with --max-replicas
    # 2 the rules were none at all ("none of 0 causal rules meets") where fixed 2 met
    rules = list(cb.quantile_rules([1, 1, 1], [10, 10, 10], most))
    floors = {int(params.split("floor=")[1].split()[0]) for params, _ in rules}
    assert rules and floors == set(range(1, most + 1))
    assert [most] * 3 in [schedule for _, schedule in rules]


def test_an_unknown_flag_is_named_as_this_scripts_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        cb.main(["--bogus"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: causal_bound.py ") and "causal_bound.py: error: unrecognized arguments: --bogus" in err
