"""``slipstream bench serve`` against the real server on loopback."""
from __future__ import annotations

import json

import pytest

from slipstream.server.bench import main

from .harness import serve_app

ARGS = ["--num-requests", "5", "--max-output", "8", "--prompt-len", "8-32", "--request-rate", "20"]


def test_bench_serve_streams_every_token_and_reports_latencies(server, tmp_path, capsys):
    out = tmp_path / "serve.json"
    assert main(["serve", "--base-url", server.url + "/", *ARGS, "--output-json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["completed"] == r["requests"] == r["num_requests"] == 5
    assert r["output_tokens"] == r["expected_output_tokens"] > 0
    assert 0 < r["ttft_p50_s"] <= r["ttft_p99_s"] and 0 < r["itl_p50_s"] <= r["itl_p99_s"]
    assert r["output_tokens_per_s"] == pytest.approx(r["output_tokens"] / r["elapsed_s"])
    assert (r["prompt_len"], r["max_output"], r["request_rate"]) == ([8, 32], 8, 20.0)
    assert r["errors"] == []
    assert "TTFT p50" in capsys.readouterr().out


def test_bench_serve_sends_the_api_key_and_fails_without_the_right_one(loop_thread, engine, capsys):
    with serve_app(loop_thread, engine, api_key="sekret") as served:
        assert main(["serve", "--base-url", served.url, "--api-key", "sekret", *ARGS]) == 0
        assert main(["serve", "--base-url", served.url, "--api-key", "wrong", *ARGS]) == 1
    assert "HTTP 401" in capsys.readouterr().out
