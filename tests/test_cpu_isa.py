"""The CPU kernels per instruction set: every path built with its own flags and chosen from the
CPU's features when the library loads; under qemu-user, the aarch64 paths (cross-compiled) and the
x86-64 ones on CPUs without AVX-512 (Haswell) and without AVX (qemu64), against the gguf package
and the attention reference; the build at install time, the lock,
the killed process group of a timed-out build and a remembered failure.

The x86 paths' oracle tests (greedy tokens equal to transformers') run per path through the
``cpu_isa`` fixture (tests/conftest.py) in test_oracle.py, test_architectures.py, test_quant.py,
test_kernels.py and test_fused_decode.py."""
from __future__ import annotations

import ctypes
import logging
import os
import shutil
import struct
import subprocess
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from slipstream.kernels import cpu_build, cpu_native, install, reference
from test_kernels import make_batch
from test_quant import TYPES, _blocks, _cols

HERE = Path(__file__).resolve().parent
CROSS_CC = "aarch64-linux-gnu-gcc"
SYSROOT = "/usr/aarch64-linux-gnu"
TYPE_IDS = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}


@pytest.fixture
def fresh_library(monkeypatch):
    """library() re-read after the test changed its environment, and again after it."""
    cpu_native.library.cache_clear()
    cpu_native._generic.cache_clear()
    yield
    monkeypatch.undo()
    cpu_native.library.cache_clear()
    cpu_native._generic.cache_clear()


# --- choosing the path ----------------------------------------------------------------------

def test_the_best_path_this_cpu_executes_is_chosen_and_reported(fresh_library, monkeypatch, caplog):
    monkeypatch.delenv(cpu_native.ENV_ISA, raising=False)
    flags = Path("/proc/cpuinfo").read_text()
    isas = cpu_native.supported_isas()
    assert isas[-1] == "generic"
    if cpu_build.machine_arch() == "x86_64":  # what the CPU itself says, against what Linux lists
        assert ("avx512" in isas) == all(f" {f}" in flags for f in ("avx512f", "avx512bw", "avx512dq", "avx512vl"))
        assert ("avx2" in isas) == all(f" {f}" in flags for f in ("avx2", "fma", "f16c"))
    caplog.set_level(logging.INFO, logger="slipstream.kernels")
    lib = cpu_native.library()
    assert lib is not None and cpu_native.loaded_isa() == isas[0]
    assert lib.slipstream_cpu_isa() == isas[0].encode()
    assert f"the {isas[0]} path" in caplog.text and "chosen from the CPU's features" in caplog.text


@pytest.mark.parametrize("forced, message", [
    ("sse9", "not a CPU kernel path"),
    ("neon" if cpu_build.machine_arch() == "x86_64" else "avx2", "there is no .* path on"),
])
def test_forcing_a_path_this_machine_cannot_run_is_an_error(fresh_library, monkeypatch, forced, message):
    monkeypatch.setenv(cpu_native.ENV_ISA, forced)
    with pytest.raises(cpu_native.CpuIsaError, match=message):
        cpu_native.library()


def test_forcing_a_path_the_cpu_lacks_names_what_it_can_run(fresh_library, monkeypatch):
    """An AVX2-only CPU (the generic library's feature query answering AVX2 alone)."""
    if cpu_build.machine_arch() != "x86_64":
        pytest.skip("x86-64 paths")
    real = cpu_native._generic()

    class Avx2Only:
        path = real.path

        def slipstream_cpu_features(self):
            return cpu_native.FEATURE_BITS["avx2"]

    monkeypatch.setattr(cpu_native, "_generic", lambda: Avx2Only())
    assert cpu_native.supported_isas() == ["avx2", "generic"] and cpu_native.best_isa() == "avx2"
    monkeypatch.setenv(cpu_native.ENV_ISA, "avx512")
    with pytest.raises(cpu_native.CpuIsaError, match="cannot execute the avx512 path .* it can run avx2, generic"):
        cpu_native.library()


def test_prebuilt_paths_load_without_a_compiler(fresh_library, monkeypatch, tmp_path):
    """Built at install time: a node with no compiler (the server image has none) loads them."""
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("SLIPSTREAM_CACHE_DIR", str(tmp_path / "empty-cache"))
    for v in cpu_build.variants():
        assert cpu_build.find(v) is not None and cpu_build.find(v).parent == cpu_build.PACKAGE_DIR, \
            f"{v.isa} was not built into the package (make install runs python -m slipstream.kernels.install)"
    assert cpu_native.library() is not None


def test_nothing_built_and_no_compiler_is_a_warning_naming_the_fix(fresh_library, monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(cpu_build, "PACKAGE_DIR", tmp_path / "not-installed")
    monkeypatch.setenv("SLIPSTREAM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("PATH", str(tmp_path))
    caplog.set_level(logging.WARNING, logger="slipstream.kernels")
    assert cpu_native.library() is None and cpu_native.loaded_isa() == "none"
    record = next(r for r in caplog.records if "CPU kernels unavailable" in r.message)
    assert record.levelno == logging.WARNING
    assert "no C compiler" in record.message and "dequantized to fp32" in record.message
    assert "python -m slipstream.kernels.install" in record.message and "SLIPSTREAM_CPU_KERNELS=0" in record.message


# --- building -----------------------------------------------------------------------------

def _fake_cc(tmp_path: Path, body: str) -> Path:
    """A compiler stand-in: a shell script that counts its calls in ``calls`` and runs ``body``
    (``$out``: the -o argument)."""
    cc = tmp_path / "fake-cc"
    cc.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        case "$1" in --version) echo fake-cc 1.0; exit 0;; esac
        echo call >> {tmp_path}/calls
        out=""; prev=""
        for a in "$@"; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; done
        """) + textwrap.dedent(body))
    cc.chmod(0o755)
    return cc


def _calls(tmp_path: Path) -> int:
    return len((tmp_path / "calls").read_text().splitlines()) if (tmp_path / "calls").exists() else 0


def test_a_timed_out_build_leaves_no_compiler_running_and_is_remembered(tmp_path):
    """The driver's child (cc1 in a real build) is killed with it; the next start does not wait again."""
    cc = _fake_cc(tmp_path, f"""\
        sleep 300 &
        echo $! > {tmp_path}/child
        wait
        """)
    v = cpu_build.variant("generic")
    started = time.monotonic()
    with pytest.raises(cpu_build.BuildError, match="timed out after 2 s"):
        cpu_build.build(v, tmp_path / "out", cc=str(cc), timeout=2, first_use=True)
    assert time.monotonic() - started < 30
    child = int((tmp_path / "child").read_text())
    deadline = time.monotonic() + 5
    while Path(f"/proc/{child}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)  # SIGKILL is asynchronous; the child is reparented and reaped by init
    alive = Path(f"/proc/{child}/stat").exists() and Path(f"/proc/{child}/stat").read_text().split()[2] != "Z"
    assert not alive, "the compiler's child outlived the timeout"
    assert not list((tmp_path / "out").glob("*.so")) and not list((tmp_path / "out").glob("tmp*"))
    with pytest.raises(cpu_build.BuildError, match="remembered from an earlier start"):
        cpu_build.build(v, tmp_path / "out", cc=str(cc), timeout=2, first_use=True)
    assert _calls(tmp_path) == 1


def test_one_build_per_machine_at_a_time(tmp_path):
    """Two servers starting together: one compiles, the other waits for it and loads its result."""
    cc = _fake_cc(tmp_path, """\
        sleep 1
        printf built > "$out"
        """)
    v = cpu_build.variant("generic")
    results = []
    threads = [threading.Thread(target=lambda: results.append(cpu_build.build(v, tmp_path / "out", cc=str(cc))))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 2 and results[0] == results[1] and results[0].read_text() == "built"
    assert _calls(tmp_path) == 1


def test_a_remembered_timeout_is_retried_with_more_time_and_a_failure_with_another_compiler(tmp_path):
    slow = _fake_cc(tmp_path, """\
        sleep 3
        printf built > "$out"
        """)
    v = cpu_build.variant("generic")
    with pytest.raises(cpu_build.BuildError, match="timed out after 1 s"):
        cpu_build.build(v, tmp_path / "out", cc=str(slow), timeout=1, first_use=True)
    with pytest.raises(cpu_build.BuildError, match="remembered"):
        cpu_build.build(v, tmp_path / "out", cc=str(slow), timeout=1, first_use=True)
    assert cpu_build.build(v, tmp_path / "out", cc=str(slow), timeout=30, first_use=True).read_text() == "built"
    assert _calls(tmp_path) == 2


def test_a_built_library_is_readable_by_every_user(tmp_path):
    """The image builds as root and serves as uid 10001: a 0700 library would mean fp32 in every pod."""
    cc = _fake_cc(tmp_path, """\
        printf built > "$out"
        """)
    built = cpu_build.build(cpu_build.variant("generic"), tmp_path / "out", cc=str(cc))
    assert built.stat().st_mode & 0o555 == 0o555
    for v in cpu_build.variants():
        installed = cpu_build.find(v)
        assert installed is not None and installed.stat().st_mode & 0o555 == 0o555, installed


def test_cc_may_be_a_command_with_words(tmp_path, monkeypatch):
    cc = _fake_cc(tmp_path, """\
        printf built > "$out"
        """)
    monkeypatch.setenv("CC", f"env {cc}")
    assert cpu_build.compiler() == [shutil.which("env"), str(cc)]
    assert cpu_build.build(cpu_build.variant("generic"), tmp_path / "out").read_text() == "built"


def test_a_timeout_that_is_not_a_number_names_the_variable(monkeypatch):
    monkeypatch.setenv(cpu_build.ENV_TIMEOUT, "abc")
    with pytest.raises(cpu_build.BuildError, match="SLIPSTREAM_KERNEL_BUILD_TIMEOUT='abc' is not a positive number"):
        cpu_build.timeout_s()


def test_cancel_builds_kills_the_compiler_and_remembers_nothing(tmp_path, monkeypatch):
    """A server stopped while it compiles on first use exits now, not when the build ends."""
    cc = _fake_cc(tmp_path, f"""\
        sleep 300 &
        echo $! > {tmp_path}/child
        wait
        """)
    monkeypatch.setattr(cpu_build, "_cancel", threading.Event())
    result = []

    def run():
        try:
            cpu_build.build(cpu_build.variant("generic"), tmp_path / "out", cc=str(cc), timeout=120, first_use=True)
        except BaseException as e:  # noqa: BLE001 - BuildCancelled is a BaseException
            result.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 30
    while not (tmp_path / "child").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    started = time.monotonic()
    assert cpu_build.cancel_builds()
    thread.join(30)
    assert time.monotonic() - started < 10 and isinstance(result[0], cpu_build.BuildCancelled)
    assert not list((tmp_path / "out").glob("*.failed"))
    child = int((tmp_path / "child").read_text())
    time.sleep(0.5)
    assert not Path(f"/proc/{child}").exists() or Path(f"/proc/{child}/stat").read_text().split()[2] == "Z"


def test_a_missing_faster_path_falls_back_to_a_slower_one_unless_forced(fresh_library, monkeypatch, tmp_path, caplog):
    isas = cpu_native.supported_isas()
    if len(isas) < 2:
        pytest.skip("this CPU runs the generic path only")
    real_find = cpu_build.find
    monkeypatch.setattr(cpu_build, "find", lambda v: None if v.isa == isas[0] else real_find(v))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("SLIPSTREAM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(cpu_native.ENV_ISA, raising=False)
    caplog.set_level(logging.WARNING, logger="slipstream.kernels")
    assert cpu_native.library() is not None and cpu_native.loaded_isa() == isas[1]
    assert f"the {isas[0]} CPU kernels are unavailable" in caplog.text
    cpu_native.library.cache_clear()
    monkeypatch.setenv(cpu_native.ENV_ISA, isas[0])
    with pytest.raises(cpu_native.CpuIsaError, match=f"the {isas[0]} path cannot be loaded: no C compiler"):
        cpu_native.library()


def test_building_for_another_architecture_keeps_this_ones_libraries(tmp_path):
    cc = _fake_cc(tmp_path, """\
        printf built > "$out"
        """)
    mine = cpu_build.build_all(tmp_path, cc=str(cc))
    other = "aarch64" if cpu_build.machine_arch() == "x86_64" else "x86_64"
    theirs = cpu_build.build_all(tmp_path, arch=other, cc=str(cc))
    assert all(p.exists() for p in (*mine.values(), *theirs.values()))


def test_a_library_is_compiled_from_the_text_its_name_hashes(tmp_path, monkeypatch):
    """A source edited between the name's hash and the compile (an upgrade under a starting
    server) must not be cached under the old text's name."""
    cc = cpu_build.compiler()
    if cc is None:
        pytest.skip("no C compiler")
    src = tmp_path / "src"
    src.mkdir()
    (src / "one.c").write_text("int version(void) { return 1; }\n")
    monkeypatch.setattr(cpu_build, "HERE", src)
    monkeypatch.setattr(cpu_build, "SOURCES", ("one.c",))
    monkeypatch.setattr(cpu_build, "HEADERS", ())
    monkeypatch.setattr(cpu_build, "FEATURES_SOURCE", "one.c")
    real = cpu_build._run_compiler

    def run(cmd, timeout):
        (src / "one.c").write_text("int version(void) { return 2; }\n")  # changes under the compile
        return real(cmd, timeout)

    monkeypatch.setattr(cpu_build, "_run_compiler", run)
    v = cpu_build.variant("generic")
    first = cpu_build.build(v, tmp_path / "out")
    assert ctypes.CDLL(str(first)).version() == 1
    monkeypatch.setattr(cpu_build, "_run_compiler", real)
    second = cpu_build.build(v, tmp_path / "out")
    assert second != first and ctypes.CDLL(str(second)).version() == 2


def test_the_install_step_fails_loudly_unless_fp32_is_accepted(tmp_path, monkeypatch, capsys):
    cc = _fake_cc(tmp_path, """\
        echo 'error: this compiler cannot' >&2
        exit 1
        """)
    monkeypatch.delenv("SLIPSTREAM_CPU_KERNELS", raising=False)
    assert install.main(["--out", str(tmp_path / "out"), "--cc", str(cc)]) == 1
    err = capsys.readouterr().err
    assert "failed to build" in err and "SLIPSTREAM_CPU_KERNELS=0" in err
    monkeypatch.setenv("SLIPSTREAM_CPU_KERNELS", "0")
    assert install.main(["--out", str(tmp_path / "out"), "--cc", str(cc)]) == 0
    assert "dequantized to fp32" in capsys.readouterr().out


# --- emulated CPUs: aarch64, and x86-64 without AVX-512 or without AVX -----------------------

# (name, qemu binary, qemu -cpu, the paths it runs, the feature bits it must report)
EMULATED = {
    "aarch64": ("qemu-aarch64", None, ("neon", "generic"), cpu_native.FEATURE_BITS["neon"]),
    "x86_64-haswell": ("qemu-x86_64", "Haswell", ("avx2", "generic"), cpu_native.FEATURE_BITS["avx2"]),
    "x86_64-baseline": ("qemu-x86_64", "qemu64", ("generic",), 0),
}


def _emulator_tools() -> str | None:
    missing = [t for t in (CROSS_CC, "qemu-aarch64", "qemu-x86_64") if shutil.which(t) is None]
    if not Path(SYSROOT, "lib", "libgomp.so.1").exists():
        missing.append(f"{SYSROOT}/lib/libgomp.so.1 (libgomp1-arm64-cross)")
    return ", ".join(missing) or None


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    """Each emulated CPU's libraries and driver: ``{name: (run, features, {isa: library})}``,
    ``run(lib, records)`` the driver's output as float32. The aarch64 paths are cross-compiled;
    the x86-64 ones are the package's, as make install built them."""
    missing = _emulator_tools()
    if missing:
        if os.environ.get("SLIPSTREAM_REQUIRE_EMULATORS") == "1":
            pytest.fail(f"missing {missing}: make test installs them (make emulators)")
        pytest.skip(f"missing {missing} (make emulators installs them)")
    if cpu_build.machine_arch() != "x86_64":
        pytest.skip("the emulated CPUs run on an x86-64 host")
    out = tmp_path_factory.mktemp("emulated")
    drivers, libs = {}, {"aarch64": {}, "x86_64": {}}
    for arch, cc in (("aarch64", [CROSS_CC]), ("x86_64", cpu_build.compiler())):
        drivers[arch] = out / f"kernel_driver-{arch}"
        subprocess.run([*cc, "-O2", str(HERE / "emulated" / "kernel_driver.c"), "-o", str(drivers[arch]), "-ldl"],
                       check=True)
    for v in cpu_build.variants("aarch64"):
        libs["aarch64"][v.isa] = cpu_build.build(v, out / "aarch64", cc=CROSS_CC, timeout=300)
    for v in cpu_build.variants("x86_64"):
        libs["x86_64"][v.isa] = cpu_build.find(v)
        assert libs["x86_64"][v.isa] is not None, f"{v.isa} is not built (make install)"
    machines = {}
    for name, (qemu, cpu, isas, _) in EMULATED.items():
        arch = name.split("-")[0]
        prefix = [qemu, *(["-L", SYSROOT] if arch == "aarch64" else ["-cpu", cpu])]

        def run(lib: Path, records: bytes, prefix=prefix, arch=arch) -> np.ndarray:
            src, dst = out / "in.bin", out / "out.bin"
            src.write_bytes(records)
            done = subprocess.run([*prefix, str(drivers[arch]), str(lib), str(src), str(dst)],
                                  capture_output=True, text=True, timeout=600)
            assert done.returncode == 0, done.stderr[-2000:]
            return np.fromfile(dst, dtype=np.float32)

        done = subprocess.run([*prefix, str(drivers[arch]), "--features", str(libs[arch]["generic"])],
                              capture_output=True, text=True, timeout=120, check=True)
        machines[name] = (run, int(done.stdout.split()[-1]), {isa: libs[arch][isa] for isa in isas})
    return machines


@pytest.mark.parametrize("machine", EMULATED)
def test_an_emulated_cpu_reports_the_paths_it_can_execute(emulated, machine):
    """CPUID / hwcaps as the generic library reads them on an AVX2-only, a pre-AVX and an aarch64 CPU."""
    _, features, _ = emulated[machine]
    assert features == EMULATED[machine][3]


def _matmul_cases():
    cases = []
    for qtype in TYPES:
        k = _cols(qtype, 5) * (2 if qtype.endswith("_K") else 1)
        blocks, w = _blocks(qtype, 37, k, seed=3)
        for rows in (1, 3, 8, 9):
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
            cases.append((qtype, k, blocks, w, x))
    return cases


@pytest.mark.slow
@pytest.mark.parametrize("machine, isa", [(m, isa) for m, spec in EMULATED.items() for isa in spec[2]])
def test_emulated_products_equal_the_gguf_package_and_the_reference(emulated, machine, isa):
    """Each path on a CPU that has only what it needs (an AVX-512 instruction in the AVX2 path
    would be SIGILL on the emulated Haswell), against the gguf package's dequantization, a dense
    fp64 product and the attention reference; the vector path against the generic one too."""
    run, _, libs = emulated[machine]
    records, want = b"", []
    for qtype in TYPES:  # dequantization: bit for bit the gguf package's
        k = _cols(qtype, 6)
        blocks, w = _blocks(qtype, 11, k)
        records += struct.pack("<iiqq", 1, TYPE_IDS[qtype], 11, k) + blocks.numpy().tobytes()
        want.append(("dequantize " + qtype, w, None))
    for qtype, k, blocks, w, x in _matmul_cases():
        records += struct.pack("<iiqqq", 2, TYPE_IDS[qtype], 37, k, x.shape[0]) + blocks.numpy().tobytes() + \
            x.numpy().tobytes()
        want.append((f"matmul {qtype} x{x.shape[0]}", (x.double() @ w.double().t()).float(), 1e-5 * k / 32))
    for group, window in ((1, 0), (3, 0), (2, 5)):
        q_lens, seq_lens = [1, 1, 1, 1], [1, 17, 40, 9]
        query, k_cache, v_cache, meta = make_batch(q_lens, seq_lens, group=group, head_dim=32)
        T, H, D = query.shape
        nb, bs, KVH = k_cache.shape[:3]
        tables = meta.block_tables.to(torch.int32).contiguous()
        records += struct.pack("<i9qff", 3, T, 4, H, KVH, D, bs, nb, tables.shape[1], window, 0.125, 0.0) + \
            query.numpy().tobytes() + np.arange(4, dtype=np.int64).tobytes() + k_cache.numpy().tobytes() + \
            v_cache.numpy().tobytes() + tables.numpy().tobytes() + meta.seq_lens.to(torch.int32).numpy().tobytes()
        expected = reference.paged_attention(query, k_cache, v_cache, meta, 0.125, window or None)
        want.append((f"attention group {group} window {window}", expected, 1e-5))
    got = torch.from_numpy(run(libs[isa], records))
    at = 0
    for name, expected, atol in want:
        part = got[at:at + expected.numel()].view(expected.shape)
        at += expected.numel()
        if atol is None:
            assert torch.equal(part, expected), name
        else:
            torch.testing.assert_close(part, expected, rtol=1e-5, atol=atol, msg=name)
    assert at == got.numel()
    if isa != "generic":  # and the vector path against the generic one on the same inputs
        torch.testing.assert_close(got, torch.from_numpy(run(libs["generic"], records)), rtol=1e-5, atol=1e-4)
