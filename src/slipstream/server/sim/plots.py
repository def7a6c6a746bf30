"""The figures of ``slipstream simulate``, written with matplotlib (PNG): one run's panels, and
``--compare``'s scalers side by side."""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

from .cluster import SimResult


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def arrival_rate(result: SimResult, seconds: float) -> tuple[list[float], list[float]]:
    """(times, arrivals/s over the ``seconds`` before each tick) of ``result``'s ticks."""
    t = [k.time for k in result.ticks]
    window = max(1, round(seconds / (t[1] - t[0]))) if len(t) > 1 else 1
    arrivals = [k.arrivals for k in result.ticks]
    return t, [sum(arrivals[max(0, i - window + 1):i + 1]) / (t[i] - t[max(0, i - window)] or 1)
               for i in range(len(t))]


def ttft_by_window(result: SimResult, seconds: float, quantile: float) -> tuple[list[float], list[float]]:
    """(window ends, TTFT quantile in seconds of the requests that arrived in each ``seconds``
    window; NaN for a window without any)."""
    end = result.end_time
    edges = [seconds * i for i in range(int(end // seconds) + 2)]
    values = [result.ttft_percentiles(a, b, (quantile,))[0] for a, b in zip(edges, edges[1:])]
    return edges[1:], [v if v is not None else float("nan") for v in values]


def plot(result: SimResult, path: Path, title: str) -> None:
    """Four panels over time: replicas and arrival rate, queue depth, KV use, TTFT p50/p99."""
    plt = _pyplot()
    t = [k.time for k in result.ticks]
    fig, axes = plt.subplots(4, 1, figsize=(10, 11), sharex=True)
    axes[0].step(t, [k.desired for k in result.ticks], where="post", label="desired")
    axes[0].step(t, [k.ready for k in result.ticks], where="post", label="ready")
    axes[0].set_ylabel("replicas")
    rate = axes[0].twinx()
    rate.plot(*arrival_rate(result, 10.0), color="grey", alpha=0.6, label="arrivals/s")
    rate.set_ylabel("arrivals/s")
    axes[0].legend(loc="upper left")
    axes[1].plot(t, [k.queue_depth for k in result.ticks])
    axes[1].set_ylabel("queue depth")
    axes[2].plot(t, [100 * k.kv_cache_utilization for k in result.ticks])
    axes[2].set_ylabel("KV cache % (mean)")
    for q, label in ((0.5, "p50"), (0.99, "p99")):
        values = [result.ttft_percentiles(a, b, (q,))[0] for a, b in zip([0.0] + t, t)]
        axes[3].plot(t, [v if v is not None else float("nan") for v in values], label=label)
    axes[3].set_ylabel("TTFT (s)")
    axes[3].set_yscale("log")
    axes[3].legend(loc="upper left")
    axes[3].set_xlabel("time (s)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def compare_plot(results: Mapping[str, SimResult], names: Sequence[str], path: Path, title: str,
                 objective: float, window: float = 60.0) -> None:
    """Three panels over time for the runs ``names`` of ``results`` (``--compare``'s rows): the
    arrival rate (per ``window`` seconds), each run's replicas (ready solid, ready + starting
    dashed) and each run's TTFT p90 per ``window`` (log scale) against the ``objective``
    (seconds)."""
    plt = _pyplot()
    fig, axes = plt.subplots(3, 1, figsize=(13, 7.5), sharex=True)
    first = results[names[0]]
    axes[0].plot(*arrival_rate(first, window), color="grey")
    axes[0].set_ylabel(f"arrivals/s ({window:g} s)")
    for i, name in enumerate(names):
        result, color = results[name], f"C{i}"
        t = [k.time for k in result.ticks]
        axes[1].step(t, [k.ready for k in result.ticks], where="post", color=color, label=f"{name} ready")
        axes[1].step(t, [k.ready + k.starting for k in result.ticks], where="post", color=color,
                     linestyle="--", alpha=0.7, label=f"{name} ready + starting")
        p90 = result.ttft_percentiles(quantiles=(0.9,))[0]
        hours = result.replica_seconds / 3600
        axes[2].plot(*ttft_by_window(result, window, 0.9), color=color, marker=".",
                     label=f"{name}: run p90 {p90:.2f} s, {hours:.2f} replica-h")
    axes[1].set_ylabel("replicas")
    axes[1].legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    axes[2].axhline(objective, color="black", linestyle=":", label=f"objective {objective:g} s")
    axes[2].set_yscale("log")
    axes[2].set_ylabel(f"TTFT p90 per {window:g} s (s)")
    axes[2].legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    axes[2].set_xlabel("time (s)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
