"""OpenAI's Responses API (`/v1/responses`) with the official clients: the `openai` SDK
(`responses.create`, `responses.stream`, retrieve, delete) and the OpenAI Agents SDK (an Agent
with a function tool on its default Responses model), against an in-process server of the
embedded SmolLM2.

Oracles: the chat completion of the same conversation at temperature 0 (the same tokens: one
request path); the conversation sent whole for one continued by previous_response_id;
`jsonschema` for function-call arguments and JSON output; the SDKs' own stream accumulators
(they refuse events out of order or items whose identity changes).
"""

from __future__ import annotations

import asyncio
import json

import pytest

from conftest import THINKING_REGEX, thinking_template

openai = pytest.importorskip("openai")

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"},
                                            "unit": {"type": "string",
                                                     "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city now",
          "parameters": WEATHER, "strict": True}]


@pytest.fixture(scope="module")
def served(smollm2_gguf):
    """(url, app, tokenizer) of an in-process server (default dtype), 3 responses stored."""
    from torchllama.bench.serve import serve_in_thread
    from torchllama.serving.app import create_app, load_for_engine

    model, tokenizer = load_for_engine(str(smollm2_gguf), "auto", progress=False)
    app = create_app(model, tokenizer, MODEL, responses_store=3)
    with serve_in_thread(app) as url:
        yield url, app, tokenizer


@pytest.fixture(scope="module")
def client(served):
    with openai.OpenAI(base_url=f"{served[0]}/v1", api_key="none", max_retries=0,
                       timeout=120) as c:
        yield c


def chat_text(client, messages, max_tokens=40) -> str:
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                          max_tokens=max_tokens).choices[0].message.content


def test_whole_and_streamed_response_equal_the_chat_completion(client):
    kwargs = dict(model=MODEL, instructions="Answer in one sentence.", temperature=0,
                  input="What is the capital of France?", max_output_tokens=40)
    expected = chat_text(client, [{"role": "system", "content": "Answer in one sentence."},
                                  {"role": "user", "content": "What is the capital of France?"}])
    r = client.responses.create(**kwargs)
    assert r.object == "response" and r.status == "completed" and r.model == MODEL
    assert r.output_text == expected and [i.type for i in r.output] == ["message"]
    assert r.usage.output_tokens > 0 and r.usage.total_tokens == \
        r.usage.input_tokens + r.usage.output_tokens
    with client.responses.stream(**kwargs) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert final.output_text == expected and final.status == "completed"
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    raw = list(client.responses.create(stream=True, **kwargs))       # the plain event stream
    assert [e.sequence_number for e in raw] == list(range(len(raw)))
    assert "".join(e.delta for e in raw if e.type == "response.output_text.delta") == expected


def test_previous_response_id_equals_the_conversation_sent_whole(client, served):
    engine = served[1].state.engine
    first = client.responses.create(model=MODEL, input="Name a color.", temperature=0,
                                    max_output_tokens=20)
    before = engine.prefill_tokens
    second = client.responses.create(model=MODEL, input="Name another one.", temperature=0,
                                     max_output_tokens=20, previous_response_id=first.id)
    prefilled = engine.prefill_tokens - before
    whole = client.responses.create(
        model=MODEL, temperature=0, max_output_tokens=20, store=False,
        input=[{"role": "user", "content": "Name a color."},
               *[item.model_dump(exclude_none=True) for item in first.output],
               {"role": "user", "content": "Name another one."}])
    assert second.output_text == whole.output_text
    assert whole.usage.input_tokens == second.usage.input_tokens
    assert second.output_text == chat_text(client, [
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Name another one."}], 20)
    # the first turn's prompt and answer came from the prefix cache: only the new turn (and
    # at most a block) was prefilled
    assert prefilled <= second.usage.input_tokens - first.usage.input_tokens + 16
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 16


def test_forced_function_call_validates_and_streams_the_same(client):
    jsonschema = pytest.importorskip("jsonschema")
    kwargs = dict(model=MODEL, input="What's the weather in Oslo?", tools=TOOLS,
                  tool_choice={"type": "function", "name": "get_weather"},
                  parallel_tool_calls=False, temperature=0, max_output_tokens=80)
    r = client.responses.create(**kwargs)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.status == "completed" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    (streamed,) = final.output
    assert (streamed.name, streamed.arguments) == (call.name, call.arguments)
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.done" in kinds
    assert "".join(e.delta for e in events
                   if e.type == "response.function_call_arguments.delta") == call.arguments
    # the tool's result answered in the next turn
    answer = client.responses.create(
        model=MODEL, tools=TOOLS, temperature=0, max_output_tokens=30,
        previous_response_id=r.id, input=[{"type": "function_call_output",
                                           "call_id": call.call_id, "output": "12 °C, sunny"}])
    assert answer.status in ("completed", "incomplete") and answer.output


def test_json_output_and_logprobs(client):
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    r = client.responses.create(model=MODEL, input="Ada is 36. Her record as JSON.",
                                temperature=0, max_output_tokens=60,
                                text={"format": {"type": "json_schema", "name": "person",
                                                 "schema": schema, "strict": True}},
                                include=["message.output_text.logprobs"], top_logprobs=2)
    jsonschema.validate(json.loads(r.output_text), schema)
    part = r.output[0].content[0]
    assert "".join(t.token for t in part.logprobs) == r.output_text
    assert all(len(t.top_logprobs) == 2 for t in part.logprobs)


def test_store_retrieve_delete_and_the_bound(client):
    ids = [client.responses.create(model=MODEL, input=f"Count to {i}.", temperature=0,
                                   max_output_tokens=4).id for i in range(4)]
    assert client.responses.retrieve(ids[-1]).id == ids[-1]
    with pytest.raises(openai.NotFoundError):               # 3 kept: the first is gone
        client.responses.retrieve(ids[0])
    client.responses.delete(ids[-1])
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.retrieve(ids[-1])
    assert "in memory" in e.value.body["message"]
    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=MODEL, input="Hi", previous_response_id=unstored.id)
    assert e.value.body["param"] == "previous_response_id"


def test_max_output_tokens_makes_it_incomplete(client):
    r = client.responses.create(model=MODEL, input="Tell me a long story.", temperature=0,
                                max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3


@pytest.mark.parametrize("body, param", [
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "tools": [{"type": "function", "name": "a b"}]}, "tools[0].name"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format"),
    ({"input": "x", "temperature": 3}, "temperature"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({}, "input"),
])
def test_bad_requests_are_400_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.post("/responses", body={"model": MODEL, **body}, cast_to=object)
    assert e.value.body["param"] == param, e.value.body


def test_agents_sdk_runs_a_function_tool_and_finishes(served):
    agents = pytest.importorskip("agents")
    from agents import Agent, ModelSettings, Runner, function_tool

    calls = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city now."""
        calls.append(city)
        return f"12 degrees and sunny in {city}"

    agents.set_tracing_disabled(True)
    agent = Agent(name="weather", instructions="You answer questions about the weather.",
                  model=MODEL, tools=[get_weather],
                  model_settings=ModelSettings(tool_choice="required", temperature=0,
                                               max_tokens=60, parallel_tool_calls=False))

    def use_server() -> None:                     # (a client per event loop)
        agents.set_default_openai_client(openai.AsyncOpenAI(
            base_url=f"{served[0]}/v1", api_key="none", max_retries=0), use_for_tracing=False)

    async def streamed_run():
        use_server()
        result = Runner.run_streamed(agent, "What's the weather in Lyon?")
        async for _ in result.stream_events():
            pass
        return result

    use_server()
    result = Runner.run_sync(agent, "What's the weather in Oslo?")
    kinds = [type(item).__name__ for item in result.new_items]
    assert calls == ["Oslo"]                       # the model called the tool, the SDK ran it
    assert kinds[:2] == ["ToolCallItem", "ToolCallOutputItem"] and kinds[-1] == \
        "MessageOutputItem" and isinstance(result.final_output, str)
    streamed = asyncio.run(streamed_run())
    assert calls == ["Oslo", "Lyon"] and isinstance(streamed.final_output, str)


def test_a_thinking_template_gives_a_reasoning_item(served, client):
    """A thinking template (it writes <think> and </think>), the output forced into a
    thinking model's shape by the regex extension: a reasoning item, then the message."""
    kwargs = dict(model=MODEL, input="Say hi.", max_output_tokens=60, temperature=0,
                  extra_body={"regex": THINKING_REGEX})
    with thinking_template(served[1], served[2]):
        r = client.responses.create(**kwargs)
        with client.responses.stream(**kwargs) as stream:
            final = stream.get_final_response()
    assert [i.type for i in r.output] == ["reasoning", "message"]
    thought = r.output[0].content[0].text
    assert thought.strip() and "<" not in thought and r.output_text[0].isupper()
    assert [i.type for i in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == thought and final.output_text == r.output_text
