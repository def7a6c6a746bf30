"""The install step of the CPU kernels: build every instruction-set path of an architecture
(:func:`.cpu_build.build_all`) and say which one this machine's loader (:mod:`.cpu_native`) will use.

``python -m slipstream.kernels.install`` builds this machine's architecture into the package
(``make install`` and the server image run it); ``--out DIR`` builds elsewhere and ``--arch aarch64
--cc aarch64-linux-gnu-gcc`` cross-compiles. It exits 1 when a path fails to build, unless
``SLIPSTREAM_CPU_KERNELS=0`` says to serve dequantized fp32 weights instead.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from . import cpu_native
from .cpu_build import PACKAGE_DIR, BuildError, build_all, enabled, machine_arch, variant


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m slipstream.kernels.install", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=PACKAGE_DIR, help="folder for the libraries (default: the package's)")
    parser.add_argument("--arch", default=None, help=f"architecture to build for (default: {machine_arch()})")
    parser.add_argument("--cc", default=None, help="C compiler (default: $CC, else cc)")
    args = parser.parse_args(argv)
    if not enabled():
        print("CPU kernels: not built (SLIPSTREAM_CPU_KERNELS=0): quantized GGUF weights will be served "
              "dequantized to fp32")
        return 0
    started = time.monotonic()
    results = build_all(args.out, args.arch, args.cc)
    took = time.monotonic() - started
    failed = {isa: r for isa, r in results.items() if isinstance(r, BuildError)}
    for isa, r in results.items():
        print(f"CPU kernels [{isa}]: {r if isa in failed else r.name}")
    if failed:
        print(f"CPU kernels: {len(failed)} of {len(results)} paths failed to build. Install a C compiler with "
              "OpenMP (gcc), or set SLIPSTREAM_CPU_KERNELS=0 to serve quantized weights dequantized to fp32.",
              file=sys.stderr)
        return 1
    print(f"CPU kernels: {', '.join(results)} built into {args.out} in {took:.1f} s")
    if (args.arch or machine_arch()) == machine_arch():
        isa = cpu_native.best_isa()
        cpu = cpu_native.cpu_model()
        print(f"CPU kernels: this machine ({cpu}) will use the {isa} path ({variant(isa).description})")
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    sys.exit(main())
