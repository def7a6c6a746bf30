"""The KV cache sized from GPU memory (``--gpu-memory-utilization``): the arithmetic on made-up
device numbers, the engine's choice between an explicit size, the profile and the CPU default,
and the operator-facing flags."""
from __future__ import annotations

import pytest

from slipstream.server.engine.config import CPU_KV_CACHE_BYTES, EngineConfig
from slipstream.server.engine.memory import GiB, MemoryProfile, plan_kv_cache

MiB = 1 << 20
BLOCK_BYTES = 16 * 2 * 16 * 8 * 128 * 2  # 16 tokens × K,V × 16 layers × 8 KV heads × 128 × bf16 = 1 MiB


def h200(free_gib: float, weights_gib: float = 2.3, peak_gib: float = 1.5, graphs_gib: float = 0.25) -> MemoryProfile:
    return MemoryProfile(total=int(139.8 * GiB), free=int(free_gib * GiB), weights=int(weights_gib * GiB),
                         peak_activations=int(peak_gib * GiB), graph_reserve=int(graphs_gib * GiB))


def test_the_pool_gets_what_utilization_leaves_after_weights_activations_and_graphs():
    profile = h200(free_gib=136.8)  # 3 GiB in use: the weights and the CUDA context
    plan = plan_kv_cache(profile, 0.9, BLOCK_BYTES, 16, 8192)
    left = int(139.8 * GiB * 0.9) - 3 * GiB - int(1.5 * GiB) - int(0.25 * GiB)
    assert plan.num_blocks == left // BLOCK_BYTES
    assert plan.kv_cache_bytes == plan.num_blocks * BLOCK_BYTES  # whole blocks only
    assert plan.budget == int(139.8 * GiB * 0.9) and plan.used == 3 * GiB
    line = plan.describe(profile, 0.9)
    assert "139.8 GiB total × 0.9" in line and f"({plan.num_blocks} blocks)" in line


def test_memory_other_processes_hold_comes_out_of_this_engines_share():
    alone = plan_kv_cache(h200(free_gib=136.8), 0.5, BLOCK_BYTES, 16, 8192)
    shared = plan_kv_cache(h200(free_gib=96.8), 0.5, BLOCK_BYTES, 16, 8192)  # another process holds 40 GiB
    assert (alone.kv_cache_bytes - shared.kv_cache_bytes) == 40 * GiB


def test_utilization_scales_the_budget_linearly():
    low, high = (plan_kv_cache(h200(free_gib=136.8), u, BLOCK_BYTES, 16, 8192) for u in (0.5, 0.9))
    assert high.num_blocks - low.num_blocks == (int(139.8 * GiB * 0.9) - int(139.8 * GiB * 0.5)) // BLOCK_BYTES


def test_no_room_for_one_request_is_a_clear_error_with_the_numbers():
    profile = h200(free_gib=12.0)  # 127.8 GiB in use already
    with pytest.raises(ValueError) as e:
        plan_kv_cache(profile, 0.9, BLOCK_BYTES, 16, 8192)
    msg = str(e.value)
    assert "one 8192-token request (0.50 GiB)" in msg and "gpu_memory_utilization 0.9" in msg
    assert "--gpu-memory-utilization" in msg and "--max-model-len" in msg and "--kv-cache-memory-bytes" in msg
    # exactly one request's blocks is enough
    exact = MemoryProfile(total=100 * GiB, free=100 * GiB, weights=0, peak_activations=0, graph_reserve=0)
    needed = 8192 // 16 * BLOCK_BYTES
    assert plan_kv_cache(exact, needed / (100 * GiB), BLOCK_BYTES, 16, 8192).num_blocks == 512
    with pytest.raises(ValueError):
        plan_kv_cache(exact, (needed - 1) / (100 * GiB), BLOCK_BYTES, 16, 8192)


@pytest.mark.parametrize("utilization", [0.0, -0.1, 1.01])
def test_utilization_outside_zero_to_one_is_refused(utilization):
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        plan_kv_cache(h200(free_gib=136.8), utilization, BLOCK_BYTES, 16, 8192)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=utilization)


def test_an_explicit_size_wins_and_the_cpu_default_is_one_gib(make_llm):
    assert EngineConfig().kv_cache_memory_bytes is None and CPU_KV_CACHE_BYTES == GiB
    default = make_llm(max_num_seqs=2).engine
    block_bytes = 16 * 46080  # the built-in model: 30 layers × K,V × 3 KV heads × 64 × fp32 = 46,080 bytes a token
    assert default.kv.num_blocks == GiB // block_bytes
    explicit = make_llm(max_num_seqs=2, kv_cache_memory_bytes=64 * MiB).engine
    assert explicit.kv.num_blocks == 64 * MiB // block_bytes
    assert explicit.runner.kv_cache.shape[2] == explicit.kv.num_blocks


def test_serve_flags_reach_the_engine_config():
    from slipstream.server.cli import engine_config, serve_parser

    args = serve_parser().parse_args(["--gpu-memory-utilization", "0.75", "--enforce-eager"])
    config = engine_config(args)
    assert (config.gpu_memory_utilization, config.enforce_eager, config.kv_cache_memory_bytes) == (0.75, True, None)
    defaults = engine_config(serve_parser().parse_args([]))
    assert (defaults.gpu_memory_utilization, defaults.enforce_eager) == (0.9, False)
    with pytest.raises(SystemExit):
        serve_parser().parse_args(["--gpu-memory-utilization", "1.5"])
