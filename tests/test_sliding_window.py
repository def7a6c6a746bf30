"""Sliding-window attention and attention logit soft-capping in every paged-attention backend.

The reference is checked against dense attention written out per query (a query at position
``p`` sees keys ``p - window < j <= p``, transformers' ``sliding_window_overlay``; scores capped
as ``softcap * tanh(s / softcap)``); the C decode kernel and the Triton kernels (compiled on
CUDA, in the interpreter on CPU: see ``kernel_device``) are checked against the reference with
windows smaller than the context, ending on, before and after block boundaries, and in chunks
after a cached prefix.
"""
from __future__ import annotations

from kernel_device import DEVICE  # first: sets or clears TRITON_INTERPRET before triton is imported

import importlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from slipstream import kernels  # noqa: E402
from slipstream.kernels import cpu_native, reference  # noqa: E402
from test_kernels import assert_matches, make_batch, on  # noqa: E402

SCALE = 0.125


def dense(q, k, v, scale, window=None, softcap=None):
    """Per-request attention with no paging: ``q [q_len, h, d]`` at the end of ``k, v [seq_len, kvh, d]``."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = torch.empty_like(q)
    for i in range(q.shape[0]):
        pos = k.shape[0] - q.shape[0] + i
        lo = 0 if window is None else max(0, pos - window + 1)
        scores = torch.einsum("hd,jhd->hj", q[i], k[lo:pos + 1]) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        out[i] = torch.einsum("hj,jhd->hd", scores.softmax(-1), v[lo:pos + 1])
    return out


def contexts_of(k_cache, v_cache, meta):
    """Each request's keys and values in position order, read back through its block table."""
    bs = k_cache.shape[1]
    out = []
    for b, s in enumerate(meta.seq_lens.tolist()):
        slots = torch.tensor([int(meta.block_tables[b, p // bs]) * bs + p % bs for p in range(s)])
        out.append((k_cache.view(-1, *k_cache.shape[2:])[slots], v_cache.view(-1, *v_cache.shape[2:])[slots]))
    return out


# q_lens, seq_lens with block size 4: decode rows whose context is shorter than, equal to and
# longer than the window (3 blocks + 1), prefill chunks after a cached prefix crossing blocks.
Q_LENS, SEQ_LENS = [1, 1, 1, 1, 9, 5, 13], [3, 6, 7, 30, 9, 22, 41]


@pytest.mark.parametrize("softcap", [None, 5.0], ids=["nocap", "cap5"])
@pytest.mark.parametrize("window", [None, 1, 6, 13], ids=["full", "w1", "w6", "w13"])
@pytest.mark.parametrize("group", [1, 3])
def test_reference_equals_dense_windowed_softcapped_attention(group, window, softcap):
    query, k_cache, v_cache, meta = make_batch(Q_LENS, SEQ_LENS, block_size=4, group=group, head_dim=8,
                                               dtype=torch.float64)
    query = query * 4  # scores of several units, so the cap bends them
    out = reference.paged_attention(query, k_cache, v_cache, meta, SCALE, window=window, softcap=softcap)

    bounds = meta.query_start_loc.tolist()
    expected = torch.cat([dense(query[bounds[b]:bounds[b + 1]], k, v, SCALE, window, softcap)
                          for b, (k, v) in enumerate(contexts_of(k_cache, v_cache, meta))])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)  # the reference computes in fp32


def test_window_and_softcap_change_the_result():
    query, k_cache, v_cache, meta = make_batch(Q_LENS, SEQ_LENS, block_size=4, head_dim=8)
    query = query * 4
    full = reference.paged_attention(query, k_cache, v_cache, meta, SCALE)
    windowed = reference.paged_attention(query, k_cache, v_cache, meta, SCALE, window=6)
    capped = reference.paged_attention(query, k_cache, v_cache, meta, SCALE, softcap=2.0)
    short = [0]  # request 0 (3 tokens) lies inside the window: unchanged
    assert torch.equal(windowed[short], full[short])
    assert not torch.allclose(windowed[1:], full[1:], atol=1e-3)
    assert not torch.allclose(capped, full, atol=1e-3)
    # A window as long as every context is full attention.
    assert torch.allclose(reference.paged_attention(query, k_cache, v_cache, meta, SCALE, window=41), full)


@pytest.mark.parametrize("window, softcap, match", [(0, None, "window must be at least 1"),
                                                    (None, 0.0, "soft-cap must be positive")])
def test_bad_window_or_softcap_is_rejected(window, softcap, match):
    query, k_cache, v_cache, meta = make_batch([1], [5])
    with pytest.raises(ValueError, match=match):
        kernels.paged_attention(query, k_cache, v_cache, meta, SCALE, window=window, softcap=softcap)


@pytest.mark.parametrize("softcap", [None, 5.0], ids=["nocap", "cap5"])
@pytest.mark.parametrize("window", [1, 6, 16, 17], ids=["w1", "w6", "w16", "w17"])
@pytest.mark.parametrize("group", [1, 3])
def test_cpu_decode_kernel_matches_the_reference_with_a_window(group, window, softcap):
    from slipstream.kernels import cpu_attention
    if not cpu_native.available():
        pytest.skip("no C compiler: the CPU kernels cannot be built")
    q_lens, seq_lens = [1, 1, 6, 1, 19, 1, 1], [1, 50, 38, 16, 19, 33, 17]
    query, k_cache, v_cache, meta = make_batch(q_lens, seq_lens, group=group, pad_tokens=2, device=torch.device("cpu"))
    query = query * 4
    out = cpu_attention.paged_attention(query, k_cache, v_cache, meta, SCALE, window=window, softcap=softcap)
    expected = reference.paged_attention(query, k_cache, v_cache, meta, SCALE, window=window, softcap=softcap)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out, reference.paged_attention(query, k_cache, v_cache, meta, SCALE), atol=1e-3)


# --- Triton ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tk():
    names = ("triton_common", "triton_decode", "triton_prefill", "triton_attention")
    return type("Kernels", (), {n: importlib.import_module(f"slipstream.kernels.{n}") for n in names})


CASES = [  # (block_size, group, dtype, window, softcap)
    (16, 1, torch.float32, 16, None), (16, 3, torch.float32, 5, 5.0), (32, 8, torch.float32, 33, None),
    (16, 3, torch.float16, 20, 5.0), (32, 1, torch.bfloat16, 7, None), (16, 1, torch.float32, None, 5.0),
]


def case_id(case):
    bs, group, dtype, window, softcap = case
    return f"bs{bs}-g{group}-{str(dtype).removeprefix('torch.')}-w{window}-cap{softcap}"


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_triton_decode_matches_reference_with_window_and_softcap(tk, case):
    block_size, group, dtype, window, softcap = case
    seq_lens = [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 5, 200]
    query, k_cache, v_cache, meta = make_batch([1] * len(seq_lens), seq_lens, block_size=block_size, group=group,
                                               dtype=dtype, device=DEVICE)
    query = query * 4
    expected = oracle_with(query, k_cache, v_cache, meta, window, softcap)
    # 4 partitions of 64 keys: the window leaves the first ones of a long context empty.
    for num_splits in (1, 4):
        out = torch.zeros_like(query)
        tk.triton_decode.decode_attention(query, k_cache, v_cache, meta, SCALE, out, num_splits=num_splits,
                                          tile_n=16, window=window, softcap=softcap)
        assert_matches(out, expected, dtype)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_triton_prefill_matches_reference_with_window_and_softcap_in_chunks(tk, case):
    block_size, group, dtype, window, softcap = case
    # A fresh prompt longer than the window, a chunk after a cached prefix ending on a boundary,
    # one ending just before one, and a decode row.
    q_lens = [3 * block_size + 1, 5, block_size + 3, 1]
    seq_lens = [3 * block_size + 1, 2 * block_size, 4 * block_size - 1, 7]
    query, k_cache, v_cache, meta = make_batch(q_lens, seq_lens, block_size=block_size, group=group, dtype=dtype,
                                               device=DEVICE)
    query = query * 4
    expected = oracle_with(query, k_cache, v_cache, meta, window, softcap)
    for block_m, tile_n in ((16, 16), (64, 64)):
        out = torch.zeros_like(query)
        tk.triton_prefill.prefill_attention(query, k_cache, v_cache, meta, SCALE, out, min_q_len=1, block_m=block_m,
                                            tile_n=tile_n, window=window, softcap=softcap)
        assert_matches(out, expected, dtype)


def test_triton_entry_point_passes_window_and_softcap(tk):
    q_lens, seq_lens = [1, 1, 6, 19, 2], [1, 50, 38, 19, 17]
    query, k_cache, v_cache, meta = make_batch(q_lens, seq_lens, group=3, pad_tokens=2, device=DEVICE)
    out = tk.triton_attention.paged_attention(query, k_cache, v_cache, meta, SCALE, window=9, softcap=3.0)
    assert_matches(out, oracle_with(query, k_cache, v_cache, meta, 9, 3.0), torch.float32)
    assert torch.equal(out[-2:], torch.zeros_like(out[-2:]))  # padding rows


def oracle_with(query, k_cache, v_cache, meta, window, softcap):
    """The reference in fp32 on the same rounded inputs, on CPU, with the window and cap."""
    return reference.paged_attention(*(t.float().cpu() for t in (query, k_cache, v_cache)), on("cpu", meta), SCALE,
                                     window=window, softcap=softcap)



# --- a model with a sliding window, end to end -------------------------------------------------

@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """A tiny random MistralForCausalLM with a 16-token window, its prompts and transformers' greedy
    output with the window and without it."""
    from transformers import MistralConfig, MistralForCausalLM

    from tiny_checkpoints import hf_greedy, prompts, save_checkpoint
    from slipstream.server.models.loader import load_tokenizer

    eos = load_tokenizer("builtin").eos_token_id
    config = MistralConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=16,
                           max_position_embeddings=512, initializer_range=0.2, tie_word_embeddings=False,
                           bos_token_id=1, eos_token_id=eos, pad_token_id=eos)
    path = save_checkpoint(MistralForCausalLM, config, tmp_path_factory.mktemp("mistral"))
    ps = prompts(path, 16)
    return path, ps, hf_greedy(path, MistralForCausalLM, ps, eos), hf_greedy(path, MistralForCausalLM, ps, eos,
                                                                                sliding_window=None)


def test_mistral_window_reaches_the_config_not_a_shorter_context(mistral):
    from slipstream.server.models.loader import load_model
    path, _, _, _ = mistral
    loaded = load_model(str(path), torch.device("cpu"), torch.float32)
    assert loaded.config.layer_windows == [16] * 4 and loaded.config.sliding_window == 16
    assert loaded.config.max_position_embeddings == 512  # no longer cut to the window
    assert [layer.self_attn.window for layer in loaded.model.layers] == [16] * 4


def test_mistral_greedy_tokens_equal_transformers_with_prompts_longer_than_the_window(mistral, no_leaks):
    from tiny_checkpoints import assert_not_degenerate, check_engine_modes
    path, ps, expected, unwindowed = mistral
    assert_not_degenerate(expected)
    assert unwindowed != expected, "the window should change the output, or this test proves nothing about it"
    check_engine_modes(path, ps, expected, no_leaks)


@pytest.mark.parametrize("arch, raw, expected", [
    ("MistralForCausalLM", {"sliding_window": 8}, [8, 8, 8]),
    ("MistralForCausalLM", {"sliding_window": None}, []),  # Mistral 7B v0.2 and later
    ("Qwen2ForCausalLM", {"sliding_window": 8, "use_sliding_window": False}, []),  # every released Qwen2
    ("Qwen2ForCausalLM", {"sliding_window": 8, "use_sliding_window": True, "max_window_layers": 1}, [None, 8, 8]),
    ("Qwen2ForCausalLM", {"sliding_window": 8, "use_sliding_window": True,
                          "layer_types": ["sliding_attention", "full_attention", "full_attention"]}, [8, None, None]),
    ("LlamaForCausalLM", {}, []),
])
def test_layer_windows_follow_transformers_reading_of_the_config(arch, raw, expected):
    from slipstream.server.models.hf_checkpoint import layer_windows as _layer_windows
    assert _layer_windows(raw, arch, 3) == expected


def test_a_windowed_request_longer_than_the_whole_kv_cache_matches_transformers(mistral, no_leaks):
    """Blocks behind the window are released as a request moves, so with small prefill chunks a
    request far longer than the pool runs in it, and its tokens are still transformers'."""
    import dataclasses

    from tiny_checkpoints import GREEDY, MAX_TOKENS, tokens
    from slipstream.server.engine import LLM
    path, ps, expected, _ = mistral
    probe = LLM(model=str(path))
    per_block = 16 * probe.engine.model_config.kv_bytes_per_token(4)
    llm = LLM(model=str(path), kv_cache_memory_bytes=4 * per_block, max_num_batched_tokens=12, trace=True)
    kv = llm.engine.kv
    assert kv.num_blocks == 4 and kv.sliding_window == 16
    assert llm.engine.max_model_len == 512, "a window plus a chunk fits: the context is not cut to the pool"
    longest = max(range(len(ps)), key=lambda i: len(ps[i]))
    assert len(ps[longest]) + MAX_TOKENS > kv.num_slots, "the request should not fit in the pool without releasing"
    for p, want in zip(ps, expected):
        assert tokens(llm.generate(p, GREEDY)) == [want]
        no_leaks(llm.engine)
    assert llm.engine.scheduler.num_preemptions == 0
    # Two greedy choices fork from one prefill: each sees the window it needs, both are transformers'.
    two = llm.generate(ps[longest], dataclasses.replace(GREEDY, n=2))
    assert [c.token_ids for c in two[0].outputs] == [expected[longest]] * 2
    no_leaks(llm.engine)


def test_only_a_model_whose_every_layer_slides_releases_blocks():
    from slipstream.server.models.config import ModelConfig
    shapes = dict(architecture="MistralForCausalLM", vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=2, num_heads=1, num_kv_heads=1,
                  head_dim=8, rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=64,
                  tie_word_embeddings=True)
    assert ModelConfig(**shapes, layer_windows=[8, 4]).kv_window == 8
    assert ModelConfig(**shapes, layer_windows=[8, None]).kv_window is None  # Gemma's global layers read it all
    assert ModelConfig(**shapes).kv_window is None


@pytest.mark.timeout(120)  # the bug was a livelock: it never returned
def test_two_choices_of_a_windowed_request_in_a_pool_that_holds_one_request_both_finish(tmp_path, no_leaks):
    """A fork's waiting choice holds blocks its parent shared with it; once the parent has slid past
    the blocks before them (and the pool has reused those) it cannot find them again from block 0,
    so when it preempts itself (nothing else runs) the waiting choice must give them back, or the
    parent is readmitted into the one block left and preempts itself forever."""
    from transformers import MistralConfig, MistralForCausalLM

    from tiny_checkpoints import greedy, save_checkpoint
    from slipstream.server.engine import LLM, SamplingParams
    from slipstream.server.models.loader import load_tokenizer

    eos = load_tokenizer("builtin").eos_token_id
    config = MistralConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=5,
                           max_position_embeddings=256, initializer_range=0.2, tie_word_embeddings=False,
                           bos_token_id=1, eos_token_id=eos, pad_token_id=eos)
    path = save_checkpoint(MistralForCausalLM, config, tmp_path / "w5")
    prompt = torch.randint(200, 49000, (100,), generator=torch.Generator().manual_seed(6100)).tolist()
    [want] = greedy(MistralForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager").eval(),
                    [prompt], eos, 60)
    probe = LLM(model=str(path), max_num_batched_tokens=5)
    assert probe.engine.kv.max_blocks_held(len(prompt) + 60, 5) == 2
    llm = LLM(model=str(path), max_num_batched_tokens=5,
              kv_cache_memory_bytes=2 * 16 * probe.engine.model_config.kv_bytes_per_token(4))
    assert llm.engine.kv.num_blocks == 2, "one choice at a time, no block spare"
    two = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=60, n=2))
    assert [c.token_ids for c in two[0].outputs] == [want] * 2
    assert llm.engine.scheduler.num_preemptions > 0
    no_leaks(llm.engine)
