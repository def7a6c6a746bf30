"""An exception inside an engine step fails the requests of that step with a 500 error body and the
server keeps serving the rest: no hang, no leaked block. The fault is injected into the model runner."""
from __future__ import annotations

import json

import pytest

from .harness import Http, assert_engine_idle, assert_error
from .test_api_metrics import delta, scrape

ERRORS = ("slipstream:request_success_total", {"finished_reason": "error"})

POISON = [4093, 4093, 4093, 4093]  # a prompt the injected fault recognizes


@pytest.fixture
def faulty_runner(server, monkeypatch):
    """The model runner raises for any batch holding a poisoned request that has ``after`` output tokens."""
    runner = server.llm.engine.runner
    real_run = runner.run
    trigger = {"after": 0}

    def run(batch, sample_rows):
        for req in batch.requests:
            if req.prompt_token_ids[:len(POISON)] == POISON and req.num_output_tokens >= trigger["after"]:
                raise RuntimeError("injected fault")
        return real_run(batch, sample_rows)

    monkeypatch.setattr(runner, "run", run)
    return trigger


@pytest.fixture(scope="module")
def http(server):
    with Http(server.url) as client:
        yield client


def still_serves(http, server):
    r = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert_engine_idle(server.llm)


def test_failed_step_is_a_500_for_a_non_streaming_request(faulty_runner, http, server):
    before = scrape(server)
    r = http.post("/v1/completions", json={"prompt": POISON, "max_tokens": 4, "n": 2})
    error = assert_error(r, 500, code="engine_error")
    assert "injected fault" in error["message"] and error["type"] == "server_error"
    after = scrape(server)
    assert delta(before, after, ERRORS[0], **ERRORS[1]) == 2  # each choice, as vLLM v1 counts errors
    assert delta(before, after, "slipstream:request_success_total", finished_reason="abort") == 0
    assert delta(before, after, "slipstream:prompt_tokens_total") == len(POISON)
    still_serves(http, server)


def test_failed_first_step_of_a_stream_is_a_500_before_the_stream(faulty_runner, http, server):
    ok = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": True})
    assert ok.status_code == 200 and "[DONE]" in ok.text  # not poisoned: the fault is specific
    r = http.post("/v1/completions", json={"prompt": POISON, "max_tokens": 4, "stream": True}, stream=True)
    assert_error(r, 500, code="engine_error")
    still_serves(http, server)


def test_step_failing_mid_stream_ends_the_stream_with_an_error_event(faulty_runner, http, server):
    faulty_runner["after"] = 3
    before = scrape(server)
    r = http.post("/v1/completions", json={"prompt": POISON, "max_tokens": 20, "ignore_eos": True, "stream": True},
                  stream=True)
    assert r.status_code == 200
    events = [line[6:] for line in r.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "engine_error" and "injected fault" in error["message"]
    texts = [json.loads(e)["choices"][0]["text"] for e in events[:-2]]
    assert len(texts) >= 2 and all(t is not None for t in texts)
    assert delta(before, scrape(server), ERRORS[0], **ERRORS[1]) == 1
    still_serves(http, server)
