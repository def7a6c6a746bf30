"""The fleet as the capacity policy sees it: pods ready, pods starting (and how long ago each
was created), and how long the pods that became ready took (pure).

A pod's start is measured from its ``metadata.creationTimestamp`` to its Ready condition's
``lastTransitionTime`` (scheduling, image pull, model download and load, warm-up: all of it
is time the pod is paid for and does no work).
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, Iterable, Mapping


@dataclass(frozen=True, slots=True)
class Fleet:
    """ready: pods Ready. starting_ages: seconds since each not-yet-Ready pod was created.
    start_seconds: measured starts (created → Ready, seconds) of pods that became Ready
    recently (the policy blends them into its estimate)."""

    ready: int
    starting_ages: tuple[float, ...] = ()
    start_seconds: tuple[float, ...] = ()

    @property
    def starting(self) -> int:
        return len(self.starting_ages)


def epoch_seconds(stamp: str | None) -> float | None:
    """A Kubernetes timestamp (RFC 3339, ``2026-12-06T01:02:03Z``) as epoch seconds; None when
    absent or unreadable."""
    if not stamp:
        return None
    try:
        return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def fleet_from_pods(pods: Iterable[Mapping[str, Any]], now: float, ready_names: Iterable[str],
                    recent_seconds: float = 600.0) -> Fleet:
    """The :class:`Fleet` of Kubernetes Pod objects (dicts) at ``now`` (epoch seconds).

    ready_names: the pods counted ready (``scraper.pod_targets``' targets). Pods being deleted
    or finished count as neither. A ready pod whose Ready transition is within
    ``recent_seconds`` of ``now`` contributes its measured start; pods without timestamps
    contribute nothing but their count.
    """
    ready_set = set(ready_names)
    ready, ages, starts = 0, [], []
    for pod in pods:
        metadata, status = pod.get("metadata") or {}, pod.get("status") or {}
        if metadata.get("deletionTimestamp") or status.get("phase") in ("Succeeded", "Failed"):
            continue
        created = epoch_seconds(metadata.get("creationTimestamp"))
        if metadata.get("name") in ready_set:
            ready += 1
            condition = next((c for c in status.get("conditions") or () if c.get("type") == "Ready"), {})
            became = epoch_seconds(condition.get("lastTransitionTime"))
            if created is not None and became is not None and now - became <= recent_seconds \
                    and became >= created:
                starts.append(became - created)
        else:
            ages.append(max(0.0, now - created) if created is not None else 0.0)
    return Fleet(ready, tuple(ages), tuple(starts))
