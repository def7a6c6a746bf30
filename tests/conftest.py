"""Shared fixtures: one load of the built-in model for the whole session, engines built over it,
and a leak check after every test that built one."""
from __future__ import annotations

import os

import kernel_device  # noqa: F401 - first: TRITON_INTERPRET is set before anything (transformers' MoE models too) imports triton
import pytest
import torch

from slipstream.server.engine import LLM
from slipstream.server.models.loader import load_model

import termination

# The default CPU crossovers (models/crossover.py), not this machine's: which method a batch takes
# must not depend on where the tests run. tests/test_crossover.py measures with it unset.
os.environ.setdefault("SLIPSTREAM_CALIBRATE", "0")


def pytest_configure(config) -> None:
    config.pluginmanager.register(termination)  # a SIGTERM tears the session down (the cluster too), as Ctrl-C does


@pytest.fixture(scope="session")
def loaded():
    """The built-in model (SmolLM2-135M-Instruct, GGUF Q4_1), fp32 on CPU."""
    return load_model("builtin", torch.device("cpu"), torch.float32)


def assert_no_leaks(engine) -> None:
    kv = engine.kv
    assert not engine.groups, f"unfinished requests left: {list(engine.groups)}"
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert kv.num_free_blocks == kv.num_blocks, f"{kv.num_blocks - kv.num_free_blocks} KV blocks leaked"
    assert all(c == 0 for c in kv.ref_counts)


@pytest.fixture
def make_llm(loaded):
    """Build an :class:`LLM` over the shared model; after the test, every block must be free."""
    made: list[LLM] = []

    def make(**kwargs) -> LLM:
        llm = LLM(loaded=loaded, **kwargs)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        assert_no_leaks(llm.engine)


@pytest.fixture
def no_leaks():
    """The leak check as a function, for tests that drive an engine directly."""
    return assert_no_leaks


def _cpu_isas() -> list:
    """The CPU kernel paths this machine can execute, best first, as test parameters."""
    from slipstream.kernels import cpu_build, cpu_native

    try:
        return cpu_native.supported_isas()
    except (cpu_build.BuildError, OSError) as e:
        return [pytest.param(None, marks=pytest.mark.skip(reason=f"no CPU kernels here: {e}"))]


@pytest.fixture(params=_cpu_isas())
def cpu_isa(request, monkeypatch):
    """Each CPU kernel path this CPU executes, forced through SLIPSTREAM_CPU_ISA (an AVX-512
    machine also runs the AVX2 and generic paths); the default path again afterwards."""
    from slipstream.kernels import cpu_native

    monkeypatch.setenv(cpu_native.ENV_ISA, request.param)
    cpu_native.library.cache_clear()
    assert cpu_native.library() is not None and cpu_native.loaded_isa() == request.param
    yield request.param
    monkeypatch.undo()
    cpu_native.library.cache_clear()
