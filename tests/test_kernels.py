"""Paged-attention kernels: the torch reference against dense attention, the Triton kernels
against the reference (compiled on CUDA tensors when CUDA is present, else in Triton's
interpreter on CPU tensors: see ``kernel_device``), and the dispatch between them.

Tolerances compare each kernel with the reference run in fp32 on the same (already rounded)
inputs, so they bound only the kernel's own rounding:
- fp32: 1e-5 (summation order, exp2 vs exp);
- fp16: 2e-3 relative + 1e-3 absolute (probabilities rounded to fp16 for the P·V product as on
  tensor cores, output rounded to fp16: each ≤ 2^-11 relative);
- bf16: 8e-3 relative + 2e-3 absolute (output rounded to bf16: ≤ 2^-8 relative, as the interpreter
  truncates where a GPU rounds to nearest; it computes bf16 in fp32, see
  ``triton_common.compute_in_fp32``).
The KV write copies bits, so it must match the reference exactly.
"""
from __future__ import annotations

import importlib
import math

from kernel_device import DEVICE  # first: sets or clears TRITON_INTERPRET before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from slipstream import kernels  # noqa: E402
from slipstream.kernels import cpu_native, reference  # noqa: E402
from slipstream.kernels.metadata import AttentionMetadata  # noqa: E402

TRITON_MODULES = ("triton_common", "triton_kv_write", "triton_decode", "triton_prefill", "triton_attention")
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 1e-3), torch.bfloat16: (8e-3, 2e-3)}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                                 ids=["fp32", "fp16", "bf16"])


@pytest.fixture(scope="module")
def tk():
    """The Triton kernel modules: compiled on CUDA, defined under Triton's interpreter on CPU."""
    mods = {name: importlib.import_module(f"slipstream.kernels.{name}") for name in TRITON_MODULES}
    if DEVICE.type == "cuda":
        assert not mods["triton_common"].INTERPRETED, "Triton's interpreter is on in a CUDA run: unset TRITON_INTERPRET"
    else:
        assert mods["triton_common"].INTERPRETED, (
            "triton was imported before TRITON_INTERPRET=1 was set: run these tests in their own "
            "process or set TRITON_INTERPRET=1 in the environment")
    return type("Kernels", (), mods)


@pytest.fixture(scope="module")
def device():
    """Where the Triton tests' tensors live (``kernel_device.DEVICE``)."""
    return DEVICE


def to(device, *tensors):
    return [t.to(device) for t in tensors]


def on(device, meta: AttentionMetadata) -> AttentionMetadata:
    """``meta`` with its tensors on ``device``."""
    return AttentionMetadata(slot_mapping=meta.slot_mapping.to(device), query_start_loc=meta.query_start_loc.to(device),
                             seq_lens=meta.seq_lens.to(device), block_tables=meta.block_tables.to(device),
                             max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len)


def make_batch(q_lens, seq_lens, *, block_size=16, num_kv_heads=2, group=1, head_dim=64,
               dtype=torch.float32, pad_tokens=0, seed=0, device="cpu"):
    """Random caches and a batch over them with shuffled (non-contiguous) block tables.

    Request ``b`` has ``q_lens[b]`` new tokens ending a ``seq_lens[b]``-token context; its blocks
    are a random draw from a pool with spare blocks. ``pad_tokens`` query rows after the last
    request stand for padding (slot -1). Everything is drawn on CPU (the same numbers on every
    device), then moved to ``device``.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    pool = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    used = 0
    for b, n in enumerate(blocks_per_seq):
        tables[b, :n] = pool[used:used + n]
        used += n
    slots = [int(tables[b, p // block_size]) * block_size + p % block_size
             for b, (q, s) in enumerate(zip(q_lens, seq_lens)) for p in range(s - q, s)]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    query = torch.randn(sum(q_lens) + pad_tokens, num_kv_heads * group, head_dim, generator=gen).to(dtype)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots + [-1] * pad_tokens, dtype=torch.int64),
        query_start_loc=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables, max_query_len=max(q_lens), max_seq_len=max(seq_lens))
    return (*to(device, query, k_cache, v_cache), on(device, meta))


def oracle(query, k_cache, v_cache, meta, scale):
    """The reference in fp32 on the same rounded inputs, on CPU."""
    return reference.paged_attention(*(t.float().cpu() for t in (query, k_cache, v_cache)), on("cpu", meta), scale)


def assert_matches(out, expected, dtype):
    rtol, atol = TOL[dtype]
    assert out.dtype == dtype
    torch.testing.assert_close(out.float().cpu(), expected, rtol=rtol, atol=atol)


def boundary_contexts(block_size):
    """A 1-token context, contexts ending just before, on and just after a block boundary, and a
    multi-block one."""
    return [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 5]


# --- the oracle itself -------------------------------------------------------------------------

def dense_causal_attention(q, k, v, scale):
    """Per-request attention with no paging: ``q [q_len, h, d]`` at the end of ``k, v [seq_len, kvh, d]``."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = torch.empty_like(q)
    for i in range(q.shape[0]):
        pos = k.shape[0] - q.shape[0] + i
        probs = (torch.einsum("hd,jhd->hj", q[i], k[:pos + 1]) * scale).softmax(-1)
        out[i] = torch.einsum("hj,jhd->hd", probs, v[:pos + 1])
    return out


# Chunks mixed with one decode row; then decode rows whose contexts (1 token to 40 blocks, out of
# order) fall into three context groups of two different lengths each, next to two chunks.
BATCHES = {
    "mixed": lambda bs: ([1, 7, bs, 3], [1, 7, 3 * bs, 2 * bs + 1]),
    "decode-groups": lambda bs: ([1, 5, 1, 1, 3, 1, 1, 1],
                                 [9 * bs, 5, 1, 40 * bs + 3, 2 * bs, 6 * bs + 2, 30 * bs, 2]),
}


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("block_size", [4, 16])
def test_reference_equals_dense_causal_attention_per_request(block_size, group, batch):
    q_lens, seq_lens = BATCHES[batch](block_size)
    if batch == "decode-groups":
        decode = [b for b, q in enumerate(q_lens) if q == 1]
        assert reference.context_groups(decode, seq_lens) == [[3, 6], [0, 5], [7, 2]]
    num_kv_heads, head_dim, scale = 2, 8, 0.3
    gen = torch.Generator().manual_seed(1)
    keys = [torch.randn(s, num_kv_heads, head_dim, generator=gen, dtype=torch.float64) for s in seq_lens]
    values = [torch.randn(s, num_kv_heads, head_dim, generator=gen, dtype=torch.float64) for s in seq_lens]
    queries = [torch.randn(q, num_kv_heads * group, head_dim, generator=gen, dtype=torch.float64) for q in q_lens]
    _, k_cache, v_cache, meta = make_batch(q_lens, seq_lens, block_size=block_size,
                                           num_kv_heads=num_kv_heads, head_dim=head_dim)
    k_cache, v_cache = torch.zeros_like(k_cache, dtype=torch.float64), torch.zeros_like(v_cache, dtype=torch.float64)
    # Store every context token (not only the new ones) through its own slot.
    for b, s in enumerate(seq_lens):
        slots = torch.tensor([int(meta.block_tables[b, p // block_size]) * block_size + p % block_size
                              for p in range(s)])
        reference.write_kv(keys[b], values[b], k_cache, v_cache, slots)

    out = reference.paged_attention(torch.cat(queries), k_cache, v_cache, meta, scale)

    expected = torch.cat([dense_causal_attention(q, k, v, scale) for q, k, v in zip(queries, keys, values)])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)  # the reference computes in fp32


def test_context_groups_keep_each_group_within_twice_its_shortest():
    seq_lens = [100, 7, 1, 400, 60, 210, 51, 8]
    groups = reference.context_groups([0, 1, 2, 3, 4, 5, 6, 7], seq_lens)
    assert groups == [[3, 5], [0, 4, 6], [7, 1], [2]]
    assert reference.context_groups([4, 0], seq_lens) == [[0, 4]]  # only the given requests
    assert reference.context_groups([], seq_lens) == []


# --- Triton KV write ---------------------------------------------------------------------------

@DTYPES
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("kv_dtype", ["same", "fp32"])
def test_triton_write_kv_scatters_like_reference_and_skips_padding(tk, device, block_size, dtype, kv_dtype):
    q_lens = seq_lens = [3, block_size + 1]
    _, k_cache, v_cache, meta = make_batch(q_lens, seq_lens, block_size=block_size, dtype=dtype, pad_tokens=2,
                                           device=device)
    num_tokens, num_kv_heads, head_dim = meta.slot_mapping.shape[0], k_cache.shape[2], k_cache.shape[3]
    # K as a view into a fused QKV projection (strided rows), V contiguous; cache dtype or fp32.
    qkv = torch.randn(num_tokens, 3 * num_kv_heads * head_dim).to(device, dtype if kv_dtype == "same" else torch.float32)
    key = qkv[:, num_kv_heads * head_dim:2 * num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    value = qkv[:, 2 * num_kv_heads * head_dim:].reshape(num_tokens, num_kv_heads, head_dim).clone()
    before = k_cache.clone()
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference.write_kv(key, value, expected_k, expected_v, meta.slot_mapping)

    tk.triton_kv_write.write_kv(key, value, k_cache, v_cache, meta.slot_mapping)

    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    assert not torch.equal(k_cache, before)


# --- Triton decode -----------------------------------------------------------------------------

DECODE_CASES = [  # (block_size, head_dim, group, dtype): every dtype x group, both block sizes and head dims
    (16, 64, 1, torch.float32), (32, 128, 3, torch.float32), (16, 128, 8, torch.float32),
    (32, 64, 1, torch.float16), (16, 64, 3, torch.float16), (32, 128, 8, torch.float16),
    (16, 128, 1, torch.bfloat16), (32, 64, 3, torch.bfloat16), (16, 64, 8, torch.bfloat16),
]


def case_id(case):
    block_size, head_dim, group, dtype = case
    return f"bs{block_size}-d{head_dim}-g{group}-{str(dtype).removeprefix('torch.')}"


@pytest.mark.parametrize("case", DECODE_CASES, ids=case_id)
def test_triton_decode_matches_reference_unsplit_and_split_k(tk, device, case):
    block_size, head_dim, group, dtype = case
    seq_lens = boundary_contexts(block_size)
    query, k_cache, v_cache, meta = make_batch([1] * len(seq_lens), seq_lens, block_size=block_size,
                                               group=group, head_dim=head_dim, dtype=dtype, device=device)
    scale = head_dim ** -0.5
    expected = oracle(query, k_cache, v_cache, meta, scale)

    for num_splits in (1, 4):  # 4 partitions of 32 keys: requests fill 1..4 of them
        out = torch.zeros_like(query)
        tk.triton_decode.decode_attention(query, k_cache, v_cache, meta, scale, out,
                                          num_splits=num_splits, tile_n=16)
        assert_matches(out, expected, dtype)


def test_triton_decode_default_tiles_on_long_context(tk, device):
    seq_lens = [1, 200, 64, 65]
    query, k_cache, v_cache, meta = make_batch([1] * 4, seq_lens, block_size=16, group=3, device=device)
    expected = oracle(query, k_cache, v_cache, meta, 0.125)
    for num_splits in (None, 3):
        out = torch.zeros_like(query)
        tk.triton_decode.decode_attention(query, k_cache, v_cache, meta, 0.125, out, num_splits=num_splits)
        assert_matches(out, expected, torch.float32)


def test_decode_partitions_cover_the_context_in_whole_tiles(tk):
    choose = tk.triton_decode.choose_partition
    cpu = torch.device("cpu")
    assert choose(8, 2, 4096, cpu) == (1, 4096)
    for max_seq_len, forced in ((1, 4), (100, 4), (4096, 7), (65, 64)):
        splits, partition = choose(1, 1, max_seq_len, cpu, num_splits=forced, tile_n=16)
        assert partition % 16 == 0 and 1 <= splits <= forced
        assert (splits - 1) * partition < max_seq_len <= splits * partition


# --- Triton prefill ----------------------------------------------------------------------------

def prefill_batch(block_size):
    """(q_lens, seq_lens): a fresh prompt crossing a boundary, a chunk ending on a boundary, a
    prefix-cache hit ending just before one, a short chunk just after one, and a decode row."""
    return ([block_size + 1, 5, block_size, 3, 1],
            [block_size + 1, 2 * block_size, 3 * block_size - 1, 2 * block_size + 1, 7])


@pytest.mark.parametrize("case", DECODE_CASES, ids=case_id)
def test_triton_prefill_matches_reference_on_chunks_and_cached_prefixes(tk, device, case):
    block_size, head_dim, group, dtype = case
    q_lens, seq_lens = prefill_batch(block_size)
    query, k_cache, v_cache, meta = make_batch(q_lens, seq_lens, block_size=block_size, group=group,
                                               head_dim=head_dim, dtype=dtype, device=device)
    scale = head_dim ** -0.5
    expected = oracle(query, k_cache, v_cache, meta, scale)

    # Small tiles put several query tiles and key tiles in each request; then the defaults.
    for block_m, tile_n in ((16, 16), (64, 64)):
        out = torch.zeros_like(query)
        tk.triton_prefill.prefill_attention(query, k_cache, v_cache, meta, scale, out,
                                            min_q_len=1, block_m=block_m, tile_n=tile_n)
        assert_matches(out, expected, dtype)


def test_triton_prefill_leaves_rows_shorter_than_min_q_len_to_decode(tk, device):
    query, k_cache, v_cache, meta = make_batch([1, 4], [9, 9], device=device)
    out = torch.zeros_like(query)
    tk.triton_prefill.prefill_attention(query, k_cache, v_cache, meta, 0.125, out, min_q_len=2)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert_matches(out[1:], oracle(query, k_cache, v_cache, meta, 0.125)[1:], torch.float32)


# --- the entry point ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_entry_point_runs_a_mixed_batch_with_padding_through_triton(tk, device, monkeypatch, dtype):
    # Decode rows (1-token and multi-block contexts), a chunk after a cached prefix, a fresh
    # prompt, and two padding tokens at the end; K/V are written through the entry point first.
    q_lens, seq_lens = [1, 1, 6, 19, 2, 1], [1, 50, 38, 19, 17, 16]
    query, k_cache, v_cache, meta = make_batch(q_lens, seq_lens, group=3, dtype=dtype, pad_tokens=2, device=device)
    key = torch.randn(query.shape[0], k_cache.shape[2], k_cache.shape[3]).to(device, dtype)
    value = torch.randn_like(key)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()

    monkeypatch.setenv("SLIPSTREAM_ATTENTION", "triton")
    kernels.write_kv(key, value, k_cache, v_cache, meta.slot_mapping)
    out = kernels.paged_attention(query, k_cache, v_cache, meta, 0.125)
    monkeypatch.setenv("SLIPSTREAM_ATTENTION", "torch")
    kernels.write_kv(key, value, k_ref, v_ref, meta.slot_mapping)
    expected = oracle(query, k_ref, v_ref, meta, 0.125)

    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    assert_matches(out, expected, dtype)
    assert torch.equal(out[-2:], torch.zeros_like(out[-2:]))  # padding rows


CPU_DEFAULT = "cpu_attention" if cpu_native.available() else "reference"


def poison_unseen_slots(k_cache, v_cache, meta, window=None):
    """Copies of the caches with NaN in every slot no query of the batch may see: past each
    context, behind each window, and blocks no request owns (block 0 pads every table)."""
    seen = torch.zeros(k_cache.shape[:2], dtype=torch.bool)
    bs = k_cache.shape[1]
    bounds, lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
    for b, (q_len, seq_len) in enumerate(zip([e - s for s, e in zip(bounds, bounds[1:])], lens)):
        first = 0 if window is None else max(0, seq_len - q_len - window + 1)
        for pos in range(first, seq_len):
            seen[int(meta.block_tables[b, pos // bs]), pos % bs] = True
    nan = torch.tensor(float("nan"), dtype=k_cache.dtype)
    return (torch.where(seen[..., None, None].to(k_cache.device), k_cache, nan.to(k_cache.device)),
            torch.where(seen[..., None, None].to(v_cache.device), v_cache, nan.to(v_cache.device)))


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("mode", ["torch", "auto", "triton"])
def test_nan_in_slots_a_request_cannot_see_never_reaches_its_output(tk, device, monkeypatch, mode, window):
    """A damaged request's K/V (NaN) stays in its blocks after it is freed, and padding reads
    other requests' blocks: every backend must give the same output as over clean slots, since
    a masked score still multiplies its value by 0 and 0 × NaN is NaN."""
    if mode == "triton" and DEVICE.type != "cuda" and not tk.triton_common.INTERPRETED:
        pytest.skip("no Triton here")
    dev = device if mode == "triton" else torch.device("cpu")
    q_lens, seq_lens = [1, 1, 6, 19, 2, 1], [1, 50, 38, 19, 17, 16]  # decode rows, chunks, a cached prefix
    query, k_cache, v_cache, meta = make_batch(q_lens, seq_lens, group=3, pad_tokens=2, device=dev)
    monkeypatch.setenv("SLIPSTREAM_ATTENTION", mode)
    clean = kernels.paged_attention(query, k_cache, v_cache, meta, 0.125, window)
    k_bad, v_bad = poison_unseen_slots(k_cache.cpu(), v_cache.cpu(), on("cpu", meta), window)
    meta.backend_cache.clear()
    out = kernels.paged_attention(query, k_bad.to(dev), v_bad.to(dev), meta, 0.125, window)
    assert not out.isnan().any(), f"{int(out.isnan().any(-1).any(-1).sum())} rows got NaN"
    torch.testing.assert_close(out, clean, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode, expected", [("auto", CPU_DEFAULT), ("torch", "reference"),
                                            ("triton", "triton_attention"), (" Triton ", "triton_attention")])
def test_slipstream_attention_selects_the_backend_for_cpu_tensors(tk, monkeypatch, mode, expected):
    if expected == "triton_attention" and DEVICE.type == "cuda":
        pytest.skip("CPU tensors run the Triton kernels only in the interpreter, which a CUDA run leaves off")
    monkeypatch.setenv("SLIPSTREAM_ATTENTION", mode)
    assert kernels.select_backend(torch.zeros(1)).__name__ == f"slipstream.kernels.{expected}"


def test_default_backend_on_cpu_is_the_c_decode_kernel_where_it_builds(monkeypatch):
    monkeypatch.delenv("SLIPSTREAM_ATTENTION", raising=False)
    assert kernels.select_backend(torch.zeros(1)).__name__ == f"slipstream.kernels.{CPU_DEFAULT}"
    assert kernels.select_backend(torch.zeros(1, dtype=torch.bfloat16)).__name__ == f"slipstream.kernels.{CPU_DEFAULT}"


@pytest.mark.parametrize("group", [1, 3])
def test_cpu_decode_kernel_matches_the_reference(group, cpu_isa):
    from slipstream.kernels import cpu_attention
    if not cpu_native.available():
        pytest.skip("no C compiler: the CPU kernels cannot be built")
    # Decode rows with 1-token, one-block and multi-block contexts beside a prefill chunk and a
    # chunk after a cached prefix (those go to the reference), then padding tokens.
    q_lens, seq_lens = [1, 1, 6, 1, 19, 1], [1, 50, 38, 16, 19, 33]
    query, k_cache, v_cache, meta = make_batch(q_lens, seq_lens, group=group, dtype=torch.float32, pad_tokens=2,
                                               device=torch.device("cpu"))
    out = cpu_attention.paged_attention(query, k_cache, v_cache, meta, 0.125)
    torch.testing.assert_close(out, reference.paged_attention(query, k_cache, v_cache, meta, 0.125),
                               rtol=1e-5, atol=1e-6)
    assert torch.equal(out[-2:], torch.zeros_like(out[-2:]))  # padding rows
    assert meta.backend_cache, "the plan is kept for the next layer"
    again = cpu_attention.paged_attention(query, k_cache, v_cache, meta, 0.125)
    assert torch.equal(again, out)
    bf16 = cpu_attention.paged_attention(query.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(), meta, 0.125)
    assert bf16.dtype == torch.bfloat16  # other dtypes take the reference


def test_unknown_slipstream_attention_value_is_rejected(monkeypatch):
    monkeypatch.setenv("SLIPSTREAM_ATTENTION", "cuda")
    with pytest.raises(ValueError, match="SLIPSTREAM_ATTENTION must be one of auto, torch, triton, got 'cuda'"):
        kernels.select_backend(torch.zeros(1))


def test_forcing_triton_on_cpu_without_the_interpreter_says_how_to_fix_it(tk, monkeypatch):
    monkeypatch.setenv("SLIPSTREAM_ATTENTION", "triton")
    monkeypatch.setattr(tk.triton_common, "INTERPRETED", False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1.*SLIPSTREAM_ATTENTION=torch"):
        kernels.select_backend(torch.zeros(1))


def test_triton_attention_rejects_mismatched_dtypes(tk, device):
    query, k_cache, v_cache, meta = make_batch([1], [5], device=device)
    with pytest.raises(ValueError, match="dtypes must match"):
        tk.triton_attention.paged_attention(query.half(), k_cache, v_cache, meta, 0.125)
