"""The clairvoyant lower bound of ``slipstream simulate --compare``: per minute, the fewest
replicas that meet the TTFT objective knowing that minute's arrivals in advance.

Each minute's arrivals are played alone on n ready replicas, for n = 1, 2, … until the p90 TTFT
of that minute's requests is within the objective (or n reaches the maximum). A minute starts
with no backlog, so each count is at most what a real schedule would need there: the counts are
a lower bound on any policy's replicas. :class:`~.scalers.ScheduleScaler` then plays the whole
trace with them, each count asked for one start time ahead of its minute, which prices the
bound in replica-hours (start times included) and shows what it does when backlogs carry over.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Sequence

from .cluster import Cluster, SimResult
from .trace import Arrival

MINUTE = 60.0


def p90_ttft(result: SimResult) -> float | None:
    """The 90th-percentile TTFT (seconds) of the run's requests; None when none had a first token."""
    return result.ttft_percentiles(quantiles=(0.9,))[0]


def by_minute(arrivals: Sequence[Arrival], minute: float = MINUTE) -> list[list[Arrival]]:
    """``arrivals`` (seconds from 0) split into minutes, each minute's times from its own start
    (to be played alone); one list per minute up to the last arrival's, empty where none came."""
    if not arrivals:
        return []
    minutes: list[list[Arrival]] = [[] for _ in range(int(max(a.time for a in arrivals) // minute) + 1)]
    for a in arrivals:
        m = int(a.time // minute)
        minutes[m].append(replace(a, time=a.time - m * minute))
    return minutes


def minute_counts(arrivals: Sequence[Arrival], fixed: Callable[[int], Cluster], objective: float,
                  most: int, least: int = 1, minute: float = MINUTE) -> list[int]:
    """Per minute of ``arrivals`` (seconds from 0), the fewest replicas in [least, most] whose run
    of that minute alone has a TTFT p90 ≤ ``objective`` seconds (``most`` when none does; ``least``
    for a minute without arrivals). fixed(n): a cluster that keeps n ready replicas."""
    counts = []
    for shifted in by_minute(arrivals, minute):
        count = least
        if shifted:
            while count < most:
                p90 = p90_ttft(fixed(count).run(shifted, minute))
                if p90 is not None and p90 <= objective:
                    break
                count += 1
        counts.append(count)
    return counts
