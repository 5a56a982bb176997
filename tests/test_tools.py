"""Tool calling (`torchllama.serving.tools` and /v1/chat/completions with tools).

Oracles: `jsonschema` validates every call against its function's schema (independent of the
grammar engine that constrained it); the non-streamed answer is the oracle of the streamed one
(same seed: the engine is deterministic per request); the chat template's rendering is checked
against the text it must contain.
"""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")

from torchllama.bench.tool_sets import TOOL_SETS, check_call  # noqa: E402
from torchllama.serving.tools import (CALL_OPEN, ToolCallParser, ToolError, call_text,  # noqa: E402
                                      chat_messages, parse_all, renders_tools, tool_grammar,
                                      tools_of)

WEATHER = TOOL_SETS[0]
ANSWER = ('Let me look.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
          '"n": [1, {"a": "}\\n</tool_call>"}]}}\n</tool_call>\n<tool_call>\n{"name": '
          '"get_forecast", "arguments": {}}\n</tool_call>')


# --------------------------------------------------------------------------------------------
# The parser
# --------------------------------------------------------------------------------------------

def test_parser_splits_content_and_calls():
    parsed = parse_all(ANSWER)
    assert parsed.content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("get_weather", {"city": "Oslo", "n": [1, {"a": "}\n</tool_call>"}]}),
        ("get_forecast", {})]
    assert parsed.finish_reason == "tool_calls"
    assert len({c.id for c in parsed.calls}) == 2


@pytest.mark.parametrize("step", [1, 2, 3, 5, 7, 11, 64])
def test_parser_fed_in_pieces_gives_the_whole_texts_events(step):
    """A stream's pieces (any split) give the content and arguments of the whole text."""
    whole = parse_all(ANSWER)
    parser, events = ToolCallParser(), []
    for i in range(0, len(ANSWER), step):
        events += parser.feed(ANSWER[i:i + step])
    events += parser.finish()
    assert "".join(e[1] for e in events if e[0] == "content") == whole.content
    arguments: dict[int, str] = {}
    for e in events:
        if e[0] == "arguments":
            arguments[e[1]] = arguments.get(e[1], "") + e[2]
    assert arguments == {i: c.arguments for i, c in enumerate(whole.calls)}
    assert [e[1] for e in events if e[0] == "call"] == [0, 1]


def test_parser_keeps_text_without_calls_and_a_cut_call():
    assert parse_all("no call <tool here  ").content == "no call <tool here  "
    assert parse_all("no call <tool here  ").finish_reason is None
    cut = parse_all('<tool_call>\n{"name": "f", "arguments": {"a": "b')   # max_tokens
    assert cut.calls[0].arguments == '{"a": "b' and not cut.calls[0].complete
    assert cut.finish_reason is None


# --------------------------------------------------------------------------------------------
# Request checks and the prompt
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tools,choice,param", [
    (None, "required", "tool_choice"),
    (WEATHER.tools, {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
    (WEATHER.tools, "sometimes", "tool_choice"),
    ([{"type": "function", "function": {"name": "has space"}}], "auto", "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], "auto",
     "tools[0].function.parameters"),
    ([{"type": "retrieval"}], "auto", "tools[0]"),
    (WEATHER.tools + WEATHER.tools[:1], "auto", "tools[2].function.name"),
])
def test_bad_tools_name_the_field(tools, choice, param):
    with pytest.raises(ToolError) as e:
        tools_of(tools, choice, None)
    assert e.value.param == param


def test_fallback_prompt_carries_tools_calls_and_results():
    tools = tools_of(WEATHER.tools, "auto", None)
    args = '{"city": "Oslo"}'
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "get_weather",
                                                         "arguments": args}}]},
        {"role": "tool", "tool_call_id": "a", "content": "12 C"},
        {"role": "tool", "tool_call_id": "b", "content": "rain"}]
    out, offered = chat_messages(messages, tools, native=False)
    assert offered is None                              # the template never sees `tools`
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n# Tools")
    assert json.dumps(WEATHER.tools[1]) in out[0]["content"]
    assert out[2]["content"] == call_text("get_weather", args)     # the model's own format
    assert out[3]["content"] == ("<tool_response>\n12 C\n</tool_response>\n"
                                 "<tool_response>\nrain\n</tool_response>")
    none, _ = chat_messages(messages, tools_of(WEATHER.tools, "none", None), native=False)
    assert "# Tools" not in none[0]["content"]


HERMES_LIKE = (   # a template that renders tools itself, in the format the parser reads
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.arguments.city }}</tool_call>"
    "{% endfor %}\n{% endfor %}")


def test_native_template_gets_tools_and_arguments_as_objects(smollm2_auto):
    _, tokenizer = smollm2_auto
    assert renders_tools(HERMES_LIKE) and not renders_tools(tokenizer.chat_template)
    tools = tools_of(WEATHER.tools, "auto", None)
    messages = [{"role": "user", "content": "Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "a", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}]
    out, offered = chat_messages(messages, tools, native=True)
    tokenizer = type(tokenizer).__new__(type(tokenizer))      # a copy with another template
    tokenizer.__dict__.update(smollm2_auto[1].__dict__, chat_template=HERMES_LIKE,
                              _compiled_template=None)
    text = tokenizer.apply_chat_template(out, add_generation_prompt=False, tools=offered)
    assert text == ("TOOLS:get_weather;get_forecast;<user>Oslo?"     # (trim_blocks)
                    "<assistant><tool_call>Oslo</tool_call>")


# --------------------------------------------------------------------------------------------
# The grammar
# --------------------------------------------------------------------------------------------

def _allowed_after(grammars, grammar: str, text: str):
    constraint = grammars.compile("grammar", grammar)
    for token in grammars.tokenizer.encode(text):
        assert constraint.allowed()[token], text
        constraint.accept(token)
    return constraint


def test_auto_grammar_is_free_until_the_marker_then_only_calls(smollm2_auto):
    from torchllama.generation.grammar import Grammars

    _, tokenizer = smollm2_auto
    grammars = Grammars(tokenizer)
    grammar = tool_grammar(tools_of(WEATHER.tools, "auto", None))
    free = _allowed_after(grammars, grammar, "Sure: <b>Oslo</b> is cold.\n")
    assert free.accepting and free.allowed().sum() > 0.99 * tokenizer.vocab_size - 200
    called = _allowed_after(grammars, grammar, "Sure. " + CALL_OPEN)
    allowed = called.allowed().nonzero().flatten().tolist()
    assert [tokenizer.decode([t]) for t in allowed] == ["\n"]          # the call's JSON next
    done = _allowed_after(grammars, grammar, "Sure. " + call_text("get_weather",
                                                                  '{"city": "Oslo"}'))
    assert done.accepting                              # more calls ("\n") or the end
    assert {tokenizer.decode([t]) for t in done.allowed().nonzero().flatten().tolist()
            if t not in tokenizer.stop_ids} == {"\n"}


def test_named_choice_allows_only_that_function(smollm2_auto):
    from torchllama.generation.grammar import Grammars

    _, tokenizer = smollm2_auto
    grammars = Grammars(tokenizer)
    grammar = tool_grammar(tools_of(WEATHER.tools, {"type": "function", "function": {
        "name": "get_forecast"}}, False))
    constraint = _allowed_after(grammars, grammar, CALL_OPEN + '\n{"name": "get_')
    assert constraint.allowed()[tokenizer.encode("forecast")[0]]
    assert not constraint.allowed()[tokenizer.encode("weather")[0]]
    one = _allowed_after(grammars, grammar, call_text("get_forecast",
                                                      '{"city": "Oslo", "days": 3}'))
    assert set(one.allowed().nonzero().flatten().tolist()) <= set(tokenizer.stop_ids)


# --------------------------------------------------------------------------------------------
# The server, with the openai client
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def client(smollm2_gguf):
    from torchllama.bench.serve import serve_in_thread
    from torchllama.serving.app import create_app, load_for_engine

    model, tokenizer = load_for_engine(str(smollm2_gguf), "auto", progress=False)
    with serve_in_thread(create_app(model, tokenizer, "m")) as url:
        with openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0,
                           timeout=120) as c:
            yield c


def _streamed(client, **kwargs):
    calls: dict[int, list] = {}
    content, reason, ids = "", None, {}
    for event in client.chat.completions.create(stream=True, **kwargs):
        choice = event.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            entry = calls.setdefault(d.index, ["", ""])
            if d.id:
                ids[d.index] = d.id
            entry[0] += d.function.name or ""
            entry[1] += d.function.arguments or ""
        reason = choice.finish_reason or reason
    assert len(ids) == len(calls)                      # each call's first delta has its id
    return [tuple(calls[i]) for i in sorted(calls)], content, reason


@pytest.mark.parametrize("tool_set", TOOL_SETS, ids=[s.name for s in TOOL_SETS])
def test_required_and_named_calls_validate_and_stream_the_same(client, tool_set):
    """Sets in turn: "required" (parallel calls) or the second function by name (one call),
    sampled: every complete call validates against its schema (one cut by max_tokens, the
    last of an answer that ran out, is a prefix), and the stream's calls equal the whole
    answer's. (`benchmarks/tool_calling.py` sends 60 such requests.)"""
    second = tool_set.tools[1]["function"]["name"]
    valid = 0
    i = TOOL_SETS.index(tool_set) % 2
    for choice, parallel in [[("required", True)],
                             [({"type": "function", "function": {"name": second}}, False)]][i]:
        kwargs = dict(model="m", tools=tool_set.tools, tool_choice=choice,
                      parallel_tool_calls=parallel, temperature=0.8, seed=i, max_tokens=200,
                      messages=[{"role": "user", "content": tool_set.questions[i]}])
        whole = client.chat.completions.create(**kwargs).choices[0]
        assert whole.finish_reason in ("tool_calls", "length"), whole
        calls = whole.message.tool_calls
        assert calls and whole.message.content is None
        cut = whole.finish_reason == "length"
        for call in calls[:len(calls) - cut]:
            check_call(tool_set, call)
            valid += 1
        if not parallel:
            assert [c.function.name for c in calls] == [second]
        assert _streamed(client, **kwargs) == (
            [(c.function.name, c.function.arguments) for c in calls], "", whole.finish_reason)
    assert valid >= 1


def test_auto_answers_in_text_when_the_model_does_not_call(client):
    kwargs = dict(model="m", tools=WEATHER.tools, temperature=0, max_tokens=24,
                  messages=[{"role": "user", "content": "Say hello."}])
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert not whole.message.tool_calls and whole.message.content
    assert _streamed(client, **kwargs) == ([], whole.message.content, whole.finish_reason)


def test_a_conversation_with_calls_and_results_is_answered(client):
    args = '{"city": "Oslo"}'
    r = client.chat.completions.create(model="m", tools=WEATHER.tools, max_tokens=12,
                                       temperature=0, messages=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": args}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "12 C and sunny"}])
    assert r.choices[0].message.content is not None


@pytest.mark.parametrize("kwargs,param", [
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=WEATHER.tools, tool_choice={"type": "function", "function": {"name": "nope"}}),
     "tool_choice"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=a)b"}}}}}],
          tool_choice="required"), "tools[0].function.parameters"),
    (dict(tools=WEATHER.tools, response_format={"type": "json_object"}), "tools"),
])
def test_bad_tool_requests_are_400_naming_the_field(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", max_tokens=4,
                                       messages=[{"role": "user", "content": "hi"}], **kwargs)
    assert e.value.body["param"] == param


# --------------------------------------------------------------------------------------------
# Objects a schema leaves open, and strict functions
# --------------------------------------------------------------------------------------------

PLOT = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 40},
    "points": {"type": "array", "minItems": 1, "maxItems": 4, "items": {
        "type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
        "required": ["x", "y"]}},
    "style": {"type": "object"},                                  # any object, on purpose
    "labels": {"type": "object", "properties": {"x": {"type": "string"}},
               "additionalProperties": True}},                    # open, on purpose
    "required": ["title", "points"]}


def test_closed_schema_closes_objects_that_list_their_properties():
    from torchllama.generation.grammar import closed_schema

    closed = closed_schema({**PLOT, "$defs": {"p": {"properties": {"q": {}}}},
                            "properties": {**PLOT["properties"],
                                           "properties": {"type": "string"}}})
    assert closed["additionalProperties"] is False
    assert closed["properties"]["points"]["items"]["additionalProperties"] is False
    assert closed["$defs"]["p"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]["style"]      # lists none
    assert closed["properties"]["labels"]["additionalProperties"] is True   # says so
    assert closed["properties"]["properties"] == {"type": "string"}         # a property's name
    assert closed["required"] == ["title", "points"] and "additionalProperties" not in PLOT
    strict = closed_schema(PLOT, require_all=True)
    assert strict["required"] == ["title", "points", "style", "labels"]
    assert strict["properties"]["labels"] == {"type": "object", "properties": {
        "x": {"type": "string"}}, "additionalProperties": False, "required": ["x"]}


def test_forced_calls_on_schemas_that_leave_objects_open_end_inside_max_tokens(client):
    """The issue's plot tool: sampled at temperature 1, its points' items used to grow
    invented keys until max_tokens cut the call. Closed by default, every call ends and has
    only the keys the schema lists where it lists them."""
    jsonschema = pytest.importorskip("jsonschema")
    from torchllama.generation.grammar import closed_schema

    tools = [{"type": "function", "function": {"name": "plot", "description": "Plot points",
                                               "parameters": PLOT}}]
    r = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Plot (1, 2), (3, 5) and (4, 4)."}],
        tools=tools, tool_choice="required", parallel_tool_calls=False, max_tokens=200,
        temperature=1.0, seed=5, n=8)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls", choice.message.tool_calls
        (call,) = choice.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), closed_schema(PLOT))


def test_a_strict_function_gets_every_property(client):
    jsonschema = pytest.importorskip("jsonschema")
    from torchllama.generation.grammar import closed_schema

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "unit": {"type": "string",
                                                        "enum": ["c", "f"]}},
              "required": ["city"]}
    tools = [{"type": "function", "function": {"name": "get_weather", "strict": True,
                                               "parameters": schema}}]
    r = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=tools,
        tool_choice="required", parallel_tool_calls=False, max_tokens=80, temperature=1.0,
        seed=1, n=4)
    for choice in r.choices:
        arguments = json.loads(choice.message.tool_calls[0].function.arguments)
        assert set(arguments) == {"city", "unit"}
        jsonschema.validate(arguments, closed_schema(schema, require_all=True))


def test_the_benchmarks_write_objects_closed_unsaid_or_open():
    from torchllama.bench.tool_sets import PLOT, with_objects

    schema = PLOT.tools[0]["function"]["parameters"]
    for mode, says in (("closed", False), ("unsaid", None), ("open", True)):
        written = with_objects(schema, mode)
        for obj in (written, written["properties"]["points"]["items"]):
            assert obj.get("additionalProperties") is says, mode
    assert with_objects(schema, "closed") == schema          # as tool_sets writes it
