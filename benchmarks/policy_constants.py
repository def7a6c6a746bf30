"""What-if runs of the capacity policy's constants: ``slipstream simulate`` with module
constants of :mod:`slipstream.operator.capacity_policy` set for one run, one line of numbers.

Usage: ``python benchmarks/policy_constants.py [NAME=VALUE ...] -- SIMULATE_ARGS``, e.g.
``python benchmarks/policy_constants.py HEADROOM=0.1 -- --trace ../shared/traces/azure-llm-2023-code.csv
--max-output-tokens 512 --ttft-p90-objective 1``. Runs ``--policy capacity`` without a plot; prints
the constants, replica-hours, peak replicas, TTFT p90 (s), attainment and whether the objective
was met. How the tuning in benchmarks/README.md ("Autoscaling on the Azure code trace") was
measured; not part of ``make test``.
"""
from __future__ import annotations

import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path

from slipstream.operator import capacity_policy
from slipstream.server import simulate


def main(argv: list[str]) -> int:
    if "--" not in argv:
        print(__doc__, file=sys.stderr)
        return 2
    split = argv.index("--")
    for pair in argv[:split]:
        name, _, value = pair.partition("=")
        if not hasattr(capacity_policy, name):
            print(f"capacity_policy has no constant {name!r}", file=sys.stderr)
            return 2
        setattr(capacity_policy, name, type(getattr(capacity_policy, name))(float(value)))
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "run.json"
        with contextlib.redirect_stdout(io.StringIO()):
            code = simulate.main(argv[split + 1:] + ["--no-plot", "--policy", "capacity", "--json", str(out)])
        if code:
            return code
        run = json.loads(out.read_text())
    print(f"{' '.join(argv[:split]) or 'as committed'}: {run['replica_hours']:.2f} replica-h, peak "
          f"{run['peak_replicas']}, TTFT p90 {run['ttft_p90_s']:.3f} s, attainment "
          f"{100 * run['objective_attainment']:.1f}%, met {'yes' if run['objective_met'] else 'no'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
