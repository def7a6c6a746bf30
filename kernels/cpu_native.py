"""The project's C kernels for the CPU (``ggml_cpu.c``: quantized products; ``cpu_attention.c``:
paged decode attention; ``cpu_decode.c``: a decode step's layers in one call), built into one
shared library.

The sources are compiled on first use with the machine's C compiler (``$CC``, else ``cc``) for
this CPU (``-march=native``), 15-20 s on two cores (``make install`` does it once), and kept
under ``$SLIPSTREAM_CACHE_DIR/kernels`` keyed by the sources, the compiler and the CPU's flags.
The library links the OpenMP runtime that torch has already loaded (same soname), so both share
one thread pool. :func:`library` returns None where no compiler or OpenMP is available; callers
then take their torch paths.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger("slipstream.kernels")

SOURCES = [Path(__file__).with_name(n) for n in ("ggml_cpu.c", "cpu_attention.c", "cpu_decode.c")]
_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared"]


def _cache_root() -> Path:
    root = os.environ.get("SLIPSTREAM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "slipstream")
    return Path(root) / "kernels"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _build(cc: str) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    texts = [s.read_text() for s in SOURCES]
    key = hashlib.sha256("\0".join([*texts, cc, version, _cpu_flags(), *_FLAGS]).encode())
    target = _cache_root() / f"slipstream_cpu-{key.hexdigest()[:16]}.so"
    if target.is_file():
        return target
    log.info("compiling the CPU kernels for this machine with %s (once; 15-20 s on two cores), into %s", cc,
             target.parent)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        with tempfile.TemporaryDirectory() as src:
            # Compile the very text that was hashed: sources changed meanwhile (an upgrade, an edit)
            # must not land in a library cached under the old sources' key.
            paths = [os.path.join(src, s.name) for s in SOURCES]
            for path, text in zip(paths, texts):
                Path(path).write_text(text)
            done = subprocess.run([cc, *_FLAGS, *paths, "-o", tmp, "-lm"], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(done.stderr.strip()[-2000:])
        os.replace(tmp, target)  # atomic: a concurrent build of the same key is harmless
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None (logged once) when they cannot be built or loaded here.

    ``SLIPSTREAM_CPU_KERNELS=0`` disables them.
    """
    if os.environ.get("SLIPSTREAM_CPU_KERNELS", "1") == "0":
        return None
    cc = shutil.which(os.environ.get("CC") or "cc") or shutil.which("gcc")
    if cc is None:
        log.warning("no C compiler: quantized GGUF weights will be served dequantized to fp32 and "
                    "attention takes the torch path (install gcc, or pass --quantization none)")
        return None
    try:
        path = _build(cc)
        lib = ctypes.CDLL(str(path))  # CDLL releases the GIL during each call
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("could not build the CPU kernels (%s): serving dequantized fp32 weights", e)
        return None
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
    return lib


def available() -> bool:
    return library() is not None


def require() -> ctypes.CDLL:
    lib = library()
    if lib is None:
        raise RuntimeError("the CPU kernels are not available on this machine (see the log)")
    return lib
