"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) with the official
`anthropic` SDK (create, stream, count_tokens; x-api-key) against an in-process server of the
embedded SmolLM2 with an API key.

Oracles: the chat completion of the same conversation at temperature 0 (one request path);
the SDK's own stream accumulator (`messages.stream(...).get_final_message()`) for streamed =
whole; `jsonschema` for tool inputs and JSON output; the chat API's prompt token count.
(Anthropic's current SDK no longer takes `temperature` as an argument: it goes in
`extra_body`, which the server reads as before.)
"""

from __future__ import annotations

import json

import pytest

from conftest import THINKING_REGEX, thinking_template

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

MODEL = "SmolLM2-135M-Instruct"
KEY = "messages-key"
GREEDY = {"temperature": 0}
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "The weather in a city now",
          "input_schema": WEATHER}]


@pytest.fixture(scope="module")
def served(smollm2_gguf):
    from torchllama.bench.serve import serve_in_thread
    from torchllama.serving.app import create_app, load_for_engine

    model, tokenizer = load_for_engine(str(smollm2_gguf), "auto", progress=False)
    app = create_app(model, tokenizer, MODEL, api_key=KEY)
    with serve_in_thread(app) as url:
        yield url, app, tokenizer


@pytest.fixture(scope="module")
def client(served):
    with anthropic.Anthropic(base_url=served[0], api_key=KEY, max_retries=0,
                             timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def openai_client(served):
    with openai.OpenAI(base_url=f"{served[0]}/v1", api_key=KEY, max_retries=0) as c:
        yield c


def test_create_and_stream_give_the_chat_completions_text(client, openai_client):
    question = [{"role": "user", "content": "What is the capital of France?"}]
    chat = openai_client.chat.completions.create(
        model=MODEL, max_tokens=40, temperature=0,
        messages=[{"role": "system", "content": "Be brief."}] + question)
    kwargs = dict(model=MODEL, max_tokens=40, system="Be brief.", messages=question,
                  extra_body=GREEDY)
    m = client.messages.create(**kwargs)
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL
    assert [b.type for b in m.content] == ["text"]
    assert m.content[0].text == chat.choices[0].message.content
    assert m.stop_reason == "end_turn" and m.stop_sequence is None
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert m.usage.output_tokens == chat.usage.completion_tokens
    with client.messages.stream(**kwargs) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert final.content[0].text == m.content[0].text and final.stop_reason == "end_turn"
    assert final.usage.output_tokens == m.usage.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        chat.usage.prompt_tokens
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "content_block_stop" in kinds
    system_blocks = client.messages.create(**{**kwargs, "system": [{"type": "text",
                                                                    "text": "Be brief."}]})
    assert system_blocks.content[0].text == m.content[0].text


def test_forced_tool_use_then_a_tool_result_is_answered(client):
    jsonschema = pytest.importorskip("jsonschema")
    kwargs = dict(model=MODEL, max_tokens=80, tools=TOOLS, extra_body=GREEDY,
                  tool_choice={"type": "tool", "name": "get_weather",
                               "disable_parallel_tool_use": True},
                  messages=[{"role": "user", "content": "What's the weather in Oslo?"}])
    m = client.messages.create(**kwargs)
    (block,) = m.content
    assert block.type == "tool_use" and block.name == "get_weather"
    assert block.id.startswith("toolu_") and m.stop_reason == "tool_use"
    jsonschema.validate(block.input, WEATHER)
    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert [(b.type, b.name, b.input) for b in final.content] == \
        [("tool_use", block.name, block.input)] and final.stop_reason == "tool_use"
    answer = client.messages.create(
        model=MODEL, max_tokens=40, tools=TOOLS, extra_body=GREEDY, messages=[
            *kwargs["messages"], {"role": "assistant", "content": m.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id,
                                          "content": "12 °C, sunny"}]}])
    assert answer.content[0].type == "text" and answer.content[0].text
    assert answer.stop_reason in ("end_turn", "max_tokens")


def test_any_tool_and_json_output(client):
    jsonschema = pytest.importorskip("jsonschema")
    m = client.messages.create(model=MODEL, max_tokens=80, tools=TOOLS, extra_body=GREEDY,
                               tool_choice={"type": "any"},
                               messages=[{"role": "user", "content": "Weather in Lyon?"}])
    assert m.content[0].type == "tool_use"
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    m = client.messages.create(model=MODEL, max_tokens=60, extra_body=GREEDY,
                               output_config={"format": {"type": "json_schema",
                                                         "schema": schema}},
                               messages=[{"role": "user", "content": "Ada is 36, as JSON."}])
    jsonschema.validate(json.loads(m.content[0].text), schema)


def test_stop_sequences_and_max_tokens(client):
    m = client.messages.create(model=MODEL, max_tokens=40, extra_body=GREEDY,
                               stop_sequences=["four", "4"],
                               messages=[{"role": "user", "content": "Count: one, two, three,"}])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence in ("four", "4")
    assert m.stop_sequence not in m.content[0].text
    m = client.messages.create(model=MODEL, max_tokens=3, extra_body=GREEDY,
                               messages=[{"role": "user", "content": "Tell me a story."}])
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3


def test_count_tokens_is_the_prompt_the_model_sees(client, openai_client):
    messages = [{"role": "user", "content": "Hello there"}]
    counted = client.messages.count_tokens(model=MODEL, messages=messages, system="Be kind.")
    chat = openai_client.chat.completions.create(
        model=MODEL, max_tokens=1, messages=[{"role": "system", "content": "Be kind."}] +
        messages)
    assert counted.input_tokens == chat.usage.prompt_tokens
    with_tools = client.messages.count_tokens(model=MODEL, messages=messages, tools=TOOLS)
    assert with_tools.input_tokens > counted.input_tokens


@pytest.mark.parametrize("body, field", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"max_tokens": 5, "messages": []}, "messages"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
     "messages.0.content.0.type"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
      "tool_choice": {"type": "sometimes"}}, "tool_choice"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
      "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"},
                                    {"role": "assistant", "content": "Hel"}]}, "messages"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "temperature": 1.5},
     "temperature"),
])
def test_bad_bodies_get_anthropics_error_naming_the_field(client, body, field):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.post("/v1/messages", body={"model": MODEL, **body}, cast_to=object)
    error = e.value.body
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert error["error"]["message"].startswith(field), error


def test_the_api_key_as_x_api_key_or_bearer(served):
    url = served[0]
    with anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0) as bad:
        with pytest.raises(anthropic.AuthenticationError) as e:
            bad.messages.create(model=MODEL, max_tokens=2,
                                messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["error"]["type"] == "authentication_error"
    with anthropic.Anthropic(base_url=url, auth_token=KEY, max_retries=0) as bearer:
        assert bearer.messages.count_tokens(
            model=MODEL, messages=[{"role": "user", "content": "hi"}]).input_tokens > 0
    with openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0) as c:
        with pytest.raises(openai.AuthenticationError) as e:    # OpenAI's shape elsewhere
            c.models.list()
    assert e.value.body["type"] == "authentication_error"
    import urllib.error
    import urllib.request

    for path in ("/tokenize", "/v1/messages/count_tokens", "/tokenizer_info"):
        data = None if path == "/tokenizer_info" else b'{"prompt": "hi"}'
        with pytest.raises(urllib.error.HTTPError) as e:          # behind the key like the rest
            urllib.request.urlopen(urllib.request.Request(
                url + path, data, {"Content-Type": "application/json",
                                   "x-api-key": "wrong"}), timeout=30)
        assert e.value.code == 401, path


def test_a_thinking_template_gives_a_thinking_block(served, client):
    kwargs = dict(model=MODEL, max_tokens=60, messages=[{"role": "user", "content": "Say hi."}],
                  extra_body={"temperature": 0, "regex": THINKING_REGEX})
    with thinking_template(served[1], served[2]):
        m = client.messages.create(**kwargs)
        with client.messages.stream(**kwargs) as stream:
            final = stream.get_final_message()
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking.strip() and "<" not in m.content[0].thinking
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == m.content[0].thinking
    assert final.content[1].text == m.content[1].text


def test_a_body_over_the_limit_is_413_in_each_apis_shape(served):
    """8 MiB by default (`serve --max-body-mb`): refused by its Content-Length, or counted as
    a chunked body arrives, before the app parses it."""
    import http.client

    host, port = served[0].removeprefix("http://").split(":")
    big = json.dumps({"model": MODEL, "max_tokens": 1,
                      "messages": [{"role": "user", "content": "x" * (9 << 20)}]}).encode()
    for path, chunked in (("/v1/messages", False), ("/v1/messages", True),
                          ("/v1/chat/completions", False)):
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        headers = {"Content-Type": "application/json", "x-api-key": KEY}
        if chunked:
            conn.request("POST", path, (big[i:i + 65536] for i in range(0, len(big), 65536)),
                         headers, encode_chunked=True)
        else:
            conn.request("POST", path, big, headers)
        response = conn.getresponse()
        body = json.loads(response.read())
        conn.close()
        assert response.status == 413, (path, chunked)
        message = body["error"]["message"]
        assert "8388608 bytes" in message and "--max-body-mb" in message
        assert (body.get("type") == "error") == path.startswith("/v1/messages")
