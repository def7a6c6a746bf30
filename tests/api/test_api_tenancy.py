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
    finally:
        engine.make_requests = make
    assert seen == [("team-a", -3), ("default", 0)]
