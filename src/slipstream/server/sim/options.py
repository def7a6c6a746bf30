"""The ``sim:PROFILE[,key=value...]`` model string of ``slipstream serve`` (pure: no torch, so
the operator reads it too): ``time_scale`` (wall seconds per modelled second), ``output_len``
(N or A-B tokens before EOS), ``seed`` and ``load_seconds`` (how long the simulated model takes
to load). The backend that serves it is :mod:`.backend`."""
from __future__ import annotations

from dataclasses import dataclass

from .cost_model import Profile, get_profile

PREFIX = "sim:"


def is_sim_model(model: str) -> bool:
    return model.startswith(PREFIX)


@dataclass(frozen=True, slots=True)
class SimOptions:
    """A parsed ``sim:`` model string (see the module docstring)."""

    profile: Profile
    time_scale: float = 1.0
    output_len: tuple[int, int] | None = None
    seed: int = 0
    load_seconds: float = 0.0

    @property
    def name(self) -> str:
        return f"sim-{self.profile.name}"


def parse_sim_model(model: str) -> SimOptions:
    """``sim:PROFILE[,key=value...]`` → :class:`SimOptions`.

    Raises ValueError saying what was wrong (unknown profile or key, a bad number).
    """
    if not is_sim_model(model):
        raise ValueError(f"not a simulated model: {model!r} (expected sim:PROFILE)")
    name, *pairs = model[len(PREFIX):].split(",")
    options: dict = {"profile": get_profile(name.strip())}
    for pair in pairs:
        key, sep, value = (part.strip() for part in pair.partition("="))
        try:
            if not sep:
                raise ValueError("expected key=value")
            if key in options:
                raise ValueError("given twice")
            if key == "time_scale":
                options[key] = float(value)
                if not 0 < options[key] < float("inf"):  # inf: steps that never end, a capacity of 0
                    raise ValueError("must be a finite number > 0")
            elif key == "output_len":
                low, _, high = value.partition("-")
                span = (int(low), int(high or low))
                if not 1 <= span[0] <= span[1]:
                    raise ValueError("must be N or A-B with 1 <= A <= B")
                options[key] = span
            elif key == "seed":
                options[key] = int(value)
            elif key == "load_seconds":
                options[key] = float(value)
                if not 0 <= options[key] <= 3600:
                    raise ValueError("must be 0..3600 seconds")
            else:
                raise ValueError("unknown key; use time_scale, output_len, seed or load_seconds")
        except ValueError as exc:
            raise ValueError(f"{model!r}: {pair.strip()!r}: {exc}") from None
    return SimOptions(**options)
