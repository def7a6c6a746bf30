"""Seeded workloads with real token content, for ``slipstream simulate`` and the routing benchmark.

``prefix_groups``: the workload where prefix-cache-aware routing matters (llm-d's and AIBrix's
benchmarks have this shape). Users fall into ``groups``; every prompt of a group starts with the
group's system prompt of ``prefix_tokens`` tokens. Each user holds a session of ``turns`` turns:
a turn's prompt is the system prompt, every earlier turn's user message and reply, then a new
user message of ``turn_tokens`` tokens, so each turn extends the previous one. Sessions start as
a Poisson process at ``rate / turns`` per second (so requests arrive at about ``rate``), each in a
uniformly drawn group; a session's next turn follows its previous one after an exponential think
time. Token ids are drawn uniformly from ``token_range`` by a generator seeded with the piece's
name (``seed``, group, session, turn), so every process derives the same ids for the same
arrival: the simulator feeds them to its replicas, a benchmark sends them to real pods as token-id
prompts (``arrival.content.prompt_ids()``, ``max_tokens = arrival.output_tokens``,
``user = arrival.content.session_key``).
"""
from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from typing import Sequence

from .trace import Arrival, Phase

# Ids inside every vocabulary the sim pods use (SmolLM2's 49,152) and clear of its special ids.
DEFAULT_TOKEN_RANGE = (1000, 30000)


@functools.lru_cache(maxsize=8192)
def _tokens(name: str, count: int, low: int, high: int) -> tuple[int, ...]:
    """``count`` ids uniform in [low, high) from a generator seeded by ``name`` (a str seed goes
    through SHA-512, so it is the same in every process, unlike ``hash(str)``)."""
    return tuple(random.Random(name).choices(range(low, high), k=count))


@dataclass(frozen=True, slots=True)
class PrefixGroups:
    """The shape of a prefix-groups workload (token counts; seconds). Raises ValueError for a
    count below 1 (``turn_tokens`` and ``think_time`` may be 0) or an empty ``token_range``."""

    groups: int = 32
    prefix_tokens: int = 4096
    turn_tokens: int = 64
    turns: int = 4
    output_tokens: int = 128
    think_time: float = 10.0
    token_range: tuple[int, int] = DEFAULT_TOKEN_RANGE

    def __post_init__(self) -> None:
        for name in ("groups", "prefix_tokens", "turns", "output_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"prefix-groups workload: {name} must be >= 1, got {getattr(self, name)}")
        if self.turn_tokens < 0 or self.think_time < 0:
            raise ValueError(f"prefix-groups workload: turn_tokens and think_time must be >= 0, "
                             f"got {self.turn_tokens}, {self.think_time}")
        if not 0 <= self.token_range[0] < self.token_range[1]:
            raise ValueError(f"prefix-groups workload: token_range must be LOW < HIGH, got {self.token_range}")

    def prompt_tokens(self, turn: int) -> int:
        """Length of turn ``turn``'s prompt (turns count from 0)."""
        return self.prefix_tokens + turn * (self.turn_tokens + self.output_tokens) + self.turn_tokens

    def arrivals(self, phases: Sequence[Phase], seed: int = 0) -> list[Arrival]:
        """Seeded arrivals over the phases (see the module docstring), sorted by time; turns
        that would come after the last phase ends are not sent."""
        rng = random.Random(seed)
        end = sum(p.duration for p in phases)
        arrivals: list[Arrival] = []
        session, start = 0, 0.0
        for phase in phases:
            t = start
            while phase.rate > 0:
                t += rng.expovariate(phase.rate / self.turns)
                if t >= start + phase.duration:
                    break
                group, when = rng.randrange(self.groups), t
                for turn in range(self.turns):
                    if turn:
                        when += rng.expovariate(1 / self.think_time) if self.think_time > 0 else 0.0
                    if when >= end:
                        break
                    arrivals.append(Arrival(when, self.prompt_tokens(turn), self.output_tokens,
                                            Turn(self, seed, group, session, turn)))
                session += 1
            start += phase.duration
        return sorted(arrivals, key=lambda a: a.time)


@dataclass(frozen=True, slots=True)
class Turn:
    """One request of a prefix-groups workload: its token ids, derived when asked for."""

    workload: PrefixGroups
    seed: int
    group: int
    session: int
    turn: int

    @property
    def session_key(self) -> str:
        """What a client sends as ``user`` (session affinity), the same for every turn."""
        return f"{self.seed}-{self.session}"

    def _piece(self, kind: str, turn: int, count: int) -> tuple[int, ...]:
        return _tokens(f"{self.seed}/{kind}/{self.session}/{turn}", count, *self.workload.token_range)

    def prompt_ids(self) -> list[int]:
        """System prompt + earlier turns (user message and reply each) + this turn's message."""
        w = self.workload
        ids = list(_tokens(f"{self.seed}/prefix/{self.group}", w.prefix_tokens, *w.token_range))
        for turn in range(self.turn):
            ids += self._piece("user", turn, w.turn_tokens)
            ids += self._piece("reply", turn, w.output_tokens)
        ids += self._piece("user", self.turn, w.turn_tokens)
        return ids

    def reply_ids(self) -> list[int]:
        """The reply this turn gets (``output_tokens`` ids); the next turn's prompt repeats it."""
        return list(self._piece("reply", self.turn, self.workload.output_tokens))


def prefix_groups(groups: int = 32, prefix_tokens: int = 4096, turn_tokens: int = 64, turns: int = 4,
                  output_tokens: int = 128, rate: float = 10.0, duration: float = 60.0, seed: int = 0,
                  think_time: float = 10.0, token_range: tuple[int, int] = DEFAULT_TOKEN_RANGE) -> list[Arrival]:
    """A prefix-groups workload at ``rate`` requests/s for ``duration`` seconds (see the module
    docstring); arrivals carry :class:`Turn` content. Raises ValueError for bad counts."""
    if rate < 0 or duration <= 0:
        raise ValueError(f"prefix-groups workload: rate must be >= 0 and duration > 0, got {rate}, {duration}")
    workload = PrefixGroups(groups, prefix_tokens, turn_tokens, turns, output_tokens, think_time, token_range)
    return workload.arrivals([Phase(rate, duration)], seed)


def distinct_prompt(serial: int, count: int) -> list[int]:
    """A prompt of ``count`` tokens that shares no full block with another serial's: the serial
    leads, so every chained block hash differs (arrivals without content)."""
    return [serial] + [0] * (count - 1)
