"""The agent and structured-output libraries people point at an OpenAI-compatible server, run
unchanged against an in-process server of the embedded SmolLM2: pydantic-ai (its chat and its
Responses models, a typed output), LangChain (`ChatOpenAI`, `bind_tools`) and instructor (its
tools and JSON-schema modes).

Oracles: each library's own parsing and validation (a pydantic model it builds — with no
retries: the first answer must parse and validate —, a tool call it reads), the text the chat
API gives the same prompt, and the facts in the prompt.
"""

from __future__ import annotations

import pytest
from pydantic import BaseModel

openai = pytest.importorskip("openai")

MODEL = "SmolLM2-135M-Instruct"
ASK = "Ada is 36 years old. Extract her record."


class Person(BaseModel):
    name: str
    age: int


@pytest.fixture(scope="module")
def url(smollm2_gguf):
    from torchllama.bench.serve import serve_in_thread
    from torchllama.serving.app import create_app, load_for_engine

    model, tokenizer = load_for_engine(str(smollm2_gguf), "auto", progress=False)
    with serve_in_thread(create_app(model, tokenizer, MODEL)) as base:
        yield f"{base}/v1"


@pytest.mark.parametrize("kind", ["chat", "responses"])
def test_pydantic_ai_typed_output(url, kind):
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.settings import ModelSettings

    kinds = {"chat": OpenAIChatModel, "responses": OpenAIResponsesModel}
    model = kinds[kind](MODEL, provider=OpenAIProvider(base_url=url, api_key="none"))
    agent = Agent(model, output_type=Person,
                  model_settings=ModelSettings(temperature=0, max_tokens=80))
    assert agent.run_sync(ASK).output == Person(name="Ada", age=36)


def test_langchain_chat_and_bound_tools(url):
    pytest.importorskip("langchain_openai")
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city now."""
        return "sunny"

    llm = ChatOpenAI(base_url=url, api_key="none", model=MODEL, temperature=0, max_tokens=40)
    with openai.OpenAI(base_url=url, api_key="none") as client:
        expected = client.chat.completions.create(
            model=MODEL, temperature=0, max_tokens=40,
            messages=[{"role": "user", "content": "Say hi."}]).choices[0].message.content
    assert llm.invoke("Say hi.").content == expected
    message = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("Weather in Oslo?")
    (call,) = message.tool_calls                   # a named function: one call
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_response_model(url, mode):
    instructor = pytest.importorskip("instructor")
    client = instructor.from_openai(openai.OpenAI(base_url=url, api_key="none"),
                                    mode=getattr(instructor.Mode, mode))
    person = client.chat.completions.create(model=MODEL, response_model=Person, temperature=0,
                                            max_tokens=80, max_retries=0,
                                            messages=[{"role": "user", "content": ASK}])
    assert isinstance(person, Person) and person.name and person.age == 36
