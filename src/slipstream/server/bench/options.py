"""Options and output shared by the ``slipstream bench`` subcommands."""
from __future__ import annotations

import argparse
import errno
import json
import math
import os

from .workload import parse_range
from ..cli_types import parsed_by, positive_int


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """``--num-requests``, ``--workload-seed``, ``--prompt-len``, ``--max-output`` and
    ``--output-json``: the arguments of :func:`.workload.make_workload` plus where to save."""
    w = p.add_argument_group("workload (random token-id prompts, heavy-tailed forced output lengths)")
    w.add_argument("--num-requests", type=positive_int, default=32, help="how many requests")
    w.add_argument("--workload-seed", type=int, default=0, help="the same seed draws the same workload")
    w.add_argument("--prompt-len", type=parsed_by(parse_range), default=(32, 256), metavar="MIN-MAX",
                   help="prompt length in tokens, uniform in MIN-MAX, or one length (default: 32-256)")
    w.add_argument("--max-output", type=positive_int, default=512,
                   help="cap on the output lengths drawn from 16, 32, …, 512 tokens (EOS ignored)")
    p.add_argument("--output-json", metavar="FILE", help="also write the results to FILE as JSON")


def workload_settings(args: argparse.Namespace) -> dict:
    """The workload arguments, for the JSON results: enough to draw the same workload again."""
    return {"num_requests": args.num_requests, "workload_seed": args.workload_seed,
            "prompt_len": list(args.prompt_len), "max_output": args.max_output}


def check_writable(path: str | None) -> None:
    """Raise OSError now, not after a long run, when ``path`` cannot be written; None passes."""
    if not path:
        return
    if os.path.isdir(path):
        raise IsADirectoryError(errno.EISDIR, "is a directory", path)
    with open(path, "a"):
        pass


def write_json(path: str | None, result: dict) -> None:
    """Write ``result`` to ``path`` (NaN as null); nothing when ``path`` is None."""
    if path:
        clean = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in result.items()}
        with open(path, "w") as f:
            json.dump(clean, f, indent=2)
            f.write("\n")
