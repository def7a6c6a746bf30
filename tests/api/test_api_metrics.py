"""``GET /metrics``: counters equal the tokens served, gauges move while requests run."""
from __future__ import annotations

import threading

import pytest
from prometheus_client.parser import text_string_to_metric_families

from .harness import Http, assert_engine_idle, serve_app, wait_until


@pytest.fixture(scope="module")
def server(loop_thread, engine):
    with serve_app(loop_thread, engine, vllm_compatible_metrics=True) as served:
        yield served


def scrape(server) -> dict[tuple[str, tuple], float]:
    r = Http(server.url).get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            assert s.labels.get("model_name") == server.state.model_name, s
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            samples[(s.name, labels)] = s.value
    return samples


def delta(before: dict, after: dict, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_all_design_metrics_are_exported(server):
    names = {name for name, _ in scrape(server)}
    for gauge in ("num_requests_waiting", "num_requests_running", "kv_cache_usage_perc"):
        assert f"slipstream:{gauge}" in names and f"vllm:{gauge}" in names
    for counter in ("prompt_tokens", "generation_tokens", "num_preemptions", "prefix_cache_queries",
                    "prefix_cache_hits"):
        assert f"slipstream:{counter}_total" in names
    for histogram in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                      "request_queue_time_seconds", "iteration_tokens"):
        assert f"slipstream:{histogram}_count" in names


def test_the_cpu_kernel_path_in_use_is_exported(server):
    from slipstream.kernels import cpu_native

    isa = cpu_native.loaded_isa()
    assert isa is not None, "a CPU engine resolved its kernels"
    kernels = {labels for name, labels in scrape(server) if name == "slipstream:cpu_kernel_info"}
    assert kernels == {(("isa", isa),)}


def test_vllm_names_only_when_asked(loop_thread, engine):
    with serve_app(loop_thread, engine) as plain:
        text = Http(plain.url).get("/metrics").text
    assert "slipstream:num_requests_waiting" in text and "vllm:" not in text


def test_counters_equal_the_tokens_served(server):
    tokenizer = server.llm.tokenizer
    prompts = [tokenizer.encode(p) for p in ("The quick brown fox", "In 1492,", "def main():")]
    lengths = [3, 5, 7]
    before = scrape(server)
    usage = []
    for ids, n in zip(prompts, lengths):
        r = Http(server.url).post("/v1/completions", json={"prompt": ids, "max_tokens": n, "ignore_eos": True})
        usage.append(r.json()["usage"])
    r = Http(server.url).post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "ignore_eos": True, "n": 2, "stream": True,
        "stream_options": {"include_usage": True}})
    chat_usage = [line for line in r.text.splitlines() if '"usage": {' in line][-1]
    chat_prompt = int(chat_usage.split('"prompt_tokens": ')[1].split(",")[0])
    after = scrape(server)
    assert [u["prompt_tokens"] for u in usage] == [len(p) for p in prompts]
    assert delta(before, after, "slipstream:prompt_tokens_total") == sum(map(len, prompts)) + chat_prompt
    assert delta(before, after, "slipstream:generation_tokens_total") == sum(lengths) + 2 * 4
    assert delta(before, after, "slipstream:request_success_total", finished_reason="length") == 3 + 2
    assert delta(before, after, "slipstream:time_to_first_token_seconds_count") == 4
    assert delta(before, after, "slipstream:e2e_request_latency_seconds_count") == 4
    assert delta(before, after, "slipstream:request_queue_time_seconds_count") == 4
    # one inter-token gap per token after the first, per choice
    assert delta(before, after, "slipstream:inter_token_latency_seconds_count") == sum(n - 1 for n in lengths) + 2 * 3
    assert delta(before, after, "slipstream:iteration_tokens_count") >= max(lengths)
    assert delta(before, after, "slipstream:iteration_tokens_sum") >= sum(lengths)


def test_gauges_move_while_a_request_runs(server):
    body = {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True, "stream": True}
    seen: dict = {}
    first_chunk = threading.Event()

    def client():
        with Http(server.url).post("/v1/completions", json=body, stream=True) as r:
            for line in r.iter_lines(decode_unicode=True):
                if line.startswith("data: {"):
                    first_chunk.set()
                    if "during" in seen:
                        break  # leave: the abort must bring the gauges back down

    thread = threading.Thread(target=client)
    thread.start()
    assert first_chunk.wait(60)
    seen["during"] = scrape(server)
    thread.join(60)
    assert_engine_idle(server.llm)
    after = scrape(server)
    running = ("slipstream:num_requests_running", ())
    usage = ("slipstream:kv_cache_usage_perc", ())
    assert seen["during"][running] == 1 and seen["during"][("vllm:num_requests_running", ())] == 1
    assert 0 < seen["during"][usage] <= 1
    assert after[running] == 0 and after[usage] == 0
    assert wait_until(lambda: scrape(server)[("slipstream:num_requests_waiting", ())] == 0, 1)


def test_probes(server):
    assert Http(server.url).get("/health").json() == {"status": "ok"}
    ready = Http(server.url).get("/ready")
    assert ready.status_code == 200 and ready.json()["status"] == "ready"
