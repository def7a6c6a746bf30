"""Arrival traces for ``slipstream simulate``: a rate schedule turned into seeded Poisson arrivals,
or a file of arrivals.

Rate schedule: comma-separated phases ``RATE rps for DURATION`` (durations in ``s``, ``m`` or
``h``), e.g. ``10rps for 60s, 40rps for 2m, 5rps for 300s``. Within a phase arrivals are a
Poisson process of that rate (exponential gaps), the usual open-loop model of independent users.

Trace file: one arrival per line, ``TIME [PROMPT_TOKENS [OUTPUT_TOKENS]]`` (seconds from the
start; whitespace or commas between fields; ``#`` starts a comment; a header line of words is
skipped); missing token counts are drawn from the defaults. Arrivals from either carry no token
content (each is a distinct prompt); :mod:`.workloads` makes arrivals that do.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

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
    """One request: when it arrives (seconds from the start), its lengths in tokens, and its
    token content (None: a prompt that shares no prefix with any other)."""

    time: float
    prompt_tokens: int
    output_tokens: int
    content: Content | None = None


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


def read_trace(path: str | Path, prompt_tokens: tuple[int, int], output_tokens: tuple[int, int],
               seed: int = 0) -> list[Arrival]:
    """Arrivals from a trace file (see the module docstring), sorted by time.

    Raises ValueError with the line number of a line that does not parse.
    """
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
            if time < 0 or prompt < 1 or output < 1 or len(fields) > 3:
                raise ValueError
        except ValueError:
            raise ValueError(f"{path}:{number}: expected 'TIME [PROMPT_TOKENS [OUTPUT_TOKENS]]' with "
                             f"TIME >= 0 and counts >= 1, got {line.strip()!r}") from None
        arrivals.append(Arrival(time, prompt, output))
    return sorted(arrivals, key=lambda a: a.time)
