"""The argparse checkers every command shares: what each accepts and what it says otherwise."""
from __future__ import annotations

import argparse
import math

import pytest

from slipstream.server import cli_types as t


@pytest.mark.parametrize("check, text, want", [
    (t.positive_int, "3", 3), (t.int_at_least(0), "0", 0), (t.non_negative_float, "inf", math.inf),
    (t.finite_non_negative_float, "0", 0.0), (t.positive_float, "0.5", 0.5), (t.fraction, "1", 1.0),
])
def test_accepted_values(check, text, want):
    assert check(text) == want


@pytest.mark.parametrize("check, text, says", [
    (t.positive_int, "0", "must be >= 1, got 0"), (t.positive_int, "x", "must be an integer, got 'x'"),
    (t.int_at_least(2), "1", "must be >= 2"), (t.non_negative_float, "-1", "must be >= 0"),
    (t.non_negative_float, "nan", "must be >= 0"), (t.finite_non_negative_float, "inf", "finite"),
    (t.positive_float, "0", "must be > 0"), (t.fraction, "1.5", "(0, 1]"), (t.fraction, "y", "a number"),
])
def test_refused_values_say_what_the_value_must_be(check, text, says):
    with pytest.raises(argparse.ArgumentTypeError, match=None) as caught:
        check(text)
    assert says in str(caught.value)
