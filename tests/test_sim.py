"""The simulated backend: the cost model (pure), the ``sim:`` model string, and the real engine
driven by the cost-model runner (deterministic tokens, modelled sleep, profile-sized KV cache)."""
from __future__ import annotations

import asyncio
import time

import pytest

from slipstream.server.engine.async_llm import AsyncLLM
from slipstream.server.engine.config import EngineConfig
from slipstream.server.engine.sampling_params import SamplingParams
from slipstream.server.models.loader import load_tokenizer
from slipstream.server.sim.backend import SimRunner, build_engine, parse_sim_model, word_token_ids
from slipstream.server.sim.cost_model import (GB, LLAMA3_8B, PROFILES, BatchShape, Profile, batch_shape,
                                              get_profile, step_cost, step_time)

H100 = PROFILES["llama3-8b-h100"]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


# --- cost model ---------------------------------------------------------------------------------

def test_llama3_8b_numbers_match_the_published_shape():
    assert LLAMA3_8B.kv_bytes_per_token == 128 * 1024  # 32 layers × 8 KV heads × 128 × 2 × 2 bytes
    assert LLAMA3_8B.weight_bytes == pytest.approx(16.06 * GB)
    # 80 GiB × 0.9 − 16 GB ≈ 57 GiB ≈ 467k tokens of KV (vLLM logs ~450-470k on one H100 for this model)
    assert 450_000 < H100.kv_cache_tokens < 480_000


def test_batch_shape_counts_causal_attention_pairs_and_context():
    shape = batch_shape([(10, 4), (99, 1)])  # a 4-token chunk after 10 cached, one decode at 100
    assert shape == BatchShape(new_tokens=5, context_tokens=14 + 100, attention_pairs=(4 * 10 + 10) + (99 + 1))


def test_a_decode_step_is_the_weights_over_bandwidth_plus_overhead():
    cost = step_cost(H100, batch_shape([(0, 1)]))
    weights_and_kv = LLAMA3_8B.weight_bytes + 2 * LLAMA3_8B.kv_bytes_per_token
    assert cost.bound == "memory"
    assert cost.seconds == pytest.approx(H100.step_overhead + weights_and_kv / (3.35e12 * 0.8))


def test_decode_batches_almost_for_free_and_prefill_grows_linearly():
    one = step_time(H100, batch_shape([(500, 1)]))
    many = step_time(H100, batch_shape([(500, 1)] * 64))
    assert many < 1.5 * one  # 64× the tokens, the same weights read once
    prefill_2k = step_cost(H100, batch_shape([(0, 2048)]))
    prefill_4k = step_cost(H100, batch_shape([(0, 4096)]))
    assert prefill_2k.bound == "compute"
    assert 1.9 < (prefill_4k.seconds - H100.step_overhead) / (prefill_2k.seconds - H100.step_overhead) < 2.3


def test_more_bandwidth_makes_decode_faster_but_not_prefill():
    h200 = PROFILES["llama3-8b-h200"]
    decode = batch_shape([(1000, 1)] * 32)
    prefill = batch_shape([(0, 4096)])
    assert step_time(h200, decode) < 0.8 * step_time(H100, decode)
    assert step_time(h200, prefill) == pytest.approx(step_time(H100, prefill))


def test_an_empty_step_costs_nothing_and_unknown_profiles_are_named():
    assert step_time(H100, BatchShape()) == 0.0
    with pytest.raises(ValueError, match="known: .*llama3-8b-h100"):
        get_profile("gpt-5-on-a-toaster")


def test_weights_that_do_not_fit_leave_no_kv_cache():
    tiny_gpu = Profile("small", LLAMA3_8B, PROFILES["tiny"].device)  # 2 GB device, 16 GB of weights
    with pytest.raises(ValueError, match="leave no KV cache"):
        tiny_gpu.kv_cache_bytes


# --- the sim: model string ----------------------------------------------------------------------

def test_sim_model_string_parses_options():
    options = parse_sim_model("sim:tiny, time_scale=0.25, output_len=5-9, seed=3")
    assert (options.profile.name, options.time_scale, options.output_len, options.seed) == ("tiny", 0.25, (5, 9), 3)
    assert parse_sim_model("sim:llama3-8b-h200").output_len is None


@pytest.mark.parametrize("model, message", [
    ("sim:nope", "unknown simulation profile"),
    ("sim:tiny,speed=2", "unknown key"),
    ("sim:tiny,time_scale=0", "must be a finite number > 0"),
    ("sim:tiny,time_scale=inf", "must be a finite number > 0"),
    ("sim:tiny,output_len=9-5", "1 <= A <= B"),
    ("sim:tiny,output_len", "key=value"),
    ("sim:tiny,load_seconds=-1", "0..3600"),
    ("sim:tiny,load_seconds=1,load_seconds=2", "given twice"),
    ("builtin", "not a simulated model"),
])
def test_bad_sim_model_strings_say_what_is_wrong(model, message):
    with pytest.raises(ValueError, match=message):
        parse_sim_model(model)


def test_load_seconds_makes_the_engine_take_that_long_to_build():
    slept: list[float] = []
    build_engine(EngineConfig(model="sim:tiny,load_seconds=7.5"), sleep=slept.append)
    assert slept == [7.5]
    assert parse_sim_model("sim:tiny").load_seconds == 0


# --- the runner inside the real engine -----------------------------------------------------------

def _engine(tokenizer, model="sim:tiny,time_scale=0.001", **config):
    return build_engine(EngineConfig(model=model, **config), tokenizer=tokenizer)


def _generate(engine, prompts, **params):
    ids = {engine.add_request(p, SamplingParams(**params)): i for i, p in enumerate(prompts)}
    tokens: dict[int, list[int]] = {i: [] for i in ids.values()}
    reasons = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[ids[out.request_id]] += out.outputs[0].token_ids
            if out.finished:
                reasons[ids[out.request_id]] = out.outputs[0].finish_reason
    return tokens, reasons


def test_tokens_are_words_seeded_by_the_prompt_and_never_eos_without_output_len(tokenizer):
    prompts = ["Tell me a story", "Tell me a story", "Something else"]
    first, reasons = _generate(_engine(tokenizer), prompts, max_tokens=40, temperature=0.8)
    again, _ = _generate(_engine(tokenizer), prompts, max_tokens=40, temperature=0)
    assert first == again  # the same in a fresh engine, whatever the temperature
    assert first[0] == first[1] and first[0] != first[2]
    assert set(reasons.values()) == {"length"} and all(len(t) == 40 for t in first.values())
    words = set(word_token_ids(tokenizer))
    assert all(t in words for t in first[2])
    assert tokenizer.decode(first[2]).startswith(" ")


def test_output_len_ends_requests_with_eos_at_a_per_request_length(tokenizer):
    tokens, reasons = _generate(_engine(tokenizer, "sim:tiny,time_scale=0.001,output_len=3-12"),
                                [f"prompt {i}" for i in range(12)], max_tokens=50)
    lengths = {len(t) for t in tokens.values()}
    assert set(reasons.values()) == {"stop"}
    assert lengths <= set(range(3, 13)) and len(lengths) > 1
    # the max_tokens cap still wins
    _, capped = _generate(_engine(tokenizer, "sim:tiny,time_scale=0.001,output_len=30"), ["x"], max_tokens=5)
    assert capped == {0: "length"}


def test_a_preempted_request_regenerates_the_same_tokens(tokenizer):
    prompts = [f"request number {i} " * 4 for i in range(6)]
    roomy, _ = _generate(_engine(tokenizer), prompts, max_tokens=60)
    # 20 blocks of 16 tokens cannot hold six requests of ~80 tokens: the newest are preempted
    tight = _engine(tokenizer, kv_cache_memory_bytes=20 * 16 * 8192)
    squeezed, _ = _generate(tight, prompts, max_tokens=60)
    assert tight.scheduler.num_preemptions > 0
    assert squeezed == roomy


def test_kv_pool_is_sized_from_the_profile_unless_given(tokenizer):
    engine = _engine(tokenizer, "sim:llama3-8b-h100")
    assert engine.kv.num_blocks == H100.kv_cache_bytes // (16 * 128 * 1024)
    assert engine.max_model_len == 8192
    given = _engine(tokenizer, "sim:llama3-8b-h100", kv_cache_memory_bytes=64 * 16 * 128 * 1024)
    assert given.kv.num_blocks == 64


def test_runner_sleeps_the_modelled_step_time_scaled_and_counts_engine_time_toward_it(tokenizer):
    clock = [100.0]
    slept: list[float] = []

    def sleep(seconds):
        slept.append(seconds)
        clock[0] += seconds

    options = parse_sim_model("sim:llama3-8b-h100,time_scale=2")
    runner = SimRunner(options, 49152, 2, [300, 301], sleep=sleep, clock=lambda: clock[0])
    engine = build_engine(EngineConfig(model="sim:llama3-8b-h100,time_scale=2"), tokenizer=tokenizer)
    engine.runner = runner
    engine.add_request([5] * 100, SamplingParams(max_tokens=3))
    engine.step()  # prefill of 100 tokens, after an idle engine: the full modelled time
    prefill = step_time(H100, batch_shape([(0, 100)]))
    assert slept == [pytest.approx(2 * prefill)]
    clock[0] += 0.004  # the engine's own work between two steps of the same request
    engine.step()
    decode = step_time(H100, batch_shape([(100, 1)]))
    assert slept[1] == pytest.approx(2 * decode - 0.004)
    assert runner.modelled_seconds == pytest.approx(prefill + decode)


async def test_async_engine_queues_in_wall_clock_time_and_reports_kv_use(tokenizer):
    # 4 seats, 8 requests of 20 tokens: the second four wait for the first; each step is ~14 ms × 2
    engine = _engine(tokenizer, "sim:tiny,time_scale=2", max_num_seqs=4)
    llm = AsyncLLM(engine=engine)
    await llm.start()
    seen_kv = []

    async def one(i):
        first = None
        async for out in llm.generate(f"prompt {i}", SamplingParams(max_tokens=20)):
            first = first or time.monotonic()
            seen_kv.append(llm.stats().kv_cache_usage)
        return first

    try:
        start = time.monotonic()
        firsts = await asyncio.gather(*(one(i) for i in range(8)))
        elapsed = time.monotonic() - start
    finally:
        await llm.shutdown()
    modelled = 2 * engine.runner.modelled_seconds
    assert elapsed >= 0.95 * modelled  # the runner slept at least the modelled time
    assert modelled >= 2 * 20 * 0.013  # two waves of 20 decode steps
    waited = sorted(f - start for f in firsts)
    assert waited[4] > waited[3] + 10 * 0.013 * 2  # the second wave's first token came after the first wave's run
    assert max(seen_kv) > 0


def test_the_simulated_pool_follows_gpu_memory_utilization_unless_a_size_is_given():
    from slipstream.server.sim.backend import build_engine

    full = build_engine(EngineConfig(model="sim:llama3-8b-h100")).kv
    half = build_engine(EngineConfig(model="sim:llama3-8b-h100", gpu_memory_utilization=0.5)).kv
    profile = parse_sim_model("sim:llama3-8b-h100").profile
    per_block = 16 * profile.model.kv_bytes_per_token
    assert full.num_blocks == profile.kv_cache_bytes // per_block
    assert half.num_blocks == int(profile.device.memory_bytes * 0.5 - profile.model.weight_bytes) // per_block
    given = build_engine(EngineConfig(model="sim:llama3-8b-h100", gpu_memory_utilization=0.5,
                                      kv_cache_memory_bytes=64 * per_block)).kv
    assert given.num_blocks == 64
