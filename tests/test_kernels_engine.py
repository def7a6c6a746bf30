"""The engine's greedy output is the same with attention routed through the Triton kernels (in
Triton's interpreter, on CPU) as through the torch reference; the torch path is checked against
transformers in test_oracle.py, so equality carries that oracle over to the kernels."""
from __future__ import annotations

import os

# Set before anything imports triton, and kept: Triton reads it then and again at launch
# (see test_kernels.py). CPU tensors stay on the torch path unless SLIPSTREAM_ATTENTION says so.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from slipstream.server.engine import SamplingParams  # noqa: E402

PROMPTS = ["The three primary colours are", "1, 2, 3, 4,", "def add(a, b):\n    return"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


@pytest.mark.slow
def test_greedy_tokens_through_triton_kernels_equal_the_torch_path(make_llm, monkeypatch):
    # A 12-token step budget splits the prompts into chunks, so steps mix decode rows with
    # prefill chunks that attend to an already cached prefix.
    llm = make_llm(max_num_batched_tokens=12)
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    assert sum(map(len, prompts)) > 12

    monkeypatch.setenv("SLIPSTREAM_ATTENTION", "torch")
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    monkeypatch.setenv("SLIPSTREAM_ATTENTION", "triton")
    from slipstream.kernels import triton_attention
    calls = []
    attend = triton_attention.paged_attention
    monkeypatch.setattr(triton_attention, "paged_attention", lambda *a, **k: calls.append(1) or attend(*a, **k))
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]

    assert calls, "attention did not go through the Triton kernels"
    assert got == want
    assert all(len(t) == GREEDY.max_tokens for t in want)
