"""Demand and per-pod throughput from cumulative counters (pure): what the capacity policy
(:mod:`slipstream.operator.capacity_policy`) reads at each tick.

Counters only go up, so one reading says nothing; two readings a tick apart say how many
requests finished and how many tokens were processed in between. Arrivals are finished requests
plus the change in requests held (waiting and in flight): requests that arrived but did not
finish are still held, so the sum is the arrival count even while a backlog grows (a
completion count alone reads the throughput, which stops growing exactly when more pods are
needed). A counter that went down was reset (its pod or gateway restarted): that interval is
skipped, not read as negative demand.

A request's size is its tokens over the requests they were counted for ("sized"): the gateway
adds tokens from the usage of answers below 400 (a 429 or a client that left arrives but adds
none), a pod adds a prompt when it first schedules the request, which its TTFT histogram then
counts, and finishes it later. Over the requests finished, every request in flight would read as
extra tokens, and every refusal as fewer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from slipstream.api_types.load import GatewayLoad, PodLoad


@dataclass(frozen=True, slots=True)
class Totals:
    """Cumulative counters at one reading: requests finished, prompt and generated tokens,
    requests held (waiting or in flight; a gauge, not a counter) and requests sized (those the
    token counts are of)."""

    requests: float
    prompt_tokens: float
    generation_tokens: float
    held: float
    sized: float

    def to_list(self) -> list[float]:
        return [self.requests, self.prompt_tokens, self.generation_tokens, self.held, self.sized]


@dataclass(frozen=True, slots=True)
class Interval:
    """What happened between two readings: ``seconds`` long; ``arrivals`` requests arrived,
    ``finished`` finished; ``prompt_tokens`` and ``generation_tokens`` counted, of ``sized``
    requests."""

    seconds: float
    arrivals: float
    finished: float
    prompt_tokens: float
    generation_tokens: float
    sized: float


@dataclass(frozen=True, slots=True)
class PodWork:
    """What the ready pods did between two readings: ``prompt_tokens`` and
    ``generation_tokens`` processed over ``pod_seconds`` (seconds × pods that reported both
    times); TTFT observations ``ttft_total``, of which ``ttft_met`` within the objective."""

    pod_seconds: float
    prompt_tokens: float
    generation_tokens: float
    ttft_met: float
    ttft_total: float


def demand_totals(samples: Sequence[PodLoad], gateway: GatewayLoad | None) -> tuple[str, Totals] | None:
    """(source, totals): the gateway's counters when it exports them (``"gateway"``), else
    the model pods' own, summed (``"pods"``); None when neither has counters.

    Held requests: the gateway's waiting plus in flight when it reports in flight, else the
    pods' waiting and running plus the gateway's waiting. Sized requests: the gateway's answers
    below 400 (all its requests when it does not say), else the pods' TTFT observations (their
    finished requests, for a pod without a TTFT histogram).
    """
    waiting = gateway.waiting if gateway is not None else 0.0
    if gateway is not None and gateway.requests_total is not None and gateway.in_flight is not None:
        answered = gateway.answered_total if gateway.answered_total is not None else gateway.requests_total
        return "gateway", Totals(gateway.requests_total, gateway.prompt_tokens_total or 0.0,
                                 gateway.generation_tokens_total or 0.0, waiting + gateway.in_flight, answered)
    counted = [s for s in samples if s.requests_total is not None]
    if not counted:
        return None
    return "pods", Totals(
        sum(s.requests_total or 0.0 for s in counted),
        sum(s.prompt_tokens_total or 0.0 for s in counted),
        sum(s.generation_tokens_total or 0.0 for s in counted),
        waiting + sum(s.num_requests_waiting + s.num_requests_running for s in counted),
        sum(s.ttft_buckets[-1][1] if s.ttft_buckets else s.requests_total or 0.0 for s in counted))


def interval(before: Totals, after: Totals, seconds: float) -> Interval | None:
    """The :class:`Interval` between two readings ``seconds`` apart; None when a counter went
    down (a restart: the interval cannot be read) or no time passed."""
    finished = after.requests - before.requests
    prompt = after.prompt_tokens - before.prompt_tokens
    generated = after.generation_tokens - before.generation_tokens
    sized = after.sized - before.sized
    if seconds <= 0 or finished < 0 or prompt < 0 or generated < 0 or sized < 0:
        return None
    return Interval(seconds, max(0.0, finished + after.held - before.held), finished, prompt, generated, sized)


def met_within(buckets: Sequence[tuple[float, float]], objective: float) -> tuple[float, float]:
    """(observations ≤ objective, all observations) of a cumulative histogram (``((le,
    count), ...)`` ascending). The largest bucket bound ≤ objective is used, so an objective
    between bounds is read conservatively (fewer met). (0, 0) for an empty histogram."""
    if not buckets:
        return 0.0, 0.0
    met = 0.0
    for le, count in buckets:
        if le <= objective + 1e-12:
            met = count
    return met, buckets[-1][1]


def pod_readings(samples: Sequence[PodLoad], objective: float) -> dict[str, list[float]]:
    """Per pod name: [prompt tokens, generation tokens, TTFT met, TTFT total], cumulative, for
    pods that export the counters (JSON-ready, kept in the policy's state)."""
    readings = {}
    for s in samples:
        if s.prompt_tokens_total is None:
            continue
        met, total = met_within(s.ttft_buckets, objective)
        readings[s.pod] = [s.prompt_tokens_total, s.generation_tokens_total or 0.0, met, total]
    return readings


def pod_work(before: Mapping[str, Sequence[float]], after: Mapping[str, Sequence[float]],
             seconds: float) -> PodWork:
    """The :class:`PodWork` of the pods read at both times (a pod whose counters went down
    restarted and is left out)."""
    pod_seconds = prompt = generated = met = total = 0.0
    for pod, now in after.items():
        then = before.get(pod)
        if then is None or any(b > a for a, b in zip(now, then)):
            continue
        pod_seconds += seconds
        prompt += now[0] - then[0]
        generated += now[1] - then[1]
        met += now[2] - then[2]
        total += now[3] - then[3]
    return PodWork(pod_seconds, prompt, generated, met, total)


def totals_from(data: Any) -> Totals | None:
    """A :class:`Totals` from :meth:`Totals.to_list`'s list (None stays None)."""
    return Totals(*data) if data else None
