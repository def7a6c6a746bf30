"""The project's C kernels for the CPU (``ggml_cpu.c``: quantized products; ``cpu_attention.c``:
paged decode attention; ``cpu_decode.c``: a decode step's layers in one call), loaded for the
instruction set of the CPU they run on.

Every path of the architecture (:data:`.cpu_build.VARIANTS`: AVX-512, AVX2 and generic on
x86-64; NEON and generic on aarch64) is a library of its own, built at install time. When the
library loads, the generic one asks the CPU what it can execute (CPUID, hwcaps) and the best
path is loaded; ``SLIPSTREAM_CPU_ISA=avx512|avx2|neon|generic`` forces one (tests, mixed
pools), and forcing one this CPU cannot execute is an error. A path missing from the install is
built once per machine into the cache (:func:`.cpu_build.build`).

The libraries link the OpenMP runtime that torch has already loaded (same soname), so both share
one thread pool. :func:`library` returns None (a WARNING saying why and what to do) where the
kernels cannot be had; callers then serve quantized weights dequantized to fp32 and take the torch
attention. ``SLIPSTREAM_CPU_KERNELS=0`` turns them off on purpose.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path

from . import cpu_build

log = logging.getLogger("slipstream.kernels")

ENV_ISA = "SLIPSTREAM_CPU_ISA"
FEATURE_BITS = {"avx2": 1, "avx512": 2, "neon": 4}  # cpu_features.c
_loaded: dict[str, str] = {}  # "isa": the path in use, or "none" when the kernels are unavailable


class CpuIsaError(ValueError):
    """``SLIPSTREAM_CPU_ISA`` names a path this machine cannot run (a bad setting)."""


def cpu_model() -> str:
    """The CPU's model name as ``/proc/cpuinfo`` gives it (the architecture where it gives none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "Model", "CPU part")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return cpu_build.machine_arch()


def cpu_flags() -> str:
    """The CPU's feature flags as ``/proc/cpuinfo`` lists them ("" where it does not)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _load(isa: str) -> ctypes.CDLL:
    v = cpu_build.variant(isa)
    path = cpu_build.find(v) or cpu_build.build(v, cpu_build.cache_dir(), first_use=True)
    lib = ctypes.CDLL(str(path))  # CDLL releases the GIL during each call
    lib.slipstream_cpu_isa.restype = ctypes.c_char_p
    built_for = lib.slipstream_cpu_isa().decode()
    if built_for != isa:
        raise cpu_build.BuildError(f"{path} holds the {built_for} path, not {isa}")
    lib.path = str(path)
    return lib


@functools.cache
def _generic() -> ctypes.CDLL:
    return _load("generic")


def supported_isas() -> list[str]:
    """The paths this CPU can execute, best first (``generic`` always last).

    Raises:
        cpu_build.BuildError: the generic library, which asks the CPU, cannot be built.
    """
    features = _generic().slipstream_cpu_features()
    return [v.isa for v in cpu_build.variants() if v.isa == "generic" or features & FEATURE_BITS.get(v.isa, 0)]


def best_isa() -> str:
    """The path :func:`library` loads here unless ``SLIPSTREAM_CPU_ISA`` forces one."""
    return supported_isas()[0]


def chosen_isa() -> str:
    """``SLIPSTREAM_CPU_ISA`` if set, checked, else :func:`best_isa`.

    Raises:
        CpuIsaError: an unknown name, a path of another architecture, or one this CPU lacks.
    """
    forced = os.environ.get(ENV_ISA, "").strip().lower()
    if not forced:
        return best_isa()
    arch = cpu_build.machine_arch()
    paths = [v.isa for v in cpu_build.variants()]
    if forced not in cpu_build.ALL_ISAS:
        raise CpuIsaError(f"{ENV_ISA}={forced!r} is not a CPU kernel path (one of {', '.join(cpu_build.ALL_ISAS)})")
    if forced not in paths:
        raise CpuIsaError(f"{ENV_ISA}={forced}: there is no {forced} path on {arch} (paths here: {', '.join(paths)})")
    can = supported_isas()
    if forced not in can:
        raise CpuIsaError(f"{ENV_ISA}={forced}: this CPU ({cpu_model()}) cannot execute the {forced} path "
                          f"({cpu_build.variant(forced).description}); it can run {', '.join(can)}")
    return forced


def loaded_isa() -> str | None:
    """The path in use (``"none"``: the kernels are unavailable), or None before :func:`library` ran."""
    return _loaded.get("isa")


@functools.cache
def library() -> ctypes.CDLL | None:
    """The kernels for this CPU, or None (logged once as a WARNING) when they cannot be had.

    Raises:
        CpuIsaError: ``SLIPSTREAM_CPU_ISA`` names a path this machine cannot run.
    """
    _loaded.pop("isa", None)
    forced = os.environ.get(ENV_ISA, "").strip()
    if not cpu_build.enabled():
        if forced and forced.lower() not in cpu_build.ALL_ISAS:
            raise CpuIsaError(f"{ENV_ISA}={forced!r} is not a CPU kernel path (one of {', '.join(cpu_build.ALL_ISAS)})")
        log.info("CPU kernels off (SLIPSTREAM_CPU_KERNELS=0): quantized GGUF weights are served dequantized to fp32")
        _loaded["isa"] = "none"
        return None
    try:
        isa = chosen_isa()
        lib = None
        for candidate in [isa] if forced else supported_isas()[supported_isas().index(isa):]:
            try:
                lib = _generic() if candidate == "generic" else _load(candidate)
                break
            except (OSError, cpu_build.BuildError) as e:
                if forced:
                    raise CpuIsaError(f"{ENV_ISA}={isa}: the {isa} path cannot be loaded: {e}") from None
                log.warning("the %s CPU kernels are unavailable (%s): trying a slower path", candidate, e)
        if lib is None:
            raise cpu_build.BuildError("no path could be loaded")
        isa = candidate
    except (OSError, cpu_build.BuildError) as e:
        log.warning("CPU kernels unavailable (%s): quantized GGUF weights are served dequantized to fp32 (slower, "
                    "4-8x the memory) and attention takes the torch path. To fix that cause: `python -m "
                    "slipstream.kernels.install` (make install) builds them where a C compiler is installed, and "
                    "the built libraries must be readable; SLIPSTREAM_CPU_KERNELS=0 accepts fp32 without this "
                    "warning.", e)
        _loaded["isa"] = "none"
        return None
    how = f"forced by {ENV_ISA}" if forced else "chosen from the CPU's features"
    log.info("CPU kernels: the %s path (%s; %s) on %s, %s", isa, cpu_build.variant(isa).description, how,
             cpu_model(), lib.path)
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.ggml_matmul.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, ptr, ctypes.c_int]
    lib.ggml_dequantize.argtypes = [ctypes.c_int, ptr, i64, ptr, i64, ptr, ctypes.c_int]
    i32, f32 = ctypes.c_int, ctypes.c_float
    lib.paged_decode_attention.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, ptr, i64, i32, i32, i32, i32, f32, i64, f32,
                                          ptr, i32]
    lib.decode_layers.argtypes = [ptr, i32, i32, i32, i32, i32, i32, f32, f32, ptr, i64, ptr, ptr, ptr, ptr, i64, i32,
                                  ptr, i64, ptr, i32]
    for f in (lib.ggml_matmul, lib.ggml_dequantize, lib.paged_decode_attention, lib.decode_layers):
        f.restype = ctypes.c_int
    _loaded["isa"] = isa
    return lib


def available() -> bool:
    return library() is not None


def require() -> ctypes.CDLL:
    lib = library()
    if lib is None:
        raise RuntimeError("the CPU kernels are not available on this machine (see the log)")
    return lib
