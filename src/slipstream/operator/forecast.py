"""A short-horizon forecast of the arrival rate (pure): Holt's linear exponential smoothing
over evenly spaced bins of the recent intervals.

Source: C. C. Holt, "Forecasting seasonals and trends by exponentially weighted moving
averages" (1957; reprinted in International Journal of Forecasting 20(1), 2004), the level +
trend recursion; R. J. Hyndman and G. Athanasopoulos, "Forecasting: Principles and Practice"
(3rd ed.), section 8.2.
"""
from __future__ import annotations

from typing import Sequence


def holt(series: Sequence[float], alpha: float, beta: float, steps: float) -> float:
    """Holt's forecast ``steps`` bins past the last value of ``series`` (any unit; the result is
    in the same unit, never below 0). Level ℓ and trend b: ℓ_t = α y_t + (1 − α)(ℓ_{t−1} +
    b_{t−1}), b_t = β (ℓ_t − ℓ_{t−1}) + (1 − β) b_{t−1}; forecast ℓ + steps × b. Starts from
    ℓ = y_0, b = 0. 0.0 for an empty series. alpha, beta in (0, 1]."""
    if not series:
        return 0.0
    level, trend = series[0], 0.0
    for y in series[1:]:
        previous = level
        level = alpha * y + (1 - alpha) * (level + trend)
        trend = beta * (level - previous) + (1 - beta) * trend
    return max(0.0, level + steps * trend)


def binned_rate(intervals: Sequence[tuple[float, ...]], now: float, span: float, width: float) -> list[float]:
    """Arrivals/s in bins of ``width`` seconds covering the ``span`` seconds up to ``now``
    (oldest first), from intervals ``(end, arrivals, ..., seconds)`` (index 5: seconds); an
    interval counts in the bin holding its end. Bins before the first interval are left out."""
    bins = int(round(span / width))
    counts, seen = [0.0] * bins, [0.0] * bins
    for i in intervals:
        k = bins - 1 - int((now - i[0]) // width)
        if 0 <= k < bins:
            counts[k] += i[1]
            seen[k] += i[5]
    first = next((k for k, s in enumerate(seen) if s > 0), bins)
    return [c / width for c in counts[first:]]
