"""guidellm's own request path (``OpenAIHTTPBackend``, as ``guidellm benchmark`` drives it) against a real
``slipstream serve``: streamed completions and chat completions with
``stream_options: {include_usage, continuous_usage_stats}``, its response objects carrying the text and
the token counts."""
from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("guidellm", reason="guidellm is not installed (pip install -e '.[bench]')")
from guidellm.backends import OpenAIHTTPBackend  # noqa: E402
from guidellm.schemas import GenerationRequest, RequestInfo, UsageMetrics  # noqa: E402
from guidellm.schemas.backends import OpenAIHTTPBackendArgs  # noqa: E402


async def _run(server, request_format: str, prompts: list[str], output_tokens: int):
    backend = OpenAIHTTPBackend(OpenAIHTTPBackendArgs(
        target=server.url, model=server.model, api_key=server.api_key, request_format=request_format,
        http2=False, timeout=120))
    await backend.process_startup()
    try:
        await backend.validate()  # GET /health, as guidellm does before a benchmark
        results = []
        for prompt in prompts:
            # output_metrics.text_tokens makes guidellm ask for exactly that many (max_tokens, ignore_eos)
            request = GenerationRequest(columns={"text_column": [prompt]},
                                        output_metrics=UsageMetrics(text_tokens=output_tokens))
            updates = [item async for item in backend.resolve(request, RequestInfo())]
            results.append(updates)
        return results
    finally:
        await backend.process_shutdown()


@pytest.mark.parametrize("request_format", ["/v1/completions", "/v1/chat/completions"])
def test_guidellm_streamed_requests_carry_text_and_token_counts(server, request_format):
    results = asyncio.run(_run(server, request_format, ["The quick brown fox", "Once upon a time"], 16))
    for updates in results:
        response, info = updates[-1]
        assert response.text, "no text compiled from the stream"
        assert response.output_metrics.text_tokens == 16
        assert response.input_metrics.text_tokens > 0
        # an SSE chunk per token that adds text (a token whose text is held back, e.g. half a
        # character, adds none): guidellm times inter-token latency over these
        assert 8 <= info.timings.token_iterations <= 16
        assert info.timings.first_token_iteration <= info.timings.last_token_iteration
        assert updates[0][0] is None  # the first-token signal guidellm times TTFT with
