"""Arrival traces for ``slipstream simulate``: a rate schedule turned into seeded Poisson arrivals,
or a file of arrivals.

Rate schedule: comma-separated phases ``RATE rps for DURATION`` (durations in ``s``, ``m`` or
``h``), e.g. ``10rps for 60s, 40rps for 2m, 5rps for 300s``. Within a phase arrivals are a
Poisson process of that rate (exponential gaps), the usual open-loop model of independent users.

Trace file: one arrival per line, ``TIME [PROMPT_TOKENS [OUTPUT_TOKENS]]`` (seconds from the
start; whitespace or commas between fields; ``#`` starts a comment; a header line of words is
skipped); missing token counts are drawn from the defaults. Or the Azure LLM inference trace's
CSV (header ``TIMESTAMP,ContextTokens,GeneratedTokens``, timestamps like ``2023-11-16
18:17:03.9799600``; Patel et al., "Splitwise", ISCA 2024), read by its header: times become
seconds from its first request. Arrivals from either carry no token content (each is a distinct
prompt); :mod:`.workloads` makes arrivals that do.

:func:`scale_times` stretches or compresses a trace in time; :func:`cap_lengths` fits requests
to a model's context.
"""
from __future__ import annotations

import csv
import datetime
import math
import random
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

from slipstream.api_types.tenancy import DEFAULT_TENANT, parse_tenant_weights

_PHASE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:rps|/s)\s+for\s+(\d+(?:\.\d+)?)\s*(s|m|h)?\s*$", re.IGNORECASE)
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


@dataclass(frozen=True, slots=True)
class Phase:
    """``rate`` requests per second for ``duration`` seconds."""

    rate: float
    duration: float


class Content(Protocol):
    """A request's token content (e.g. :class:`.workloads.Turn`).

    prompt_ids(): the prompt's token ids (``prompt_tokens`` of them). reply_ids(): the output
    tokens the request produces (a later turn's prompt repeats them). session_key: the session
    it belongs to (a client's ``user``), or None.
    """

    @property
    def session_key(self) -> str | None: ...

    def prompt_ids(self) -> list[int]: ...

    def reply_ids(self) -> list[int]: ...


@dataclass(frozen=True, slots=True)
class Arrival:
    """One request: when it arrives (seconds from the start), its lengths in tokens, its token
    content (None: a prompt that shares no prefix with any other) and its tenant."""

    time: float
    prompt_tokens: int
    output_tokens: int
    content: Content | None = None
    tenant: str = DEFAULT_TENANT


def parse_rate_schedule(text: str) -> list[Phase]:
    """``"10rps for 60s, 40rps for 2m"`` → phases. Raises ValueError naming the bad phase."""
    phases = []
    for part in text.split(","):
        match = _PHASE.match(part)
        if not match:
            raise ValueError(f"rate schedule: cannot read {part.strip()!r}; write phases like "
                             f"'10rps for 60s, 40rps for 2m'")
        rate, duration = float(match.group(1)), float(match.group(2)) * _UNITS[(match.group(3) or "s").lower()]
        if duration <= 0:
            raise ValueError(f"rate schedule: {part.strip()!r} lasts no time")
        phases.append(Phase(rate, duration))
    return phases


def parse_length(text: str) -> tuple[int, int]:
    """``"256"`` → (256, 256); ``"64-1024"`` → (64, 1024), a uniform range of token counts."""
    low, _, high = text.partition("-")
    try:
        span = (int(low), int(high or low))
    except ValueError:
        raise ValueError(f"token count must be N or A-B, got {text!r}") from None
    if not 1 <= span[0] <= span[1]:
        raise ValueError(f"token count must be N or A-B with 1 <= A <= B, got {text!r}")
    return span


def poisson_arrivals(phases: list[Phase], prompt_tokens: tuple[int, int], output_tokens: tuple[int, int],
                     seed: int = 0) -> list[Arrival]:
    """Seeded Poisson arrivals over the phases, with token counts uniform in the given ranges."""
    rng = random.Random(seed)
    arrivals: list[Arrival] = []
    start = 0.0
    for phase in phases:
        t = start
        while phase.rate > 0:
            t += rng.expovariate(phase.rate)
            if t >= start + phase.duration:
                break
            arrivals.append(Arrival(t, rng.randint(*prompt_tokens), rng.randint(*output_tokens)))
        start += phase.duration
    return arrivals


AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


def _is_azure_header(header: str) -> bool:
    """The header line names :data:`AZURE_COLUMNS` (any order and case, more columns allowed)."""
    return {c.strip().lower() for c in header.lstrip("\ufeff").split(",")} >= {c.lower() for c in AZURE_COLUMNS}


def read_azure_csv(path: str | Path) -> list[Arrival]:
    """Arrivals of an Azure LLM inference trace CSV (columns :data:`AZURE_COLUMNS`, in any
    order or case; a UTF-8 byte-order mark is skipped), times in seconds from the first request,
    sorted. A generated count of 0 becomes 1 (a request makes at least one token). Raises
    ValueError naming the line of a row that does not parse."""
    arrivals, first = [], None
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f)
        header = [c.strip().lower() for c in next(reader, [])]
        try:
            at = [header.index(c.lower()) for c in AZURE_COLUMNS]
        except ValueError:
            raise ValueError(f"{path}:1: expected a header with {','.join(AZURE_COLUMNS)}, got {header}") from None
        for number, row in enumerate(reader, 2):
            try:
                stamp, context, generated = (row[i] for i in at)
                # Seven fractional digits: fromisoformat (3.11+) takes them; strptime's %f does not.
                when = datetime.datetime.fromisoformat(stamp.strip()).timestamp()
                prompt, output = int(context), int(generated)
                if prompt < 1 or output < 0:
                    raise ValueError
            except (ValueError, TypeError, IndexError):
                raise ValueError(f"{path}:{number}: expected TIMESTAMP,ContextTokens,GeneratedTokens with "
                                 f"counts >= 1 and >= 0, got {row}") from None
            first = when if first is None else min(first, when)
            arrivals.append((when, prompt, max(1, output)))
    return sorted((Arrival(when - first, prompt, output) for when, prompt, output in arrivals),
                  key=lambda a: a.time)


def scale_times(arrivals: list[Arrival], factor: float) -> list[Arrival]:
    """Every arrival time × ``factor`` (0.5: the same requests in half the time, twice the rate).
    Raises ValueError unless factor > 0 and the times stay finite."""
    if not 0 < factor < math.inf or (arrivals and not math.isfinite(arrivals[-1].time * factor)):
        raise ValueError(f"time scale must be a number > 0 that keeps the times finite, got {factor}")
    return arrivals if factor == 1 else [replace(a, time=a.time * factor) for a in arrivals]


def cap_lengths(arrivals: list[Arrival], max_model_len: int, max_output_tokens: int | None = None,
                ) -> tuple[list[Arrival], int]:
    """(arrivals, how many were changed): outputs cut to ``max_output_tokens`` (None: kept), then
    requests longer than ``max_model_len`` tokens in all cut to fit it, the prompt first (its
    tail is dropped, as a client truncating its context would), keeping at least one token of
    each. Raises ValueError for max_model_len < 2."""
    if max_model_len < 2:
        raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
    capped, changed = [], 0
    for a in arrivals:
        output = min(a.output_tokens, max_output_tokens) if max_output_tokens else a.output_tokens
        output = min(output, max_model_len - 1)
        prompt = min(a.prompt_tokens, max_model_len - output)
        if (prompt, output) != (a.prompt_tokens, a.output_tokens):
            changed += 1
            a = replace(a, prompt_tokens=prompt, output_tokens=output)
        capped.append(a)
    return capped, changed


def read_trace(path: str | Path, prompt_tokens: tuple[int, int], output_tokens: tuple[int, int],
               seed: int = 0) -> list[Arrival]:
    """Arrivals from a trace file (see the module docstring: either format, told apart by the
    Azure CSV's header), sorted by time.

    Raises ValueError with the line number of a line that does not parse, or naming a file that
    is not UTF-8 text or has no arrivals.
    """
    try:
        arrivals = _read_trace(path, prompt_tokens, output_tokens, seed)
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not a text trace (byte {exc.start} is not UTF-8)") from None
    if not arrivals:
        raise ValueError(f"{path}: no arrivals (expected lines of 'TIME [PROMPT_TOKENS [OUTPUT_TOKENS]]' "
                         f"or the Azure CSV's rows)")
    return arrivals


def _read_trace(path: str | Path, prompt_tokens: tuple[int, int], output_tokens: tuple[int, int],
                seed: int) -> list[Arrival]:
    with open(path, encoding="utf-8-sig") as f:
        header = f.readline()
    if _is_azure_header(header):
        return read_azure_csv(path)
    rng = random.Random(seed)
    arrivals = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        fields = line.split("#", 1)[0].replace(",", " ").split()
        if not fields or (number == 1 and not fields[0][0].isdigit()):
            continue
        try:
            time = float(fields[0])
            prompt = int(fields[1]) if len(fields) > 1 else rng.randint(*prompt_tokens)
            output = int(fields[2]) if len(fields) > 2 else rng.randint(*output_tokens)
            if not 0 <= time < math.inf or prompt < 1 or output < 1 or len(fields) > 3:
                raise ValueError
        except ValueError:
            raise ValueError(f"{path}:{number}: expected 'TIME [PROMPT_TOKENS [OUTPUT_TOKENS]]' with "
                             f"TIME >= 0 and counts >= 1, got {line.strip()!r}") from None
        arrivals.append(Arrival(time, prompt, output))
    return sorted(arrivals, key=lambda a: a.time)


def parse_tenant_shares(text: str) -> dict[str, float]:
    """``"batch=0.9,chat=0.1"`` → each tenant's share of the arrivals (normalized to sum 1).

    Raises:
        ValueError: not ``NAME=SHARE`` items with shares > 0, or a name twice.
    """
    shares = parse_tenant_weights(text)
    if not shares:
        raise ValueError("--tenants needs at least one NAME=SHARE")
    total = sum(shares.values())
    return {name: share / total for name, share in shares.items()}


def assign_tenants(arrivals: list[Arrival], shares: dict[str, float], seed: int = 0) -> list[Arrival]:
    """``arrivals`` with each one's tenant drawn (seeded) in proportion to ``shares``."""
    rng = random.Random(f"tenants-{seed}")
    names, weights = list(shares), list(shares.values())
    return [replace(a, tenant=rng.choices(names, weights)[0]) for a in arrivals]
