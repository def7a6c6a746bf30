"""Tensor and pipeline parallelism on CPU (gloo between worker processes the engine starts
itself): greedy tokens equal transformers' on the same random weights, batched, chunked,
preempted and after a prefix-cache hit, for Llama, Qwen3, Gemma 2 and Mixtral at tensor 2 and at
tensor 2 × pipeline 2, and the built-in GGUF (9 query heads, 3 KV heads, Q4_1 blocks, 30 layers)
at tensor 3 and at pipeline 4; logprobs within 1e-4 of one process; a rank that dies fails the
engine and the server clearly. The slicing itself is checked against the full tensors."""
from __future__ import annotations

import math
import os
import signal

import pytest
import torch
import transformers

from slipstream.kernels import ggml_cpu
from slipstream.server.distributed.executor import RankFailed
from slipstream.server.engine import LLM, SamplingParams
from slipstream.server.models import tensor_parallel as tp
from slipstream.server.models.loader import load_tokenizer
from slipstream.server.models.pipeline_parallel import stage_layers
from slipstream.server.models.quant import GGMLTensor
from test_architectures import ARCHS, COMMON, MAX_TOKENS, PROMPTS, _generate, _randomize

TP_ARCHS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(attention_bias=False)),
    "qwen3": ARCHS["qwen3"],
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM,
               dict(query_pre_attn_scalar=32, attn_logit_softcapping=5.0, final_logit_softcapping=10.0,
                    sliding_window=24, hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)),
    "mixtral": ARCHS["mixtral"],
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=3, prompt_logprobs=2)
CACHED = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=3)  # prompt logprobs skip the prefix cache


# --- which slice a rank keeps --------------------------------------------------------------

@pytest.mark.parametrize("heads, kv, size, want", [
    (9, 3, 3, [(0, 3, 0, 1), (3, 3, 1, 1), (6, 3, 2, 1)]),  # the built-in model: KV heads split
    (4, 2, 2, [(0, 2, 0, 1), (2, 2, 1, 1)]),
    (8, 2, 4, [(0, 2, 0, 1), (2, 2, 0, 1), (4, 2, 1, 1), (6, 2, 1, 1)]),  # fewer KV heads: replicated
])
def test_each_rank_keeps_its_query_heads_and_the_kv_heads_they_read(heads, kv, size, want):
    splits = [tp.head_split(heads, kv, r, size) for r in range(size)]
    assert [(s.q_start, s.num_heads, s.kv_start, s.num_kv_heads) for s in splits] == want
    group = heads // kv
    for s in splits:  # every query head of a rank reads a KV head the rank holds
        assert all(s.kv_start <= h // group < s.kv_start + s.num_kv_heads for h in range(s.q_start, s.q_start + s.num_heads))


@pytest.mark.parametrize("heads, kv, size", [(9, 3, 2), (4, 2, 3), (12, 8, 3)])
def test_a_split_the_heads_do_not_allow_is_refused_with_the_reason(heads, kv, size):
    with pytest.raises(ValueError, match="tensor parallel size"):
        tp.head_split(heads, kv, 0, size)


def test_stages_split_the_layers_as_evenly_as_they_can():
    assert [stage_layers(30, 4, s) for s in range(4)] == [(0, 8), (8, 16), (16, 23), (23, 30)]
    assert [stage_layers(3, 2, s) for s in range(2)] == [(0, 2), (2, 3)]
    with pytest.raises(ValueError, match="pipeline parallel size 4 exceeds the model's 3 layers"):
        stage_layers(3, 4, 0)


def _blocks(rows: int, cols: int, qtype: str) -> GGMLTensor:
    g = torch.Generator().manual_seed(rows * cols)
    raw = torch.randint(0, 256, (rows, ggml_cpu.row_bytes(qtype, cols)), dtype=torch.uint8, generator=g)
    return GGMLTensor(raw, qtype, (rows, cols))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, random bytes' NaN scales included."""
    return a.shape == b.shape and torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "Q4_K"])
def test_blocks_are_sliced_by_rows_and_on_block_boundaries_by_columns(qtype):
    w = _blocks(6, 512, qtype)
    dense = w.dequantize()
    picked = tp.rows(w, [(1, 3), (4, 6)])
    assert isinstance(picked, GGMLTensor) and _same(picked.dequantize(), dense[[1, 2, 4, 5]])
    cut = tp.columns(w, 256, 512, "w")
    assert isinstance(cut, GGMLTensor) and _same(cut.dequantize(), dense[:, 256:])
    padded = tp.pad_rows(w, 8)
    assert _same(padded.dequantize(), torch.cat([dense, torch.zeros(2, 512)]))


def test_a_column_split_inside_a_block_dequantizes_that_tensor_loudly(caplog):
    w = _blocks(2, 512, "Q4_K")
    cut = tp.columns(w, 128, 384, "layers.0.mlp.down_proj")
    assert isinstance(cut, torch.Tensor) and _same(cut, w.dequantize()[:, 128:384])
    assert "layers.0.mlp.down_proj" in caplog.text and "dequantized" in caplog.text


# --- the oracle, across ranks -----------------------------------------------------------------

def _save(path, arch: str, tokenizer):
    config_cls, model_cls, extra = TP_ARCHS[arch]
    cfg = config_cls(**{**COMMON, **extra}, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    model = model_cls(cfg).eval()
    _randomize(model, seed=sum(map(ord, arch)))
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return model


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def _logprobs(outputs) -> list[float]:
    flat = []
    for o in outputs:
        for lp in [*(o.prompt_logprobs or [])[1:], *o.outputs[0].logprobs]:
            flat += [lp.logprob, *(v for _, v in lp.top)]
    return flat


def _run_all_modes(llm: LLM) -> tuple[list, list]:
    """Every prompt at once (chunked and preempted by the engine's settings), then the two that
    share a prefix one after the other; returns the batch's outputs and the second one's."""
    batch = llm.generate(PROMPTS, GREEDY)
    llm.generate(PROMPTS[4], CACHED)
    return batch, llm.generate(PROMPTS[5], CACHED)


@pytest.mark.parametrize("tensor, pipeline", [(2, 1), (2, 2)], ids=["tp2", "tp2xpp2"])
@pytest.mark.parametrize("arch", list(TP_ARCHS))
def test_ranks_equal_transformers_batched_chunked_preempted_and_prefix_cached(arch, tensor, pipeline, tmp_path,
                                                                              no_leaks):
    tokenizer = load_tokenizer("builtin")
    hf = _save(tmp_path, arch, tokenizer)
    expected = _generate(hf, PROMPTS, tokenizer.eos_token_id)
    assert len({tuple(out) for out in expected}) == len(expected), "prompts should give different outputs"
    blocks = math.ceil((max(map(len, PROMPTS)) + MAX_TOKENS) / 16) + 2
    per_head_and_layer = 2 * COMMON["head_dim"] * 4  # K and V, fp32, per token
    settings = dict(max_num_batched_tokens=16, trace=True)
    one = LLM(model=str(tmp_path), kv_cache_memory_bytes=blocks * 16 * per_head_and_layer * 3 * 2, **settings)
    # Rank 0 holds one of the 2 KV heads, of all 3 layers or (first of two stages) of 2 of them.
    layers = 3 if pipeline == 1 else 2
    two = LLM(model=str(tmp_path), tensor_parallel_size=tensor, pipeline_parallel_size=pipeline,
              kv_cache_memory_bytes=blocks * 16 * per_head_and_layer * layers, **settings)
    try:
        assert two.engine.kv.num_blocks == one.engine.kv.num_blocks == blocks
        batch, cached = _run_all_modes(two)
        assert _tokens(batch) == expected and _tokens(cached) == [expected[5]]
        assert two.engine.scheduler.num_preemptions > 0, "the cache was meant to be too small for all at once"
        assert any(r.num_prefill_tokens and r.num_decode_tokens for r in two.engine.trace)
        assert cached[0].num_cached_tokens == 48, "the shared 50-token prefix holds three full blocks"
        no_leaks(two.engine)
        ref_batch, ref_cached = _run_all_modes(one)
        assert _tokens(ref_batch) == expected
        assert _logprobs(batch + cached) == pytest.approx(_logprobs(ref_batch + ref_cached), abs=1e-4)
    finally:
        two.engine.close()


@pytest.mark.parametrize("tensor, pipeline", [(3, 1), (1, 4)], ids=["tp3", "pp4"])
def test_the_builtin_gguf_over_ranks_equals_one_process(tensor, pipeline, no_leaks):
    """Three tensor ranks: 9 query and 3 KV heads, one KV head per rank; Q4_1 blocks sliced as
    stored (o_proj's 192 columns per rank are six blocks). Four stages: 30 layers as 8, 8, 7, 7."""
    prompts = [[1, 504, 3458, 282, 4649, 314], list(range(200, 290)), [1, 9690, 28, 2]]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    one = LLM(kv_cache_memory_bytes=16 << 20, max_num_batched_tokens=32)
    share = tensor * 30 // {1: 30, 4: 8}[pipeline]  # rank 0's share of the pool: its heads and layers
    many = LLM(tensor_parallel_size=tensor, pipeline_parallel_size=pipeline, kv_cache_memory_bytes=(16 << 20) // share,
               max_num_batched_tokens=32, trace=True)
    try:
        model = many.engine.runner.model
        assert model.cfg.num_layers == 30 // pipeline + (pipeline == 4)
        if tensor == 3:
            attn = model.layers[0].self_attn
            assert (attn.num_heads, attn.num_kv_heads) == (3, 1)
            assert type(attn.o_proj.inner).__name__ == "QuantLinear", "blocks should stay blocks"
        got, want = many.generate(prompts, params), one.generate(prompts, params)
        assert _tokens(got) == _tokens(want)
        assert _logprobs(got) == pytest.approx(_logprobs(want), abs=1e-4)
        assert many.engine.kv.num_blocks >= one.engine.kv.num_blocks
        assert any(r.num_prefill_tokens and r.num_decode_tokens for r in many.engine.trace)
        no_leaks(many.engine)
    finally:
        many.engine.close()
    assert not many.engine.runner.workers, "closing the engine stops its workers"


def test_a_rank_that_dies_fails_the_engine_with_its_name():
    llm = LLM(tensor_parallel_size=3, kv_cache_memory_bytes=8 << 20)
    try:
        worker = llm.engine.runner.workers[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(timeout=10)
        with pytest.raises(RankFailed, match=r"rank 1 \(pid \d+\) exited with code -9"):
            llm.generate([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=4))
    finally:
        llm.engine.close()


@pytest.mark.parametrize("tensor, pipeline", [(3, 1), (1, 2)], ids=["tp3", "pp2"])
def test_a_rank_killed_mid_request_fails_the_step_with_its_name_never_a_retry(tensor, pipeline):
    """The kill lands while steps run (the collective fails with "connection closed" or "reset by
    peer", or the rank is already reaped): always RankFailed naming the rank, never an ordinary
    step error the engine would go on after."""
    from slipstream.server.engine.engine import LLMEngine
    from slipstream.server.engine.config import EngineConfig

    engine = LLMEngine(EngineConfig(tensor_parallel_size=tensor, pipeline_parallel_size=pipeline,
                                    kv_cache_memory_bytes=8 << 20))
    try:
        engine.add_request([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True), "r")
        for _ in range(3):
            engine.step()
        worker = engine.runner.workers[-1]
        os.kill(worker.pid, signal.SIGKILL)
        with pytest.raises(RankFailed, match=rf"rank {tensor * pipeline - 1} \(pid {worker.pid}\) exited with code -9"):
            for _ in range(100):
                engine.step()
    finally:
        engine.close()


async def test_a_rank_that_dies_while_idle_fails_the_server_without_a_request():
    from slipstream.server.engine.async_llm import AsyncLLM
    from slipstream.server.engine.config import EngineConfig
    import asyncio

    llm = AsyncLLM(EngineConfig(tensor_parallel_size=3, kv_cache_memory_bytes=8 << 20))
    await llm.start()
    try:
        os.kill(llm.engine.runner.workers[0].pid, signal.SIGKILL)
        await asyncio.wait_for(llm.failed.wait(), timeout=10)
        assert "rank 1" in str(llm.failure) and "exited with code -9" in str(llm.failure)
    finally:
        await llm.shutdown()


def test_a_model_that_cannot_be_split_is_refused_before_a_rank_starts():
    import multiprocessing

    from slipstream.server.models.loader import ModelLoadError

    with pytest.raises(ModelLoadError, match="tensor parallel size 2 must divide the model's 9 attention heads"):
        LLM(tensor_parallel_size=2)
    with pytest.raises(ModelLoadError, match="pipeline parallel size 40 exceeds the model's 30 layers"):
        LLM(pipeline_parallel_size=40)
    assert not multiprocessing.active_children(), "no worker was started for a split that cannot be"


def _get(url: str, body: dict | None = None) -> tuple[int, dict]:
    import json
    import urllib.error
    import urllib.request

    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _wait_ready(base: str, server, log_path) -> None:
    import time

    for _ in range(240):
        try:
            if _get(base + "/ready")[0] == 200:
                return
        except OSError:
            pass
        assert server.poll() is None, open(log_path).read()
        time.sleep(0.5)
    raise AssertionError(f"not ready: {open(log_path).read()[-3000:]}")


def _workers(pid: int) -> list[int]:
    """The rank processes a serve process started (not multiprocessing's resource tracker)."""
    import subprocess

    children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in children if "resource_tracker" not in open(f"/proc/{p}/cmdline").read()]


def _none_left(session: int) -> bool:
    """Whether every process of the session ``session`` has gone (waits up to 10 s: the resource
    tracker leaves once its last user has)."""
    import subprocess
    import time

    for _ in range(50):
        if not subprocess.run(["pgrep", "-s", str(session)], capture_output=True, text=True).stdout.split():
            return True
        time.sleep(0.2)
    return False


CHAT = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4}


def test_serve_starts_its_ranks_answers_and_ctrl_c_stops_them_all_cleanly(tmp_path):
    """``slipstream serve --tensor-parallel-size 3``: no torchrun, one command; Ctrl-C in a
    terminal (SIGINT to the whole process group) drains and exits 0: the workers ignore it and
    are stopped by rank 0, with no traceback and no process left."""
    from slipstream.server.distributed.group import free_port

    port = free_port()
    log = open(tmp_path / "serve.log", "w+")
    server = _serve(["--tensor-parallel-size", "3", "--port", str(port), "--kv-cache-memory-bytes", "16MiB"], log)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(base, server, tmp_path / "serve.log")
        status, body = _get(base + "/v1/chat/completions", CHAT)
        assert status == 200 and body["usage"]["completion_tokens"] == 4
        assert len(_workers(server.pid)) == 2, "ranks 1 and 2 run as the server's child processes"
        os.killpg(server.pid, signal.SIGINT)
        assert server.wait(timeout=60) == 0, open(tmp_path / "serve.log").read()[-3000:]
        assert _none_left(server.pid), "no rank outlives the server"
        text = open(tmp_path / "serve.log").read()
        assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)


def test_serve_exits_1_when_a_rank_dies_while_idle_and_its_ranks_when_it_is_killed(tmp_path):
    """A worker killed between requests fails the server at once (exit 1, the rank named in its
    log, no request needed); and when rank 0 itself is killed (SIGKILL: no clean-up of its own) while
    the workers still load, they leave by themselves within seconds."""
    import time

    from slipstream.server.distributed.group import free_port

    port = free_port()
    log = open(tmp_path / "serve.log", "w+")
    server = _serve(["--tensor-parallel-size", "3", "--port", str(port), "--kv-cache-memory-bytes", "16MiB"], log)
    try:
        _wait_ready(f"http://127.0.0.1:{port}", server, tmp_path / "serve.log")
        os.kill(_workers(server.pid)[0], signal.SIGKILL)
        assert server.wait(timeout=30) == 1
        assert _none_left(server.pid), "no rank outlives the server"
        assert "exited with code -9" in open(tmp_path / "serve.log").read()
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)

    log = open(tmp_path / "serve2.log", "w+")
    server = _serve(["--tensor-parallel-size", "3", "--port", str(free_port()), "--kv-cache-memory-bytes", "16MiB"],
                    log)
    try:
        for _ in range(200):
            workers = _workers(server.pid)
            if len(workers) == 2:
                break
            time.sleep(0.05)
        assert len(workers) == 2, open(tmp_path / "serve2.log").read()
        os.kill(server.pid, signal.SIGKILL)
        server.wait(timeout=10)
        assert _none_left(server.pid), "a worker outlived rank 0"
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)


def _serve(args: list[str], log):
    import subprocess
    import sys

    return subprocess.Popen([sys.executable, "-m", "slipstream.server", "serve", "--host", "127.0.0.1", *args],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def test_two_nodes_serve_one_model_and_node_0_exits_1_when_node_1_dies(tmp_path):
    """Pipeline 2 over two `serve` processes that meet at node 0's --master-port, as two pods of a
    LeaderWorkerSet group do: node 0 answers with one process's tokens; node 1 answers /health,
    not /ready; killing node 1's rank fails node 0 (a request in the way gets a 503: retry
    elsewhere), which exits 1, and node 1 exits 1 too."""
    import subprocess
    import time

    from slipstream.server.distributed.group import free_port

    ports = [free_port() for _ in range(3)]
    group = ["--pipeline-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1",
             "--master-port", str(ports[2]), "--kv-cache-memory-bytes", "16MiB"]
    logs = [open(tmp_path / f"node{i}.log", "w+") for i in range(2)]
    nodes = [_serve([*group, "--port", str(ports[0])], logs[0]),
             _serve([*group, "--node-rank", "1", "--port", str(ports[1])], logs[1])]
    leader, follower = (f"http://127.0.0.1:{p}" for p in ports[:2])
    prompt = [1, 504, 3458, 282, 4649, 314]
    try:
        for _ in range(240):
            try:
                if _get(leader + "/ready")[0] == 200:
                    break
            except OSError:
                pass
            assert all(n.poll() is None for n in nodes), [open(tmp_path / f"node{i}.log").read() for i in range(2)]
            time.sleep(0.5)
        status, body = _get(leader + "/v1/completions", {"model": "SmolLM2-135M-Instruct", "prompt": prompt,
                                                         "max_tokens": 12, "temperature": 0, "ignore_eos": True})
        assert status == 200, body
        want = LLM(kv_cache_memory_bytes=16 << 20).generate(prompt, SamplingParams(temperature=0, max_tokens=12,
                                                                                  ignore_eos=True))
        assert body["choices"][0]["text"] == want[0].outputs[0].text
        assert _get(follower + "/health")[0] == 200 and _get(follower + "/ready")[0] == 503
        rank = [int(p) for p in subprocess.run(["pgrep", "-P", str(nodes[1].pid)], capture_output=True,
                                               text=True).stdout.split()
                if "resource_tracker" not in open(f"/proc/{p}/cmdline").read()]
        os.kill(rank[0], signal.SIGKILL)
        try:
            status, body = _get(leader + "/v1/completions", {"model": "SmolLM2-135M-Instruct", "prompt": prompt,
                                                             "max_tokens": 4})
            assert status == 503, body  # the step failed (engine_failed), or node 0 is already stopping
        except OSError:
            pass  # node 0's idle ping noticed first and it has exited: no request reaches a broken group
        assert nodes[0].wait(timeout=60) == 1 and nodes[1].wait(timeout=60) == 1
    finally:
        for n in nodes:
            if n.poll() is None:
                os.killpg(n.pid, signal.SIGKILL)


def test_a_stopped_rank_makes_ready_say_stalled_until_it_resumes(tmp_path):
    """A rank that stops without dying (SIGSTOP; a hung driver) blocks the step in a transfer
    for gloo's whole timeout. Past ``--step-timeout`` the server's /ready answers 503 ``stalled``,
    so load balancers move traffic away while the server stays up; when the rank resumes, the
    request completes and /ready is 200 again."""
    import concurrent.futures
    import time

    from slipstream.server.distributed.group import free_port

    port = free_port()
    log = open(tmp_path / "serve.log", "w+")
    server = _serve(["--pipeline-parallel-size", "2", "--port", str(port), "--kv-cache-memory-bytes", "16MiB",
                     "--step-timeout", "1"], log)
    base = f"http://127.0.0.1:{port}"
    worker = None
    try:
        _wait_ready(base, server, tmp_path / "serve.log")
        [worker] = _workers(server.pid)
        os.kill(worker, signal.SIGSTOP)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(_get, base + "/v1/chat/completions", CHAT)
            deadline = time.monotonic() + 30
            while (ready := _get(base + "/ready"))[0] == 200:
                assert time.monotonic() < deadline, "/ready stayed 200 with a rank stopped"
                time.sleep(0.2)
            # past 1 s, rounded to 0.1 s: 1.04 s reads 1.0
            assert ready[0] == 503 and ready[1]["status"] == "stalled" and ready[1]["step_seconds"] >= 1
            assert not answer.done() and server.poll() is None
            os.kill(worker, signal.SIGCONT)
            worker = None
            status, body = answer.result(timeout=60)
        assert status == 200 and body["usage"]["completion_tokens"] == 4
        assert _get(base + "/ready")[0] == 200
        assert "/ready answers 503" in open(tmp_path / "serve.log").read()
    finally:
        if worker is not None:
            os.kill(worker, signal.SIGCONT)
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
