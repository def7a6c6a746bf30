"""The argparse checkers every command shares: what each accepts and what it says otherwise."""
from __future__ import annotations

import argparse
import math

import pytest

from slipstream.server import cli_types as t


@pytest.mark.parametrize("check, text, want", [
    (t.positive_int, "3", 3), (t.int_at_least(0), "0", 0), (t.non_negative_float, "inf", math.inf),
    (t.finite_non_negative_float, "0", 0.0), (t.positive_float, "0.5", 0.5), (t.fraction, "1", 1.0),
    (t.port, "65535", 65535), (t.non_negative_int, "0", 0), (t.listen_port, "0", 0),
])
def test_accepted_values(check, text, want):
    assert check(text) == want


@pytest.mark.parametrize("check, text, says", [
    (t.positive_int, "0", "must be >= 1, got 0"), (t.positive_int, "x", "must be an integer, got 'x'"),
    (t.int_at_least(2), "1", "must be >= 2"), (t.non_negative_float, "-1", "must be >= 0"),
    (t.non_negative_float, "nan", "must be >= 0"), (t.finite_non_negative_float, "inf", "finite"),
    (t.positive_float, "0", "must be > 0"), (t.fraction, "1.5", "(0, 1]"), (t.fraction, "y", "a number"),
    (t.port, "70000", "must be a TCP port (1 to 65535), got 70000"), (t.port, "0", "TCP port"),
    (t.non_negative_int, "-1", "must be >= 0"), (t.listen_port, "65536", "0: any free one"),
])
def test_refused_values_say_what_the_value_must_be(check, text, says):
    with pytest.raises(argparse.ArgumentTypeError, match=None) as caught:
        check(text)
    assert says in str(caught.value)


@pytest.mark.parametrize("argv, says", [
    (["--node-rank", "2", "--nnodes", "2", "--pipeline-parallel-size", "2", "--master-port", "29500"],
     "--node-rank 2 is not a node of --nnodes 2 (0 to 1)"),
    (["--node-rank", "-1"], "--node-rank: must be >= 0, got -1"),
    (["--master-port", "70000"], "--master-port: must be a TCP port (1 to 65535), got 70000"),
    (["--master-port", "8000", "--port", "8000", "-tp", "2"], "--master-port 8000 is also --port"),
])
def test_serve_refuses_a_parallel_layout_that_cannot_run_before_loading_anything(argv, says, capsys):
    from slipstream.server.cli import main

    with pytest.raises(SystemExit) as caught:
        main(["serve", *argv])
    assert says in f"{caught.value.code} {capsys.readouterr().err}"
