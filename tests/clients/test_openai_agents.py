"""OpenAI's Agents SDK (``openai-agents``) running a tool-calling agent loop against a real
``slipstream serve``: the model calls a function tool with schema-valid arguments, the tool's result
goes back as a tool message, and the loop ends with a final answer within 3 turns."""
from __future__ import annotations

import asyncio
from typing import Literal

import pytest

agents = pytest.importorskip("agents", reason="openai-agents is not installed (pip install -e '.[test]')")
openai = pytest.importorskip("openai", reason="the openai client is not installed")


def _agent(server, api: str, calls: list[dict]):
    @agents.function_tool
    def get_weather(city: str, unit: Literal["celsius", "fahrenheit"]) -> str:
        """Current weather of a city.

        Args:
            city: the city's name.
            unit: the temperature unit.
        """
        calls.append({"city": city, "unit": unit})
        return f"Sunny, 21 degrees {unit} in {city}."

    client = openai.AsyncOpenAI(base_url=server.base_url, api_key=server.api_key, max_retries=0, timeout=120)
    model_class = agents.OpenAIChatCompletionsModel if api == "chat" else agents.OpenAIResponsesModel
    return agents.Agent(
        name="weather", instructions="Answer weather questions with the get_weather tool.", tools=[get_weather],
        model=model_class(model=server.model, openai_client=client),
        # the 135M model is weak: force the call in the first turn; reset_tool_choice (the SDK's default)
        # frees the next turn to answer in text. The protocol must hold, not the model's wisdom.
        model_settings=agents.ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0,
                                            max_tokens=64),
        reset_tool_choice=True)


@pytest.mark.slow
@pytest.mark.parametrize("api", ["chat", "responses"])
def test_agent_loop_calls_the_tool_and_answers_within_three_turns(server, api):
    agents.set_tracing_disabled(True)
    calls: list[dict] = []
    result = asyncio.run(agents.Runner.run(_agent(server, api, calls), "What is the weather in Oslo?", max_turns=3))
    assert calls and all(c["unit"] in ("celsius", "fahrenheit") and c["city"] for c in calls)
    kinds = [item.type for item in result.new_items]
    assert kinds[0] == "tool_call_item" and "tool_call_output_item" in kinds
    assert kinds[-1] == "message_output_item" and isinstance(result.final_output, str) and result.final_output
