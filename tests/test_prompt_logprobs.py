"""Prompt logprobs (``SamplingParams.prompt_logprobs``): every prompt token's logprob and top-N,
computed in the prefill forward pass, equal to transformers' own forward pass on the same GGUF
weights — unchunked, chunked, past a warm prefix cache, across preemption, batched with requests
that did not ask."""
from __future__ import annotations

import os

import pytest
import torch

from slipstream.server.engine import SamplingParams
from slipstream.server.engine.async_llm import AsyncLLM
from slipstream.server.engine.errors import InvalidRequest

TOP_N = 5
KV_BYTES_PER_BLOCK = 16 * 46080  # SmolLM2-135M fp32: 30 layers × K,V × 3 heads × 64 × 4 bytes per token


@pytest.fixture(scope="module")
def prompts(loaded):
    tok = loaded.tokenizer
    story = " ".join(f"On day {i} the explorer walked north and counted {i * 3} birds." for i in range(1, 12))
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   tokenize=False, add_generation_prompt=True)
    ps = [tok.encode("The three primary colours are"),
          tok.encode(chat, add_special_tokens=False),
          tok.encode(story)]
    assert len(ps[2]) > 100
    return ps


@pytest.fixture(scope="module")
def oracle(loaded, prompts):
    """``log_softmax(hf(prompt).logits)`` from transformers' GGUF loader: ``[len(prompt), vocab]`` each."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(loaded.path), gguf_file=os.path.basename(loaded.path),
                                              dtype=torch.float32)
    hf.eval()
    with torch.inference_mode():
        return [torch.log_softmax(hf(torch.tensor([p])).logits[0].float(), dim=-1) for p in prompts]


def params(prompt_logprobs=TOP_N, **kw):
    return SamplingParams(temperature=0, max_tokens=kw.pop("max_tokens", 2), prompt_logprobs=prompt_logprobs, **kw)


def assert_matches_oracle(entries, prompt, want, top_n=TOP_N):
    """Entry i (i ≥ 1) is prompt token i given tokens 0..i-1, i.e. row i-1 of the oracle."""
    assert len(entries) == len(prompt) and entries[0] is None
    for i in range(1, len(prompt)):
        e = entries[i]
        assert e.token_id == prompt[i]
        assert e.logprob == pytest.approx(want[i - 1, prompt[i]].item(), abs=1e-4), f"token {i}"
        assert [t for t, _ in e.top] == want[i - 1].topk(top_n).indices.tolist(), f"top-{top_n} of token {i}"
        assert [v for _, v in e.top] == pytest.approx(want[i - 1].topk(top_n).values.tolist(), abs=1e-4)


def assert_same(a, b):
    assert len(a) == len(b) and a[0] is None and b[0] is None
    for x, y in zip(a[1:], b[1:]):
        assert x.token_id == y.token_id and [t for t, _ in x.top] == [t for t, _ in y.top]
        # fp32 over 30 layers in other matmul shapes (32-row chunks vs one 512-row batch): a few
        # 1e-6 relative apart, the oracle's own bound
        assert x.logprob == pytest.approx(y.logprob, abs=1e-4)


def test_every_prompt_token_matches_transformers(make_llm, prompts, oracle):
    llm = make_llm(max_num_batched_tokens=512)
    for p, want in zip(prompts, oracle):
        out = llm.generate(p, params())[0]
        assert_matches_oracle(out.prompt_logprobs, p, want)
        assert len(out.outputs[0].token_ids) == 2  # generation goes on as usual


def test_prompt_logprobs_zero_gives_only_the_prompt_tokens_own(make_llm, prompts, oracle):
    out = make_llm().generate(prompts[0], params(prompt_logprobs=0))[0]
    assert all(e.top == [] for e in out.prompt_logprobs[1:])
    assert [e.logprob for e in out.prompt_logprobs[1:]] == pytest.approx(
        [oracle[0][i - 1, t].item() for i, t in enumerate(prompts[0]) if i], abs=1e-4)


def test_chunked_prefill_loses_nothing_at_chunk_boundaries(make_llm, prompts, oracle):
    llm = make_llm(max_num_batched_tokens=32, trace=True)
    out = llm.generate(prompts[2], params())[0]
    prefill_steps = [rec for rec in llm.engine.trace if rec.num_prefill_tokens]
    assert len(prefill_steps) == -(-len(prompts[2]) // 32)  # it was chunked
    assert_matches_oracle(out.prompt_logprobs, prompts[2], oracle[2])
    whole = make_llm(max_num_batched_tokens=512).generate(prompts[2], params())[0]
    assert_same(out.prompt_logprobs, whole.prompt_logprobs)


def test_prompt_logprobs_bypass_a_warm_prefix_cache(make_llm, prompts, oracle):
    llm = make_llm(enable_prefix_caching=True)
    p = prompts[2]
    llm.generate(p, params(prompt_logprobs=None))  # warms the cache with the prompt's blocks
    without = llm.generate(p, params(prompt_logprobs=None))[0]
    assert without.num_cached_tokens == (len(p) - 1) // 16 * 16 and without.prompt_logprobs is None
    asked = llm.generate(p, params())[0]
    assert asked.num_cached_tokens == 0
    assert_matches_oracle(asked.prompt_logprobs, p, oracle[2])
    again = llm.generate(p, params(prompt_logprobs=None))[0]  # the bypassing request's blocks still serve others
    assert again.num_cached_tokens == without.num_cached_tokens


def test_preempted_mid_prefill_keeps_every_entry_once(loaded, make_llm, prompts, oracle, no_leaks):
    """8 blocks of 16: a decode holds 3, the prompt-logprobs request (chunked, 32 tokens a step)
    grows past what is left and, as the newest, is preempted in mid-prefill; re-admitted it resumes
    after the entries it has (its computed blocks come back from the prefix cache)."""
    llm = make_llm(kv_cache_memory_bytes=8 * KV_BYTES_PER_BLOCK, max_num_batched_tokens=32)
    engine = llm.engine
    p = prompts[2][:90]
    [decoder] = engine.make_requests(list(range(1000, 1040)), SamplingParams(temperature=0, max_tokens=12,
                                                                             ignore_eos=True))
    [asker] = engine.make_requests(p, params())
    engine.add([decoder])
    engine.add([asker])
    first, preempted_mid_prefill = None, False
    while engine.has_unfinished():
        before = asker.num_preemptions
        for out in engine.step():
            if out.request_id == asker.group_id and out.prompt_logprobs is not None:
                assert first is None, "prompt logprobs are delivered once"
                first = out
        if asker.num_preemptions > before and 1 < len(asker.prompt_logprobs) < len(p):
            preempted_mid_prefill = True
    assert preempted_mid_prefill
    assert first.outputs[0].token_ids  # with the first generated token
    assert_matches_oracle(first.prompt_logprobs, p, oracle[2][:len(p)])
    no_leaks(engine)


def test_batched_with_requests_that_do_not_ask(make_llm, prompts, oracle):
    plain = SamplingParams(temperature=0, max_tokens=4, logprobs=2)
    alone = make_llm().generate([prompts[0], prompts[1]], plain)
    mixed = make_llm(max_num_batched_tokens=2048, trace=True)
    outs = mixed.generate([prompts[0], prompts[2], prompts[1]], [plain, params(), plain])
    assert len(mixed.engine.trace[0].scheduled) == 3  # one forward pass for all three prompts
    assert outs[0].prompt_logprobs is None and outs[2].prompt_logprobs is None
    for got, want in zip([outs[0], outs[2]], alone):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert [lp.logprob for lp in got.outputs[0].logprobs] == pytest.approx(
            [lp.logprob for lp in want.outputs[0].logprobs], abs=1e-5)
    assert_matches_oracle(outs[1].prompt_logprobs, prompts[2], oracle[2])


def test_n_choices_carry_the_prompt_logprobs_once(make_llm, prompts, oracle):
    llm = make_llm()
    engine = llm.engine
    engine.add_request(prompts[0], SamplingParams(n=3, temperature=0.8, seed=1, max_tokens=4, prompt_logprobs=1),
                       request_id="g")
    carried = []
    while engine.has_unfinished():
        carried += [out.prompt_logprobs for out in engine.step() if out.prompt_logprobs is not None]
    assert len(carried) == 1
    assert_matches_oracle(carried[0], prompts[0], oracle[0], top_n=1)
    [out] = llm.generate(prompts[0], SamplingParams(n=3, temperature=0.8, seed=1, max_tokens=4, prompt_logprobs=1))
    assert len(out.outputs) == 3 and out.prompt_logprobs is not None  # the cumulative output keeps them


async def test_async_stream_delivers_them_in_the_first_increment(make_llm, prompts, oracle):
    allm = AsyncLLM(engine=make_llm().engine)
    await allm.start()
    try:
        outs = [out async for out in allm.generate(prompts[1], params(max_tokens=4, ignore_eos=True))]
    finally:
        await allm.shutdown()
    assert outs[0].outputs[0].token_ids and all(o.prompt_logprobs is None for o in outs[1:])
    assert_matches_oracle(outs[0].prompt_logprobs, prompts[1], oracle[1])


def test_a_runner_without_a_forward_pass_refuses_them(make_llm):
    class Fake:  # a StepRunner without a forward pass (as the simulator's)
        supports_prompt_logprobs = False

        def run(self, batch, sample_rows):
            raise AssertionError("not reached")

    engine = make_llm().engine
    engine.runner = Fake()
    with pytest.raises(InvalidRequest) as e:
        engine.make_requests("Hello", params())
    assert e.value.param == "prompt_logprobs"
