"""CUDA graphs for decode, checked where no GPU runs them: the buckets, the padded static
layout, the one-copy transfer, and the padded graph path run eagerly on CPU against the plain
step. (Capture and replay on a GPU are in ``make gpu-check``.)"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from slipstream.server.engine.cuda_graphs import bucket, capture_sizes
from slipstream.server.engine.model_runner import ModelRunner
from slipstream.server.engine.outputs import RequestMetrics
from slipstream.server.engine.request import Request
from slipstream.server.engine.sampling_params import SamplingParams
from slipstream.server.engine.scheduler import SchedulerOutput
from slipstream.server.engine.step_inputs import Transfer, layout, unpack


@pytest.mark.parametrize("max_num_seqs, sizes", [
    (1, [1]), (2, [1, 2]), (12, [1, 2, 4, 8, 12]), (32, [1, 2, 4, 8, 16, 32]), (33, [1, 2, 4, 8, 16, 32, 33])])
def test_buckets_are_powers_of_two_up_to_max_num_seqs(max_num_seqs, sizes):
    assert capture_sizes(max_num_seqs) == sizes


def test_a_batch_takes_the_smallest_bucket_that_holds_it():
    sizes = capture_sizes(12)
    assert [bucket(n, sizes) for n in (1, 2, 3, 4, 5, 8, 9, 12, 13)] == [1, 2, 4, 4, 8, 8, 12, 12, None]
    with pytest.raises(ValueError):
        capture_sizes(0)


def request(rid: str, tokens: list[int], computed: int, blocks: list[int]) -> Request:
    r = Request(rid, rid, 0, tokens, SamplingParams(), None, RequestMetrics(0.0))
    r.num_computed_tokens, r.block_table = computed, blocks
    return r


def decode_batch() -> SchedulerOutput:
    a = request("a", list(range(100, 120)), 19, [7, 3])  # position 19: block 3, offset 3
    b = request("b", list(range(200, 205)), 4, [5])
    return SchedulerOutput([a, b], [1, 1])


def test_padding_adds_sequences_that_write_nothing_and_read_one_token():
    plain = layout(decode_batch(), 16, [0, 1])
    padded = layout(decode_batch(), 16, [0, 1], num_seqs=4, table_width=6)
    assert plain.input_ids.tolist() == [119, 204] and plain.positions.tolist() == [19, 4]
    assert plain.slot_mapping.tolist() == [3 * 16 + 3, 5 * 16 + 4]
    assert plain.block_tables.tolist() == [[7, 3], [5, 0]]
    assert (plain.max_query_len, plain.max_seq_len, plain.sample_rows.tolist()) == (1, 20, [0, 1])
    assert padded.input_ids.tolist() == [119, 204, 0, 0]
    assert padded.slot_mapping.tolist() == [51, 84, -1, -1]
    assert padded.query_start_loc.tolist() == [0, 1, 2, 3, 4] and padded.seq_lens.tolist() == [20, 5, 1, 1]
    assert padded.block_tables.shape == (4, 6) and padded.block_tables[:2, :2].tolist() == [[7, 3], [5, 0]]
    assert not padded.block_tables[2:].any() and padded.num_requests == 2
    assert (padded.max_query_len, padded.max_seq_len) == (1, 20)  # of the real requests only


def test_padding_refuses_what_a_graph_cannot_hold():
    batch = decode_batch()
    with pytest.raises(ValueError):
        layout(batch, 16, [0, 1], num_seqs=1)
    with pytest.raises(ValueError, match="more than the table's 1"):
        layout(batch, 16, [0, 1], num_seqs=2, table_width=1)
    chunk = SchedulerOutput([request("c", list(range(40)), 0, [1, 2, 3])], [40])
    with pytest.raises(ValueError):
        layout(chunk, 16, [0], num_seqs=2)


def test_a_prefill_chunk_lays_out_its_rows_and_samples_its_last():
    c = request("c", list(range(40)), 16, [4, 9, 2])  # second chunk: positions 16..39
    d = request("d", [1, 2, 3], 2, [6])
    step = layout(SchedulerOutput([c, d], [24, 1]), 16, [0, 1])
    assert step.positions[:24].tolist() == list(range(16, 40))
    assert step.slot_mapping[:24].tolist() == [9 * 16 + i for i in range(16)] + [2 * 16 + i for i in range(8)]
    assert step.query_start_loc.tolist() == [0, 24, 25] and step.sample_rows.tolist() == [23, 24]
    assert (step.max_query_len, step.max_seq_len) == (24, 40)


def test_one_transfer_carries_every_field_and_unpacks_to_the_metadata():
    step = layout(decode_batch(), 16, [1])
    flat = Transfer(torch.device("cpu"))(step)
    assert flat.dtype == torch.int64 and flat.numel() == sum(p.size for p in step.parts())
    inputs = unpack(flat, step)
    assert inputs.input_ids.tolist() == [119, 204] and inputs.sample_rows.tolist() == [1]
    meta = inputs.meta
    assert meta.query_start_loc.dtype == meta.seq_lens.dtype == meta.block_tables.dtype == torch.int32
    assert meta.slot_mapping.dtype == torch.int64 and meta.block_tables.tolist() == [[7, 3], [5, 0]]
    assert (meta.max_query_len, meta.max_seq_len) == (1, 20)


def graph_runner(engine) -> ModelRunner:
    """Swap a fresh engine's runner for one on the graph path (padded static buffers, run eagerly
    on CPU), over a cache of the same size."""
    runner = ModelRunner(engine.runner.model, engine.kv.block_size, engine.device, engine.dtype,
                         max_num_seqs=engine.scheduler.max_num_seqs, graphs=True)
    runner.allocate_kv_cache(engine.kv.num_blocks, engine.max_model_len)
    engine.runner = runner
    return runner


def test_the_graph_path_gives_the_eager_tokens_as_the_batch_shrinks_through_the_buckets(make_llm):
    from slipstream.server.engine import SamplingParams as Params

    prompts = [[1, 504, 3458, 314, 260, 2296, 30] * (i + 1) for i in range(7)]
    params = [Params(temperature=0, max_tokens=3 + 2 * i, ignore_eos=True) for i in range(7)]  # 7 → 1 running
    eager = make_llm(max_num_seqs=8, max_model_len=512, kv_cache_memory_bytes=32 << 20)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    llm = make_llm(max_num_seqs=8, max_model_len=512, kv_cache_memory_bytes=32 << 20)
    runner = graph_runner(llm.engine)
    assert runner.graphs.sizes == [1, 2, 4, 8] and runner.graphs.width == 32
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == want
    assert runner.graphs.num_replays >= 12 and runner.graphs.num_padded_rows > 0


def test_steps_a_graph_cannot_hold_run_eagerly(make_llm):
    llm = make_llm(max_num_seqs=4, max_model_len=256, kv_cache_memory_bytes=16 << 20, max_num_batched_tokens=64)
    runner = graph_runner(llm.engine)
    [out] = llm.generate([[1, 504, 3458] * 30], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 2
    # 90 prompt tokens in 64-token chunks run eagerly; only the one decode step replays
    assert runner.graphs.num_replays == 1
    assert np.array_equal(runner.kv_cache.shape, (30, 2, llm.engine.kv.num_blocks, 16, 3, 64))
