"""Building the CPU kernels: one shared library per instruction-set path (``simd.h``), compiled
at install time into the package (``make install``, the server image) and, only where an install
skipped that, once per machine into the cache on first use.

Each path is built with flags that name its instruction set (never ``-march=native``), so a
library built on one node runs on every node of its architecture that has that instruction set;
:mod:`.cpu_native` asks the CPU which it has and loads the best (llama.cpp's
``GGML_CPU_ALL_VARIANTS`` and PyTorch's CPU capability dispatch do the same).

``python -m slipstream.kernels.install`` (:mod:`.install`) is the install step.
"""
from __future__ import annotations

import concurrent.futures
import fcntl
import hashlib
import json
import logging
import os
import platform
import shlex
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("slipstream.kernels")

HERE = Path(__file__).resolve().parent
SOURCES = ("ggml_cpu.c", "cpu_attention.c", "cpu_decode.c")
HEADERS = ("simd.h",)
FEATURES_SOURCE = "cpu_features.c"  # CPUID / hwcaps: the generic library only (baseline code)
COMMON_FLAGS = ("-O3", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared")
PACKAGE_DIR = HERE / "lib"
ENV_TIMEOUT = "SLIPSTREAM_KERNEL_BUILD_TIMEOUT"
DEFAULT_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Variant:
    """One path: ``isa`` (the name ``SLIPSTREAM_CPU_ISA`` takes), the architecture it runs on,
    and the compiler flags that select its instruction set."""
    isa: str
    arch: str
    flags: tuple[str, ...]
    description: str

    @property
    def define(self) -> str:
        return f"-DSLIPSTREAM_ISA_{self.isa.upper()}"


_X86 = ("-march=x86-64", "-mtune=generic")
_AVX2 = (*_X86, "-mavx2", "-mfma", "-mf16c")
# Best first: the loader takes the first one the CPU can execute.
VARIANTS: dict[str, tuple[Variant, ...]] = {
    "x86_64": (
        Variant("avx512", "x86_64", (*_AVX2, "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl"),
                "x86-64 AVX-512 F/BW/DQ/VL + FMA"),
        Variant("avx2", "x86_64", _AVX2, "x86-64 AVX2 + FMA + F16C"),
        Variant("generic", "x86_64", _X86, "x86-64 baseline (SSE2), compiler-vectorized C"),
    ),
    "aarch64": (
        Variant("neon", "aarch64", ("-march=armv8-a",), "ARMv8-A Advanced SIMD (NEON)"),
        Variant("generic", "aarch64", ("-march=armv8-a",), "ARMv8-A baseline, compiler-vectorized C"),
    ),
}
ALL_ISAS = ("avx512", "avx2", "neon", "generic")


class BuildError(RuntimeError):
    """A path could not be built (no compiler, a compile error, a timeout, or a remembered failure)."""


class BuildCancelled(BaseException):
    """A build stopped by :func:`cancel_builds` (the process is stopping). A BaseException, like
    KeyboardInterrupt, so that no fallback to fp32 takes it for a failed build."""


_cancel = threading.Event()
_running: set[subprocess.Popen] = set()
_running_guard = threading.Lock()


def cancel_builds() -> bool:
    """Kill every running compiler of this process (its whole process group) and make this and
    later builds raise :class:`BuildCancelled`. Returns whether one was running. Safe from a
    signal handler."""
    _cancel.set()
    with _running_guard:
        procs = list(_running)
    for proc in procs:
        _kill_group(proc)
    return bool(procs)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def enabled() -> bool:
    """False where ``SLIPSTREAM_CPU_KERNELS`` is 0, off, false or no: serve dequantized fp32."""
    return os.environ.get("SLIPSTREAM_CPU_KERNELS", "1").strip().lower() not in ("0", "off", "false", "no")


def machine_arch() -> str:
    """This machine's architecture as :data:`VARIANTS` names it (``x86_64``, ``aarch64``, or
    the raw name of one with a generic path only)."""
    arch = platform.machine().lower()
    return {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64"}.get(arch, arch)


def variants(arch: str | None = None) -> tuple[Variant, ...]:
    """The paths of ``arch`` (default: this machine's), best first; an architecture without
    vector code of its own gets the generic path at the compiler's default flags."""
    arch = arch or machine_arch()
    return VARIANTS.get(arch, (Variant("generic", arch, (), f"{arch} baseline, compiler-vectorized C"),))


def variant(isa: str, arch: str | None = None) -> Variant:
    for v in variants(arch):
        if v.isa == isa:
            return v
    raise KeyError(isa)


def _texts(v: Variant) -> dict[str, str]:
    names = (*SOURCES, *HEADERS, *((FEATURES_SOURCE,) if v.isa == "generic" else ()))
    return {name: (HERE / name).read_text() for name in names}


def library_name(v: Variant) -> str:
    """``slipstream_cpu-{arch}-{isa}-{key}.so``, the key hashing the sources and flags: a library
    is never used for sources other than those it was built from."""
    texts = _texts(v)
    key = hashlib.sha256("\0".join([v.arch, v.isa, *COMMON_FLAGS, *v.flags,
                                    *(f"{n}\0{t}" for n, t in sorted(texts.items()))]).encode())
    return f"slipstream_cpu-{v.arch}-{v.isa}-{key.hexdigest()[:16]}.so"


def cache_dir() -> Path:
    """Where a build on first use goes: ``$SLIPSTREAM_CACHE_DIR/kernels`` (default
    ``~/.cache/slipstream/kernels``)."""
    root = os.environ.get("SLIPSTREAM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "slipstream")
    return Path(root) / "kernels"


def find(v: Variant) -> Path | None:
    """The built library of ``v`` for the current sources: the package's, else the cache's."""
    name = library_name(v)
    for folder in (PACKAGE_DIR, cache_dir()):
        if (folder / name).is_file():
            return folder / name
    return None


def compiler(cc: str | None = None) -> list[str] | None:
    """The C compiler command to use: ``cc``, else ``$CC`` (words, as make splits it: ``ccache
    gcc``), else ``cc``/``gcc`` on the PATH; None if its program is not found."""
    words = shlex.split(cc or os.environ.get("CC") or "cc")
    program = shutil.which(words[0]) if words else None
    if program is None and not (cc or os.environ.get("CC")):
        program = shutil.which("gcc")
    return [program, *words[1:]] if program else None


def _compiler_id(cc: list[str], timeout: float) -> str:
    try:
        out = _run_compiler([*cc, "--version"], min(30.0, timeout)).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    return f"{' '.join(cc)}: {out.splitlines()[0] if out else '?'}"


def timeout_s() -> float:
    """``$SLIPSTREAM_KERNEL_BUILD_TIMEOUT`` seconds, default 300. Raises BuildError if not a positive number."""
    text = os.environ.get(ENV_TIMEOUT) or str(DEFAULT_TIMEOUT_S)
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise BuildError(f"{ENV_TIMEOUT}={text!r} is not a positive number of seconds")
    return value


def _run_compiler(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """``cmd`` in its own process group, all of which (the driver and its cc1, as, ld) is killed
    when ``timeout`` passes: killing the driver alone leaves cc1 running."""
    if _cancel.is_set():
        raise BuildCancelled()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    with _running_guard:
        _running.add(proc)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        _kill_group(proc)
        proc.communicate()
        raise
    finally:
        with _running_guard:
            _running.discard(proc)
    if _cancel.is_set():
        _kill_group(proc)  # what the driver left, if it exited first
        raise BuildCancelled()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def build(v: Variant, out_dir: Path, cc: str | None = None, timeout: float | None = None,
          first_use: bool = False) -> Path:
    """Compile ``v`` into ``out_dir`` (if not there already) and return the library's path.

    One build per library name at a time on this machine (a file lock beside it): a process
    that waited finds the other's result. With ``first_use`` (a server that found no built
    library) the build is logged as a WARNING, and a failed build leaves a
    ``.failed`` note and later calls raise it again without compiling, until the sources or the
    compiler change, a timed-out build is given more time, or the note is deleted. The library
    is readable by every user (an image builds as root and serves as another user).

    Raises:
        BuildError: no compiler, a compile error, ``timeout`` seconds passed (default
            ``$SLIPSTREAM_KERNEL_BUILD_TIMEOUT`` or 300; the compiler's process group is killed),
            or a remembered failure.
        BuildCancelled: :func:`cancel_builds` was called.
    """
    timeout = timeout_s() if timeout is None else timeout
    path = compiler(cc)
    if path is None:
        raise BuildError(f"no C compiler ({cc or os.environ.get('CC') or 'cc'} not found; install gcc)")
    out_dir.mkdir(parents=True, exist_ok=True)
    texts = _texts(v)  # read once: the name hashes exactly the text that is compiled
    target = out_dir / library_name(v)
    failed = target.with_suffix(".failed")
    who = _compiler_id(path, timeout)
    with open(out_dir / f".{target.stem}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file():
            return target
        if first_use and failed.is_file():
            note = json.loads(failed.read_text())
            if note.get("compiler") == who and not timeout > note.get("timeout_s", timeout):
                raise BuildError(f"{note['error']} (remembered from an earlier start: delete {failed} to try again)")
        if first_use:
            log.warning("compiling the %s CPU kernels with %s into %s (once per machine; run `python -m "
                        "slipstream.kernels.install` at install time to skip this)", v.isa, who, out_dir)
        started = time.monotonic()
        with tempfile.TemporaryDirectory() as src:
            for name, text in texts.items():
                Path(src, name).write_text(text)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
            os.close(fd)
            sources = [os.path.join(src, n) for n in texts if n.endswith(".c")]
            cmd = [*path, *COMMON_FLAGS, *v.flags, v.define, *sources, "-o", tmp, "-lm"]
            try:
                try:
                    done = _run_compiler(cmd, timeout)
                except subprocess.TimeoutExpired:
                    error = (f"the {v.isa} build with {' '.join(path)} timed out after {timeout:.0f} s "
                             f"(${ENV_TIMEOUT} sets the limit)")
                else:
                    error = None if done.returncode == 0 else (f"the {v.isa} build with {' '.join(path)} failed: "
                                                               f"{done.stderr.strip()[-2000:] or f'exit {done.returncode}'}")
                if error is None:
                    # mkstemp made it 0600 and the linker kept that: every user must be able to load it
                    os.chmod(tmp, stat.S_IRWXU | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)
                    os.replace(tmp, target)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        if error is not None:
            if first_use:
                failed.write_text(json.dumps({"compiler": who, "error": error, "timeout_s": timeout}))
            raise BuildError(error)
        log.info("built the %s CPU kernels in %.1f s", v.isa, time.monotonic() - started)
        return target


def build_all(out_dir: Path = PACKAGE_DIR, arch: str | None = None, cc: str | None = None,
              timeout: float | None = None) -> dict[str, Path | BuildError]:
    """Every path of ``arch`` built into ``out_dir``, in parallel; older builds there removed.

    Returns ``{isa: path or the BuildError}``.
    """
    todo = variants(arch)
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(len(todo), os.cpu_count() or 1))) as pool:
        futures = {v.isa: pool.submit(build, v, out_dir, cc, timeout) for v in todo}
    results: dict[str, Path | BuildError] = {}
    for isa, fut in futures.items():
        try:
            results[isa] = fut.result()
        except BuildError as e:
            results[isa] = e
    keep = {p.stem for p in results.values() if isinstance(p, Path)}
    arch = todo[0].arch
    for old in [*out_dir.glob(f"slipstream_cpu-{arch}-*"), *out_dir.glob(f".slipstream_cpu-{arch}-*.lock")]:
        if old.name.lstrip(".").split(".")[0] not in keep:  # other sources' libraries, notes and locks
            old.unlink(missing_ok=True)
    return results
