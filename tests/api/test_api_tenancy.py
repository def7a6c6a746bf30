"""The tenant (llm-d's fairness-id header) and vLLM's ``priority`` field reach the engine's
scheduling policy; ``priority`` is type-checked like every field."""
from __future__ import annotations

import pytest

from slipstream.api_types.tenancy import FAIRNESS_ID_HEADER

from .harness import Http

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def http(server):
    with Http(server.url) as client:
        yield client


def test_the_api_passes_the_tenant_header_and_the_priority_field_to_the_engine(http, engine):
    seen = []
    engine = engine.engine
    make = engine.make_requests

    def spy(*args, **kwargs):
        seen.append((kwargs.get("tenant"), kwargs.get("priority")))
        return make(*args, **kwargs)

    engine.make_requests = spy
    try:
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "priority": -3}
        r = http.post("/v1/completions", json=body, headers={FAIRNESS_ID_HEADER: "team-a"})
        assert r.status_code == 200, r.text
        r = http.post("/v1/completions", json={**body, "priority": None})
        assert r.status_code == 400 and "priority" in r.text
        r = http.post("/v1/completions", json={k: v for k, v in body.items() if k != "priority"})
        assert r.status_code == 200
        r = http.post("/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 2, "priority": 5},
                      headers={FAIRNESS_ID_HEADER: "team-b"})
        assert r.status_code == 200, r.text
        r = http.post("/v1/responses", json={"model": MODEL, "input": "Hi", "priority": "high"})
        assert r.status_code == 400 and "priority" in r.text
    finally:
        engine.make_requests = make
    assert seen == [("team-a", -3), ("default", 0), ("team-b", 5)]


def test_the_metrics_count_each_tenants_service_waiting_running_and_refusals(http):
    from slipstream.api_types import metrics as names
    from slipstream.api_types.metrics import parse_exposition

    body = {"model": MODEL, "prompt": "Hi there", "max_tokens": 3}
    assert http.post("/v1/completions", json=body, headers={FAIRNESS_ID_HEADER: "team-metrics"}).status_code == 200
    samples = parse_exposition(http.get("/metrics").text)
    served = {labels["tenant"]: value for labels, value in samples[names.TENANT_SERVED_TOKENS]}
    assert served["team-metrics"] > 0  # prompt tokens + 2 × output tokens (weight 1)
    assert {labels["tenant"] for labels, _ in samples[names.TENANT_REQUESTS_RUNNING]} >= {"team-metrics"}


def test_tenant_metrics_fold_past_the_top_tenants_and_count_refusals():
    from slipstream.api_types import metrics as names
    from slipstream.api_types.metrics import parse_exposition
    from slipstream.api_types.tenancy import TOP_TENANTS
    from slipstream.server.engine.trace import EngineStats
    from slipstream.server.metrics import ServerMetrics

    stats = EngineStats(num_running=3, num_waiting=2, kv_cache_usage=0.1, num_blocks=100, num_free_blocks=90,
                        num_preemptions_total=0, prefix_cache_queries_total=0, prefix_cache_hits_total=0,
                        prompt_tokens_total=0, generation_tokens_total=0, num_steps=0,
                        tenant_requests={"a": 4, "b": 1}, tenant_running={"a": 2, "b": 1},
                        tenant_served={f"t{i:02d}": float(i) for i in range(TOP_TENANTS + 3)} | {"a": 900.0})
    metrics = ServerMetrics(lambda: "m", lambda: stats)
    metrics.reject("b")
    metrics.reject("b")
    samples = parse_exposition(metrics.render().decode())

    def by_tenant(name: str) -> dict[str, float]:
        return {labels["tenant"]: value for labels, value in samples[name]}
    assert by_tenant(names.TENANT_REQUESTS_WAITING)["a"] == 2 and by_tenant(names.TENANT_REQUESTS_RUNNING)["a"] == 2
    served = by_tenant(names.TENANT_SERVED_TOKENS)
    assert len(served) == TOP_TENANTS + 1 and served["a"] == 900 and "t00" not in served
    assert by_tenant(names.TENANT_REJECTIONS)["other"] == 2  # b: never served, folded
