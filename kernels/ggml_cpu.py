"""CPU products over GGML-quantized weights as stored (Q4_0, Q4_1, Q8_0): ``ggml_cpu.c``.

The C source is compiled on first use with the machine's C compiler (``$CC``, else ``cc``) for
this CPU (``-march=native``), about a second, and kept under ``$SLIPSTREAM_CACHE_DIR/kernels``
keyed by the source, the compiler and the CPU's flags. It links the OpenMP runtime that torch has
already loaded (same soname), so both share one thread pool. :func:`library` returns None where
no compiler or OpenMP is available; callers then serve dequantized fp32 weights instead.
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

import torch

log = logging.getLogger("slipstream.kernels")

SOURCE = Path(__file__).with_name("ggml_cpu.c")
# GGML type ids (gguf.GGMLQuantizationType) → weights per block and bytes per block.
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
TYPE_IDS = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8}
BLOCK_SIZE = 32
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
    key = hashlib.sha256("\0".join([SOURCE.read_text(), cc, version, _cpu_flags(), *_FLAGS]).encode())
    target = _cache_root() / f"ggml_cpu-{key.hexdigest()[:16]}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([cc, *_FLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True, timeout=120)
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

    ``SLIPSTREAM_GGML_KERNELS=0`` disables them.
    """
    if os.environ.get("SLIPSTREAM_GGML_KERNELS", "1") == "0":
        return None
    cc = shutil.which(os.environ.get("CC") or "cc") or shutil.which("gcc")
    if cc is None:
        log.warning("no C compiler: quantized GGUF weights will be served dequantized to fp32 "
                    "(install gcc, or pass --quantization none to silence this)")
        return None
    try:
        path = _build(cc)
        lib = ctypes.CDLL(str(path))  # CDLL releases the GIL during each call
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("could not build the GGML CPU kernels (%s): serving dequantized fp32 weights", e)
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.ggml_matmul.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, ptr, ctypes.c_int]
    lib.ggml_dequantize.argtypes = [ctypes.c_int, ptr, i64, ptr, i64, ptr, ctypes.c_int]
    lib.ggml_matmul.restype = lib.ggml_dequantize.restype = ctypes.c_int
    return lib


def available() -> bool:
    return library() is not None


def _check(blocks: torch.Tensor, qtype: str, k: int) -> int:
    if qtype not in TYPE_IDS:
        raise ValueError(f"no CPU kernel for GGML type {qtype} (have {', '.join(TYPE_IDS)})")
    if k % BLOCK_SIZE or blocks.dtype != torch.uint8 or not blocks.is_contiguous() \
            or blocks.shape[-1] != k // BLOCK_SIZE * BLOCK_BYTES[qtype]:
        raise ValueError(f"{qtype} blocks {tuple(blocks.shape)} {blocks.dtype} do not hold rows of {k} weights")
    return TYPE_IDS[qtype]


def matmul(x: torch.Tensor, blocks: torch.Tensor, qtype: str, k: int) -> torch.Tensor:
    """``x @ W.T`` with ``W`` read from its GGML blocks.

    Args:
        x: ``[M, k]`` fp32 CPU activations (any M; rows are taken up to eight at a time, each
            weight row dequantized once per eight rows, so large M is better served by
            :func:`dequantize` and a dense GEMM).
        blocks: ``[N, k / 32 * block_bytes]`` uint8, the tensor's blocks as stored in the GGUF file.
        qtype: ``"Q4_0"``, ``"Q4_1"`` or ``"Q8_0"``.
        k: weights per row.

    Returns:
        ``[M, N]`` fp32.

    Raises:
        ValueError: an unknown type or blocks that do not match ``k``.
        RuntimeError: the kernels are not available (see :func:`library`).
    """
    lib = _require()
    type_id = _check(blocks, qtype, k)
    x = x.contiguous()
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [M, {k}] float32, got {tuple(x.shape)} {x.dtype}")
    y = torch.empty(x.shape[0], blocks.shape[0], dtype=torch.float32)
    lib.ggml_matmul(type_id, blocks.data_ptr(), blocks.shape[0], k, x.data_ptr(), x.shape[0], y.data_ptr(),
                    torch.get_num_threads())
    return y


def dequantize(blocks: torch.Tensor, qtype: str, k: int, ids: torch.Tensor | None = None) -> torch.Tensor:
    """Rows of ``W`` as fp32: ``[len(ids) or N, k]``, equal to the gguf package's dequantization.

    ``ids``: ``[R]`` int64 row indices (an embedding lookup), or None for every row.
    Raises as :func:`matmul`, and IndexError for an id outside ``[0, N)``.
    """
    lib = _require()
    type_id = _check(blocks, qtype, k)
    if ids is not None:
        ids = ids.to(torch.int64).contiguous()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= blocks.shape[0]):
            raise IndexError(f"row id out of range [0, {blocks.shape[0]})")
    rows = blocks.shape[0] if ids is None else ids.numel()
    out = torch.empty(rows, k, dtype=torch.float32)
    lib.ggml_dequantize(type_id, blocks.data_ptr(), k, None if ids is None else ids.data_ptr(), rows,
                        out.data_ptr(), torch.get_num_threads())
    return out


def _require() -> ctypes.CDLL:
    lib = library()
    if lib is None:
        raise RuntimeError("the GGML CPU kernels are not available on this machine (see the log)")
    return lib
