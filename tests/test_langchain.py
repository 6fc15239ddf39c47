"""LangChain's OpenAI chat model against a real server: structured output both ways it asks for
it, and a tool call fed back in a second turn."""

from __future__ import annotations

from typing import Literal

import pytest
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

pytest.register_assert_rewrite("tests.server_helpers")
from tests.server_helpers import DEFAULT_MODEL_NAME, wait_until_idle  # noqa: E402

pytest_plugins = ["tests.server_helpers"]
pytestmark = pytest.mark.usefixtures("server_logs_on_failure")


class CityWeather(BaseModel):
    """The weather in a city."""

    city: Literal["Paris", "Lyon", "Nice"]
    sky: Literal["sunny", "cloudy", "rainy"]
    degrees: int = Field(ge=-30, le=50)


@tool
def get_weather(city: Literal["Paris", "Lyon", "Nice"]) -> str:
    """The weather in a French city now."""
    return f"18 degrees and sunny in {city}"


@pytest.fixture(scope="module")
def llm(default_server):
    return ChatOpenAI(base_url=f"{default_server.url}/v1", api_key="unused", model=DEFAULT_MODEL_NAME,
                      temperature=0, max_tokens=120, max_retries=0, timeout=120)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output_returns_the_model_object(llm, method, default_server):
    structured = llm.with_structured_output(CityWeather, method=method)
    answer = structured.invoke("What is the weather in Paris today?")
    assert isinstance(answer, CityWeather)
    wait_until_idle(default_server.url)


def test_bind_tools_round_trip(llm, default_server):
    with_tools = llm.bind_tools([get_weather], tool_choice="get_weather")
    question = HumanMessage("What is the weather in Paris?")
    first = with_tools.invoke([question])
    assert [call["name"] for call in first.tool_calls] == ["get_weather"]
    call = first.tool_calls[0]
    assert call["args"]["city"] in ("Paris", "Lyon", "Nice") and call["id"]
    result = ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])
    second = llm.bind_tools([get_weather]).invoke([question, first, result])
    assert isinstance(second.content, str)
    assert second.content or second.tool_calls  # an answer (or another call), from the whole conversation
    assert second.response_metadata["finish_reason"] in ("stop", "tool_calls", "length")
    wait_until_idle(default_server.url)
