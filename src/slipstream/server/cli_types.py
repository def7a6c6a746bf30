"""argparse ``type=`` checkers shared by the commands (serve, gateway, bench, simulate): each
turns the flag's text into a number or raises ``argparse.ArgumentTypeError`` saying what the value
must be, which argparse prints after the flag's name."""
from __future__ import annotations

import argparse
import math
from typing import Callable, TypeVar

T = TypeVar("T")


def parsed_by(parse: Callable[[str], T]) -> Callable[[str], T]:
    """``parse`` as an argparse ``type=``: the ValueError it raises becomes the flag's one-line
    error with its own message (argparse alone says only "invalid <function name> value")."""
    def checked(text: str) -> T:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return checked


def _number(text: str, kind: type) -> int | float:
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {'an integer' if kind is int else 'a number'}, "
                                         f"got {text!r}") from None


def int_at_least(low: int) -> Callable[[str], int]:
    """An integer ≥ ``low``."""
    def parse(text: str) -> int:
        value = _number(text, int)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value
    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def non_blank(text: str) -> str:
    """A non-blank name (a served model's, a tenant's), as given."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"must be a non-blank name, got {text!r}")
    return text


def port(text: str) -> int:
    """A TCP port, 1 to 65535."""
    value = _number(text, int)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port (1 to 65535), got {value}")
    return value


def listen_port(text: str) -> int:
    """A TCP port to listen on, 0 (any free one) to 65535."""
    value = _number(text, int)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port (0 to 65535; 0: any free one), got {value}")
    return value


def non_negative_float(text: str) -> float:
    """A number ≥ 0 (infinity allowed)."""
    value = _number(text, float)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def finite_non_negative_float(text: str) -> float:
    """A finite number ≥ 0."""
    value = non_negative_float(text)
    if value == math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def positive_float(text: str) -> float:
    """A number > 0 (infinity allowed)."""
    value = _number(text, float)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def fraction(text: str) -> float:
    """A number in (0, 1]."""
    value = _number(text, float)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def tenant_weights(text: str) -> dict[str, float]:
    """``NAME=WEIGHT,...`` (:func:`~slipstream.api_types.tenancy.parse_tenant_weights`)."""
    from slipstream.api_types.tenancy import parse_tenant_weights
    return parsed_by(parse_tenant_weights)(text)


def tenant_token_limits(text: str) -> dict[str, int]:
    """``NAME=TOKENS_PER_MINUTE,...`` (:func:`~slipstream.api_types.tenancy.parse_tenant_token_limits`)."""
    from slipstream.api_types.tenancy import parse_tenant_token_limits
    return parsed_by(parse_tenant_token_limits)(text)
