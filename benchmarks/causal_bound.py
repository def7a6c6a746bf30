"""Lower bounds on the replica-hours of a schedule that meets a TTFT p90 objective, by what the
schedule may know of the future (issue 33: is 0.85 × the cheapest fixed count reachable by a
policy that sees only the past?).

Usage: ``python benchmarks/causal_bound.py SIMULATE_ARGS`` (``slipstream simulate``'s trace,
profile and objective flags), e.g. ``python benchmarks/causal_bound.py --trace
../shared/traces/azure-llm-2023-code.csv --max-output-tokens 512 --profile llama3-8b-l4
--ttft-p90-objective 8 --max-replicas 10`` (about a minute). Not part of ``make test``; the
numbers are in benchmarks/README.md ("What a policy without foresight can reach on L4").

The model is the clairvoyant row's (:mod:`slipstream.server.sim.clairvoyant`): each minute's
arrivals played alone on n ready replicas, n = 1 … ``--max-replicas``, starting with no backlog;
``misses[m][n - 1]`` counts minute m's requests whose TTFT is past the objective there. A
schedule gives minute m ``n[m]`` ready replicas; a pod takes ``--startup-delay`` (the issue's
60 s: one minute) to start and is paid for while it starts, so minute m pays ``max(n[m],
n[m+1])`` pods. The objective holds when the misses add up to at most a tenth of the requests
(nearest-rank p90). Rows, after the fixed counts and the clairvoyant's per-minute counts:

* **bound: foresight** — any schedule: the exact minimum (dynamic programming over minutes ×
  misses) of the pod-minutes paid. Below the clairvoyant's counts: it spends the tenth of late
  requests where that saves most.
* **bound: no foresight of a lull's end** — a lull is a gap between arrivals longer than a
  pod's start; a policy that sees only the past cannot tell, while no request arrives, whether
  the next comes in a second or in three minutes, so if it does not add pods while nothing
  arrives, the pods ready when a lull ends were paid for through the whole lull. The same exact
  minimum with each lull's part of a minute paid at the count of the minute the lull ends in.
* **bound: no foresight of a minute** — a policy decides minute m's count when minute m - 1
  begins (a start ahead), from minutes ≤ m - 2. Where a minute's need is not predictable from
  those (the correlations printed last), its count is independent of its need except through
  what is known: whether a lull ends in it. Counts dealt at random within those two groups
  cost each minute its group's mean misses; the fewest pod-seconds whose expected misses stay
  within the tenth (lulls paid as above, starts ahead not paid).
* **bound: one bit, minute m-L needed 1 pod** — the same with one bit of the past known a
  start ahead as well (whether minute m - L, L = 2 or 3, was quiet enough for one pod): the
  groups split on it. It prices what the negative correlations are worth to a policy that bets
  on them; still an expectation over which minutes of a group get which count.
* **best of N rules …** — schedules from the past only, tuned on the very trace they are
  scored on: the cheapest that meets, of two families (:func:`quantile_rules`, sizing up after
  heavy minutes; :func:`threshold_rules`, one count after heavy minutes and one after light ones,
  which can bet on a heavy minute being followed by a lighter one), and, where none meets, the
  one with the fewest late requests of a third (:func:`learned_level_rules`, which learn their
  level from the minutes seen, as a policy starting cold must, where the fixed counts and the
  other rules' floors are picked for the whole trace).

Each bound takes the minute-alone misses, without backlogs carried between minutes, so it is at
most what the same schedule pays in the full simulation (the clairvoyant row of ``--compare``
shows carried backlogs making the per-minute counts miss overall).
"""
from __future__ import annotations

import math
import statistics
import sys

import numpy as np

from slipstream.server import simulate
from slipstream.server.sim.clairvoyant import MINUTE, by_minute

INF = math.inf


def minute_misses(played, make, objective: float, most: int) -> tuple[list[list[int]], list[int]]:
    """``misses[m][n - 1]``: minute m's requests with TTFT > ``objective`` (or none) when played
    alone on n replicas (:func:`~slipstream.server.sim.clairvoyant.by_minute`, as the clairvoyant
    row plays them); and the requests in each minute."""
    misses, sizes = [], []
    for these in by_minute(played):
        row = []
        for n in range(1, most + 1):
            if row and row[-1] == 0:
                row.append(0)
                continue
            result = make(n).run(these, MINUTE) if these else None
            row.append(0 if result is None else sum(1 for r in result.requests if r.ttft is None or r.ttft > objective))
        misses.append(row)
        sizes.append(len(these))
    return misses, sizes


def late(misses: list[list[int]], schedule: list[int]) -> int:
    """Requests past the objective under ``schedule`` (replicas per minute)."""
    return sum(misses[m][n - 1] for m, n in enumerate(schedule))


def lulls(times: list[float], longer_than: float) -> list[tuple[float, float]]:
    """Gaps (start, end) between consecutive arrivals longer than ``longer_than`` seconds."""
    return [(a, b) for a, b in zip(times, times[1:]) if b - a > longer_than]


def lull_overlap(gaps: list[tuple[float, float]], minutes: int) -> tuple[list[float], list[int | None]]:
    """Per minute: seconds of it inside a lull, and the minute in which that lull ends (None
    outside lulls). Lulls are longer than a minute, so a minute holds at most the end of one and
    the start of the next; the one it overlaps more is kept (the other's part is under a minute
    apart: a lower bound either way)."""
    overlap, ends = [0.0] * minutes, [None] * minutes
    for a, b in gaps:
        end_minute = int(b // MINUTE)
        for m in range(int(a // MINUTE), end_minute + 1):
            seconds = max(0.0, min(b, (m + 1) * MINUTE) - max(a, m * MINUTE))
            if m == end_minute or seconds <= overlap[m]:
                continue  # the end minute pays its own count for its lull part anyway
            overlap[m], ends[m] = seconds, end_minute
    return overlap, ends


def bound(misses: list[list[int]], budget: int, overlap: list[float] | None = None,
          ends: list[int | None] | None = None) -> tuple[float, list[int]]:
    """The fewest pod-seconds of a schedule (n[m] in 1..len(misses[m])) whose misses add up to
    at most ``budget``, minute m paying ``max(n[m], n[m+1])`` pods and, for its ``overlap[m]``
    seconds in a lull ending in minute ``ends[m]``, ``max(n[m], n[m+1], n[ends[m]])``. Returns
    (pod-seconds, the schedule). Dynamic programming backwards over minutes: the state is the
    next minute's count, the count of the minute that the lull the previous minute is in ends
    in (0: none), and the misses of the minutes after."""
    most, minutes = len(misses[0]), len(misses)
    overlap = overlap or [0.0] * minutes
    ends = ends or [None] * minutes
    best: dict[tuple[int, int], np.ndarray] = {(0, 0): np.zeros(budget + 1)}
    steps = []  # per minute (backwards): state -> (count, the later state) per misses used
    for m in range(minutes - 1, -1, -1):
        nxt: dict[tuple[int, int], np.ndarray] = {}
        step: dict[tuple[int, int], list[np.ndarray]] = {}
        for later, future in best.items():
            next_n, floor = later
            for n in range(1, most + 1):
                late = misses[m][n - 1]
                if late > budget:
                    continue
                paid = max(n, next_n) * (MINUTE - overlap[m]) + max(n, next_n, floor) * overlap[m]
                if m == 0 or ends[m - 1] is None:
                    key = (n, 0)
                elif ends[m - 1] == m:
                    key = (n, n)
                else:  # minute m lies inside the same lull
                    key = (n, floor)
                total = np.full(budget + 1, INF)
                total[late:] = future[:budget + 1 - late] + paid
                if key not in nxt:
                    nxt[key] = total
                    step[key] = [np.full(budget + 1, n), np.full(budget + 1, 0, dtype=object)]
                    step[key][1][:] = [later] * (budget + 1)
                    continue
                better = total < nxt[key]
                nxt[key][better] = total[better]
                step[key][0][better] = n
                for i in np.flatnonzero(better):
                    step[key][1][i] = later
        best = nxt
        steps.append(step)
    key, used = min(((k, int(np.argmin(v))) for k, v in best.items()), key=lambda kv: best[kv[0]][kv[1]],
                    default=(None, 0))
    total = INF if key is None else float(best[key][used])
    if total == INF:
        raise ValueError(f"no schedule of 1 … {most} replicas a minute keeps the misses within {budget}")
    schedule = []
    for step in reversed(steps):  # minute 0 first
        n, later = int(step[key][0][used]), step[key][1][used]
        schedule.append(n)
        used -= misses[len(schedule) - 1][n - 1]
        key = later
    return total, schedule


def paid_seconds(schedule: list[int], overlap: list[float], ends: list[int | None]) -> float:
    """Pod-seconds of ``schedule`` by the rule :func:`bound` minimizes (to check it)."""
    total = 0.0
    for m, n in enumerate(schedule):
        after = schedule[m + 1] if m + 1 < len(schedule) else 0
        floor = schedule[ends[m]] if ends[m] is not None else 0
        total += max(n, after) * (MINUTE - overlap[m]) + max(n, after, floor) * overlap[m]
    return total


def pareto(options: list[tuple[float, float, dict]]) -> list[tuple[float, float, dict]]:
    """The options (misses, paid, what) that no other beats on both: by misses, each cheaper."""
    front: list[tuple[float, float, dict]] = []
    for option in sorted(options, key=lambda o: o[:2]):
        if not front or option[1] < front[-1][1]:
            front.append(option)
    return front


def blind_bound(misses: list[list[int]], sizes: list[int], budget: int, overlap: list[float],
                ends: list[int | None], known: list[bool] | None = None,
                ) -> tuple[float, dict[str, dict[int, int]]]:
    """The fewest pod-seconds when a busy minute's count cannot depend on that minute's own need,
    only on what is known of it: whether a lull ends in it and, when given, ``known[m]`` (one bit
    of the past). Within each group counts are dealt at random, so a count k costs each minute of
    the group the group's mean misses at k, and the expected misses must stay within ``budget``.
    A minute pays its count for its own seconds and, where a lull ends in it, for that lull (the
    lull's count is its end minute's, as in :func:`bound`); no start ahead is paid. Two counts per
    group suffice (the mean misses fall with k): every pair and split is tried, and the groups are
    joined on their Pareto fronts. Returns (pod-seconds, {group: {count: minutes}}); math.inf when
    no dealing fits."""
    lull_seconds = [0.0] * len(misses)
    for m, end in enumerate(ends):
        if end is not None:
            lull_seconds[end] += overlap[m]
    most = len(misses[0])
    groups: dict[str, list[int]] = {}
    for m in range(len(misses)):
        if sizes[m]:
            name = "after a lull" if lull_seconds[m] else "other"
            if known is not None:
                name += ", bit set" if known[m] else ", bit clear"
            groups.setdefault(name, []).append(m)
    joined: list[tuple[float, float, dict]] = [(0.0, 0.0, {})]
    for name, group in groups.items():
        weight = sum(MINUTE - overlap[m] + lull_seconds[m] for m in group) / len(group)
        mean = [sum(misses[m][k - 1] for m in group) / len(group) for k in range(1, most + 1)]
        options = pareto([
            ((len(group) - more) * mean[low - 1] + more * mean[high - 1],
             ((len(group) - more) * low + more * high) * weight,
             {k: v for k, v in ((low, len(group) - more), (high, more)) if v})
            for low in range(1, most + 1) for high in range(low, most + 1)
            for more in (range(len(group) + 1) if high > low else (0,))])
        joined = pareto([(late + l2, paid + p2, {**given, name: g2}) for late, paid, given in joined
                         for l2, p2, g2 in options if late + l2 <= budget + 1e-9])
    if not joined:
        return math.inf, {}
    _, paid, given = min(joined, key=lambda o: o[1])
    return paid, given


def need(misses: list[list[int]], sizes: list[int]) -> list[int]:
    """Per minute, the fewest replicas that keep its own p90 within the objective (at most a
    tenth of its requests late): the clairvoyant row's counts."""
    return [next((n for n, late in enumerate(row, 1) if late <= 0.1 * size), len(row))
            for row, size in zip(misses, sizes)]


def quantile_rules(sizes: list[int], tokens: list[int], most: int):
    """Schedules that size up after heavy minutes, by their parameters. The count for minute m is
    decided when minute m - 1 begins (a start ahead), from minutes ≤ m - 2: ``lull`` pods when
    minute m - 2 had no arrival, else the larger of ``floor`` and the ``q``-quantile of the last
    ``w`` known minutes' prompt tokens ÷ ``per_pod`` (tokens one pod serves in a minute within
    the objective), at most ``most``; ``floor`` before any minute is known."""
    for w in range(1, 11):
        for q in (0.5, 0.75, 0.9, 1.0):
            for per_pod in (round(20_000 * 1.5 ** k) for k in range(13)):  # 20k … 2.6M tokens/minute
                for floor in range(1, most + 1):
                    for lull in range(1, most + 1):
                        schedule = []
                        for m in range(len(sizes)):
                            known = sorted(tokens[max(0, m - 1 - w):max(0, m - 1)])
                            if m >= 2 and sizes[m - 2] == 0:
                                schedule.append(lull)
                            elif not known:
                                schedule.append(floor)
                            else:
                                top = known[min(len(known) - 1, max(0, math.ceil(q * len(known)) - 1))]
                                schedule.append(min(most, max(floor, math.ceil(top / per_pod))))
                        yield f"w={w} q={q} per_pod={per_pod} floor={floor} lull={lull}", schedule


def threshold_rules(sizes: list[int], tokens: list[int], most: int):
    """Schedules with one count after a heavy minute and another after a light one, either way
    round (so a policy may bet on a heavy minute being followed by a lighter one, as the
    correlations suggest): minute m gets ``heavy`` pods when minute m - ``lag`` (2 or 3: known a
    start ahead) had more prompt tokens than ``over``, else ``light``; ``lull`` when it had no
    arrival; ``light`` before any is known. ``over``: the 5%, 10%, … 95% points of the busy
    minutes' prompt tokens."""
    busy = sorted(t for t, size in zip(tokens, sizes) if size)
    points = sorted({busy[len(busy) * i // 20] for i in range(1, 20)}) if busy else [0]
    for lag in (2, 3):
        for over in points:
            for heavy in range(1, most + 1):
                for light in range(1, most + 1):
                    for lull in range(1, most + 1):
                        schedule = []
                        for m in range(len(sizes)):
                            if m < lag:
                                schedule.append(light)
                            elif sizes[m - lag] == 0:
                                schedule.append(lull)
                            else:
                                schedule.append(heavy if tokens[m - lag] > over else light)
                        yield f"lag={lag} over={over} heavy={heavy} light={light} lull={lull}", schedule


def learned_level_rules(misses: list[list[int]], sizes: list[int]):
    """Schedules that learn their level from what they have seen, with a perfect model of it:
    minute m gets the fewest pods that would have kept the last ``w`` known minutes (≤ m - 2)
    within ``1 - target`` late, by the minute-alone misses themselves; ``first`` until a known
    minute had arrivals. No hindsight of the level (which fixed counts and the rules' floors
    have: each is picked for the whole trace)."""
    most = len(misses[0])
    for w in (5, 10, 15, 20, 30, 45, 60):
        for target in (0.9, 0.92, 0.94, 0.96):
            for first in (1, 3, 5, 8):
                schedule = []
                for m in range(len(sizes)):
                    seen = range(max(0, m - 1 - w), max(0, m - 1))
                    arrived = sum(sizes[i] for i in seen)
                    if not arrived:
                        schedule.append(min(first, most))
                        continue
                    schedule.append(next((n for n in range(1, most + 1)
                                          if sum(misses[i][n - 1] for i in seen) <= (1 - target) * arrived), most))
                yield f"w={w} target={target} first={first}", schedule


def main(argv: list[str]) -> int:
    parser = simulate.parser()
    parser.prog = "causal_bound.py"  # its errors are this script's, not slipstream simulate's
    args = parser.parse_args(argv + ["--no-plot"])
    try:
        played, spec = arrivals(args)
    except (ValueError, OSError) as exc:  # a bad flag, schedule or trace file: one line, as simulate says it
        print(f"causal_bound.py: {exc}", file=sys.stderr)
        return 2
    return report(args, played, spec)


def arrivals(args):
    """The capped arrivals ``args`` ask for and their autoscaling spec. Raises ValueError (or
    OSError) for a bad flag, schedule or trace, and for a workload with no arrivals."""
    simulate.check_args(args)
    played, _, _ = simulate.capped_arrivals(args)
    if not played:
        raise ValueError("no arrivals to bound (a longer --rate, or a trace with rows)")
    return played, simulate.autoscaling_spec(args).model_copy(update={"enabled": False})


def report(args, played, spec) -> int:
    """The table of main()."""
    objective, most = spec.objectives.ttft_p90_seconds, spec.max_replicas
    misses, sizes = minute_misses(played, lambda n: simulate.cluster(args, spec, initial=n), objective, most)
    minutes, requests = len(misses), len(played)
    budget = requests - math.ceil(0.9 * requests)  # nearest-rank p90: this many may miss
    gaps = lulls([a.time for a in played], args.startup_delay)
    overlap, ends = lull_overlap(gaps, minutes)
    none = ([0.0] * minutes, [None] * minutes)

    def row(name: str, schedule: list[int], where=none) -> None:
        missed = late(misses, schedule)
        print(f"{name:<44} {paid_seconds(schedule, *where) / 3600:9.2f} {missed:5d} "
              f"{'yes' if missed <= budget else 'no':>4}  {' '.join(map(str, schedule))}")

    def blind_row(name: str, known: list[bool] | None = None) -> None:
        paid, given = blind_bound(misses, sizes, budget, overlap, ends, known)
        if paid == INF:  # the group means miss more than the budget at every count (misses not falling with n)
            print(f"{name:<44} {'-':>9} {'':>5} {'no':>4}  no counts dealt without regard to need keep the "
                  f"expected misses within {budget}")
        else:
            print(f"{name:<44} {paid / 3600:9.2f} {'':>5} {'':>4}  busy minutes: "
                  + "; ".join(f"{group}: " + ", ".join(f"{v} at {k}" for k, v in sorted(c.items()))
                              for group, c in given.items()))

    print(f"{requests} requests in {minutes} minutes; at most {budget} may miss the {objective:g} s objective; "
          f"{len(gaps)} lulls longer than a {args.startup_delay:g} s start, {sum(b - a for a, b in gaps):.0f} s")
    print(f"{'schedule (minute model)':<44} {'replica_h':>9} {'late':>5} {'met':>4}  per-minute replicas")
    for n in range(1, most + 1):
        row(f"fixed-{n}", [n] * minutes)
        if sum(r[n - 1] for r in misses) <= budget:
            break
    counts = need(misses, sizes)
    row("clairvoyant (each minute's own p90)", counts)
    fewest = sum(min(r) for r in misses)
    if fewest > budget:  # nothing meets: the bounds below have no schedule to find
        print(f"causal_bound.py: no schedule of 1 … {most} replicas a minute meets the {objective:g} s objective "
              f"({fewest} of {requests} late at best, {budget} allowed): raise --max-replicas or loosen "
              f"--ttft-p90-objective", file=sys.stderr)
        return 1
    _, schedule = bound(misses, budget)
    row("bound: foresight", schedule)
    _, schedule = bound(misses, budget, overlap, ends)
    row("bound: no foresight of a lull's end", schedule, (overlap, ends))
    blind_row("bound: no foresight of a minute")
    for lag in (2, 3):  # one bit known a start ahead: the minute lag before was quiet (needed 1 pod)
        blind_row(f"bound: one bit, minute m-{lag} needed 1 pod",
                  [m >= lag and sizes[m - lag] > 0 and counts[m - lag] <= 1 for m in range(minutes)])
    tokens = [0] * minutes
    for a in played:
        tokens[int(a.time // MINUTE)] += a.prompt_tokens
    families = (("sizing up after heavy minutes", lambda: quantile_rules(sizes, tokens, most)),
                ("a count after heavy and one after light minutes", lambda: threshold_rules(sizes, tokens, most)),
                ("learning their level from the past", lambda: learned_level_rules(misses, sizes)))
    for family, rules in families:
        tried, cheapest, closest = 0, None, None
        for params, schedule in rules():
            tried += 1
            missed, paid = late(misses, schedule), paid_seconds(schedule, *none)
            if missed <= budget and (cheapest is None or paid < cheapest[0]):
                cheapest = (paid, params, schedule)
            if closest is None or (missed, paid) < closest[0]:
                closest = ((missed, paid), params, schedule)
        if closest is None:
            print(f"no rules {family} for this run")
        elif cheapest is None:
            row(f"none of {tried} rules {family} meets; fewest late ({closest[1]})", closest[2])
        else:
            row(f"best of {tried} rules {family} ({cheapest[1]})", cheapest[2])
    busy = [m for m in range(minutes) if sizes[m]]
    for lag in (1, 2, 3):
        pairs = [(counts[m], counts[m - lag]) for m in busy if m >= lag and sizes[m - lag]]
        try:
            r = f"{statistics.correlation(*zip(*pairs)):+.2f}" if len(pairs) >= 2 else None
        except statistics.StatisticsError:  # a need that does not vary
            r = None
        print(f"a busy minute's need against the need {lag} minute(s) before: r = "
              f"{r or 'undefined (too few pairs, or a need that does not vary)'} ({len(pairs)} pairs)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
