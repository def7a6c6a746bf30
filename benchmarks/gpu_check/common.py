"""What the stage scripts share: a JSON result written after every step, and token comparison."""
from __future__ import annotations

import json
import os
from pathlib import Path


class Recorder:
    """A stage's result dict, rewritten to ``path`` (atomically) on every :meth:`set`, so a stage
    killed by its timeout still leaves everything it finished."""

    def __init__(self, path: Path | None, **fields):
        self.path, self.data = path, dict(fields)
        self.flush()

    def set(self, key: str, value) -> None:
        self.data[key] = value
        self.flush()

    def flush(self) -> None:
        if self.path is None:
            return
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.path)


def first_divergence(got: list[int], want: list[int]) -> int | None:
    """Index of the first token where ``got`` and ``want`` differ (a length difference counts at the
    shorter one's end); None when equal."""
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return i
    return None if len(got) == len(want) else min(len(got), len(want))


def median(values: list[float]) -> float | None:
    if not values:
        return None
    s = sorted(values)
    mid = len(s) // 2
    return float(s[mid]) if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def compare(got: list[list[int]], want: list[list[int]], max_tokens: int) -> dict:
    """Per-prompt first divergence and its median; a prompt that never diverges counts as
    ``max_tokens`` in the median (so the median says how far greedy decoding agrees)."""
    firsts = [first_divergence(g, w) for g, w in zip(got, want)]
    return {"equal": all(f is None for f in firsts), "first_divergence": firsts,
            "median_first_divergence": median([max_tokens if f is None else f for f in firsts]),
            "prompts_equal": sum(f is None for f in firsts), "prompts": len(firsts)}
