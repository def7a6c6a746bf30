"""AsyncLLM: increments stream while the engine steps on its own thread; leaving early aborts."""
from __future__ import annotations

import asyncio

import pytest

from slipstream.server.engine import SamplingParams
from slipstream.server.engine.async_llm import AsyncLLM, RequestRejected


@pytest.fixture
async def allm(make_llm):
    llm = make_llm(max_model_len=512, trace=True)
    a = AsyncLLM(engine=llm.engine)
    await a.start()
    yield a
    await a.shutdown()


async def test_stream_of_increments_equals_offline_output(allm, make_llm):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    pieces, ids = [], []
    async for out in allm.generate("The capital of France is", params):
        pieces.append(out.outputs[0].text)
        ids.extend(out.outputs[0].token_ids)
    assert out.finished and out.outputs[0].finish_reason == "length"
    assert len(ids) == 10 and sum(1 for p in pieces if p) > 1  # it streamed, not one lump
    offline = make_llm().generate("The capital of France is", params)[0].outputs[0]
    assert ids == offline.token_ids and "".join(pieces) == offline.text


async def test_leaving_early_aborts_and_frees_blocks(allm, no_leaks):
    stream = allm.generate("Tell me a long story.", SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    async for out in stream:
        if allm.stats().num_running:
            break
    await stream.aclose()
    for _ in range(100):
        if allm.stats().num_free_blocks == allm.stats().num_blocks and not allm.engine.groups:
            break
        await asyncio.sleep(0.05)
    no_leaks(allm.engine)


async def test_concurrent_requests_interleave(allm):
    async def run(i):
        n = 0
        async for out in allm.generate(f"Count to {i}:", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)):
            n += len(out.outputs[0].token_ids)
        return n
    assert await asyncio.gather(*(run(i) for i in range(6))) == [6] * 6
    assert max(len(rec.scheduled) for rec in allm.engine.trace) > 1, "requests should share steps"


async def test_rejected_request_raises_before_streaming(allm):
    with pytest.raises(RequestRejected) as e:
        async for _ in allm.generate([1] * 500, SamplingParams(max_tokens=100)):
            pass
    assert e.value.code == "context_length_exceeded"
    assert not allm.engine.groups


async def test_failed_step_fails_its_requests_and_the_engine_goes_on(allm):
    runner = allm.engine.runner
    real = runner.run
    calls = {"n": 0}

    def flaky(batch, rows):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected fault")
        return real(batch, rows)

    runner.run = flaky
    outs = [o async for o in allm.generate("Hello", SamplingParams(max_tokens=4))]
    assert outs[-1].finished and "injected fault" in outs[-1].error
    assert outs[-1].outputs[0].finish_reason == "abort"
    ok = [o async for o in allm.generate("Hello", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))]
    assert ok[-1].outputs[0].finish_reason == "length" and ok[-1].error is None
    runner.run = real


async def test_num_threads_applies_on_the_engine_thread(make_llm):
    import torch
    before = torch.get_num_threads()
    try:
        engine = make_llm(num_threads=1).engine
        torch.set_num_threads(before + 1)  # the engine thread must not inherit this
        seen = []
        engine.step_listeners.append(lambda rec: seen.append(torch.get_num_threads()))
        a = AsyncLLM(engine=engine)
        await a.start()
        async for _ in a.generate("Hi", SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)):
            pass
        await a.shutdown()
        assert seen and set(seen) == {1}
    finally:
        torch.set_num_threads(before)
