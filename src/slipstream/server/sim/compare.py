"""The numbers of a simulated run and the rows of ``slipstream simulate --compare`` (pure but
for the runs themselves): the same arrivals under the operator's policies, the HPA algorithm,
fixed counts and the clairvoyant schedule, by row name."""
from __future__ import annotations

from typing import Any, Callable, Sequence

from slipstream.api_types.autoscaling import POLICIES as SCALING_POLICIES, AutoscalingSpec

from .clairvoyant import minute_counts
from .cluster import Cluster, SimResult
from .scalers import HPAScaler, Scaler, ScheduleScaler
from .trace import Arrival

# (spec, scaler or None for the spec's own policy, initial replicas or None for minReplicas) -> cluster
MakeCluster = Callable[[AutoscalingSpec, "Scaler | None", "int | None"], Cluster]


def numbers(result: SimResult, objective: float) -> dict[str, Any]:
    """The run's numbers (``--json``): requests, finished, TTFT p50/p90/p99 (seconds),
    replica_hours (pods paid for, starting included), peak_replicas (ready and starting pods at
    once), objective_attainment (share of requests whose TTFT ≤ ``objective``; the p90 objective
    holds at ≥ 0.9), objective_met, scale_events."""
    p50, p90, p99 = result.ttft_percentiles(quantiles=(0.5, 0.9, 0.99))
    ttfts = [r.ttft for r in result.requests if r.ttft is not None]
    return {
        "requests": len(result.requests),
        "finished": sum(r.finished is not None for r in result.requests),
        "ttft_p50_s": p50, "ttft_p90_s": p90, "ttft_p99_s": p99,
        "replica_hours": round(result.replica_seconds / 3600, 4),
        "peak_replicas": max((max(k.ready + k.starting, k.desired) for k in result.ticks), default=0),
        "objective_ttft_p90_s": objective,
        "objective_attainment": (sum(t <= objective for t in ttfts) / len(result.requests)
                                 if result.requests else None),
        "objective_met": p90 is not None and p90 <= objective,
        "scale_events": len(result.scalings),
    }


def tenant_numbers(result: SimResult) -> dict[str, dict[str, Any]]:
    """Per tenant: requests, TTFT p50/p90 (seconds) and tokens served (prompt + output of its
    finished requests)."""
    rows: dict[str, dict[str, Any]] = {}
    for name in sorted({r.tenant for r in result.requests}):
        mine = [r for r in result.requests if r.tenant == name]
        ttfts = sorted(r.ttft for r in mine if r.ttft is not None)
        pick = (lambda q: ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))] if ttfts else None)
        rows[name] = {"requests": len(mine), "ttft_p50_s": pick(0.5), "ttft_p90_s": pick(0.9),
                      "tokens_served": sum(r.prompt_tokens + r.output_tokens for r in mine if r.finished is not None)}
    return rows


def compare_results(played: Sequence[Arrival], duration: float | None, spec: AutoscalingSpec, make: MakeCluster,
                    start_seconds: float) -> tuple[dict[str, SimResult], list[int], float]:
    """``simulate --compare``: ``played`` (until ``duration`` seconds, None: the last arrival)
    under each scaler: (results by row name, the clairvoyant per-minute counts, the TTFT p90
    objective in seconds). make(spec, scaler, initial): a cluster of the run's replicas and
    routing; start_seconds: a pod's start (the clairvoyant asks that far ahead).

    Rows: each ``spec.autoscaling.policy``, ``hpa-queue`` (:class:`~.scalers.HPAScaler`),
    ``fixed-N``, ``clairvoyant`` (:mod:`.clairvoyant`) and ``clairvoyant+K``.

    Fixed counts go up from ``minReplicas`` to the first that meets the objective (a fixed
    count's replica-hours grow with it, so that one is the cheapest that does), at most
    ``maxReplicas``. When the clairvoyant schedule misses the objective over the whole run
    (backlogs carried between minutes), ``clairvoyant+K`` rows add K pods to every minute, K =
    1, 2, … until one meets it.
    """
    spec = spec.model_copy(update={"enabled": True})
    objective = spec.objectives.ttft_p90_seconds
    rows: dict[str, SimResult] = {}
    for policy in SCALING_POLICIES:
        rows[policy] = make(spec.model_copy(update={"policy": policy}), None, None).run(played, duration)
    rows["hpa-queue"] = make(spec, HPAScaler(spec), None).run(played, duration)
    fixed_spec = spec.model_copy(update={"enabled": False})
    for n in range(max(1, spec.min_replicas), spec.max_replicas + 1):
        rows[f"fixed-{n}"] = make(fixed_spec, None, n).run(played, duration)
        if met(rows[f"fixed-{n}"], objective):
            break
    counts = minute_counts(played, lambda n: make(fixed_spec, None, n), objective, spec.max_replicas,
                           max(1, spec.min_replicas))
    schedule = ScheduleScaler(counts, start_seconds)
    rows["clairvoyant"] = make(spec, schedule, schedule.wanted(0.0)).run(played, duration)
    # backlogs carried between minutes can make the schedule miss overall: then the fewest pods
    # added to every minute that make it meet (a schedule that does meet, to price the targets)
    last = rows["clairvoyant"]
    for more in range(1, spec.max_replicas - min(counts, default=spec.max_replicas) + 1):
        if met(last, objective):
            break
        schedule = ScheduleScaler([min(spec.max_replicas, c + more) for c in counts], start_seconds)
        last = rows[f"clairvoyant+{more}"] = make(spec, schedule, schedule.wanted(0.0)).run(played, duration)
    return rows, counts, objective


def met(result: SimResult, objective: float) -> bool:
    """Whether the run's TTFT p90 is within ``objective`` seconds."""
    p90 = result.ttft_percentiles(quantiles=(0.9,))[0]
    return p90 is not None and p90 <= objective


def compare_rows(results: dict[str, SimResult], counts: list[int], objective: float) -> dict[str, dict[str, Any]]:
    """:func:`compare_results`' runs as numbers by row name (see :func:`numbers`), each with its
    tenants' (:func:`tenant_numbers`) when the arrivals have several."""
    rows = {}
    for name, result in results.items():
        row = numbers(result, objective)
        tenants = tenant_numbers(result)
        if len(tenants) > 1:
            row["tenants"] = tenants
        if name == "clairvoyant":
            row["minute_counts"] = counts
        rows[name] = row
    return rows


def best_fixed(rows: dict[str, dict[str, Any]]) -> str | None:
    """The name of the cheapest ``fixed-N`` row that met the objective (None: none did)."""
    meeting = [name for name, row in rows.items() if name.startswith("fixed-") and row["objective_met"]]
    return min(meeting, key=lambda name: rows[name]["replica_hours"]) if meeting else None


def compare_table(rows: dict[str, dict[str, Any]]) -> str:
    """One line per row of :func:`compare_rows`: attainment, TTFT p50/p90/p99, replica-hours,
    peak, scale events, and whether the objective was met."""
    lines = [f"{'scaler':<13} {'attain%':>7} {'ttft_p50_ms':>11} {'ttft_p90_ms':>11} {'ttft_p99_ms':>11} "
             f"{'replica_h':>9} {'peak':>4} {'scalings':>8} {'met':>3}"]
    for name, row in rows.items():
        attained = row["objective_attainment"]
        lines.append(f"{name:<13} {'-' if attained is None else f'{100 * attained:.1f}':>7} "
                     f"{ms(row['ttft_p50_s']):>11} {ms(row['ttft_p90_s']):>11} {ms(row['ttft_p99_s']):>11} "
                     f"{row['replica_hours']:9.2f} {row['peak_replicas']:4d} {row['scale_events']:8d} "
                     f"{'yes' if row['objective_met'] else 'no':>3}")
    tenants = sorted({t for row in rows.values() for t in row.get("tenants", {})})
    if tenants:
        lines.append(f"{'tenant p90 ms':<13} " + " ".join(f"{t:>11}" for t in tenants))
        lines += [f"{name:<13} " + " ".join(f"{ms(row['tenants'][t]['ttft_p90_s']):>11}" for t in tenants)
                  for name, row in rows.items()]
    return "\n".join(lines)


def ms(value: float | None) -> str:
    """Seconds as whole milliseconds, '-' for None."""
    return "-" if value is None else f"{value * 1000:.0f}"
