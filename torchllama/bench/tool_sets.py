"""Six tool sets and their questions, for the tool-calling benchmark, tests and the load bench.

Each set has two functions whose parameter schemas cover what agents send: nested objects,
enums, arrays (of strings and of objects), numbers with bounds, optional fields. `check_call`
validates a returned call against its function's schema with `jsonschema` (an oracle
independent of the grammar engine that constrained it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass


def _fn(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties, "required": required,
                       "additionalProperties": False}}}


_STR = {"type": "string"}


@dataclass(frozen=True)
class ToolSet:
    """Tools offered together and questions that call for them."""

    name: str
    tools: list
    questions: list

    def schema(self, function: str) -> dict:
        for tool in self.tools:
            if tool["function"]["name"] == function:
                return tool["function"]["parameters"]
        raise KeyError(function)


TOOL_SETS = [
    ToolSet("weather", [
        _fn("get_weather", "Current weather in a city",
            {"city": _STR, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            ["city"]),
        _fn("get_forecast", "Weather forecast for the next days",
            {"city": _STR, "days": {"type": "integer", "minimum": 1, "maximum": 10}},
            ["city", "days"]),
    ], ["What's the weather in Oslo right now?", "Will it rain in Lyon over the next 3 days?"]),
    ToolSet("calendar", [
        _fn("create_event", "Add an event to the calendar",
            {"title": _STR,
             "start": {"type": "object", "properties": {
                 "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                 "time": {"type": "string", "pattern": "^[0-9]{2}:[0-9]{2}$"}},
                 "required": ["date", "time"], "additionalProperties": False},
             "attendees": {"type": "array", "items": _STR, "maxItems": 8},
             "location": _STR},
            ["title", "start"]),
        _fn("list_events", "Events on a day", {"date": _STR}, ["date"]),
    ], ["Book a team lunch on 2026-12-03 at 12:30 with Ana and Bo.",
        "What is on my calendar on 2026-12-01?"]),
    ToolSet("shop", [
        _fn("place_order", "Order items from the shop",
            {"items": {"type": "array", "minItems": 1, "maxItems": 5, "items": {
                "type": "object", "properties": {
                    "sku": _STR, "quantity": {"type": "integer", "minimum": 1, "maximum": 99}},
                "required": ["sku", "quantity"], "additionalProperties": False}},
             "shipping": {"type": "string", "enum": ["standard", "express"]}},
            ["items", "shipping"]),
        _fn("track_order", "Where an order is", {"order_id": _STR}, ["order_id"]),
    ], ["Order two of SKU A-100 and one B-7, express.", "Where is my order 55-X?"]),
    ToolSet("search", [
        _fn("web_search", "Search the web",
            {"query": _STR, "max_results": {"type": "integer", "minimum": 1, "maximum": 20},
             "filters": {"type": "object", "properties": {
                 "site": _STR, "year": {"type": "integer", "minimum": 1990, "maximum": 2030}},
                 "additionalProperties": False}},
            ["query"]),
        _fn("open_page", "Open a web page", {"url": _STR}, ["url"]),
    ], ["Find recent articles about rotary position embeddings.",
        "Open the page https://example.org/rope"]),
    ToolSet("convert", [
        _fn("convert_units", "Convert a quantity between units",
            {"value": {"type": "number"},
             "from_unit": {"type": "string", "enum": ["km", "mi", "kg", "lb", "c", "f"]},
             "to_unit": {"type": "string", "enum": ["km", "mi", "kg", "lb", "c", "f"]}},
            ["value", "from_unit", "to_unit"]),
        _fn("convert_currency", "Convert money",
            {"amount": {"type": "number", "minimum": 0},
             "currency": {"type": "string", "enum": ["EUR", "USD", "NOK", "JPY"]},
             "to": {"type": "string", "enum": ["EUR", "USD", "NOK", "JPY"]}},
            ["amount", "currency", "to"]),
    ], ["How many miles is 42 km?", "What is 100 EUR in NOK?"]),
    ToolSet("email", [
        _fn("send_email", "Send an email",
            {"to": {"type": "array", "minItems": 1, "maxItems": 4, "items": _STR},
             "subject": _STR, "body": _STR,
             "priority": {"type": "string", "enum": ["low", "normal", "high"]},
             "cc": {"type": "array", "items": _STR}},
            ["to", "subject", "body"]),
        _fn("search_inbox", "Search the inbox",
            {"query": _STR, "unread_only": {"type": "boolean"}}, ["query"]),
    ], ["Email bo@example.com that the report is late, high priority.",
        "Do I have unread mail from Ana?"]),
]


#: The plot tool of issue 46: its points' items list x and y and say nothing of other keys; at
#: temperature 1 a small model forced to call it kept adding keys to them until max_tokens.
PLOT = ToolSet("plot", [_fn("plot", "Plot points on a chart", {
    "title": {"type": "string", "maxLength": 40},
    "points": {"type": "array", "minItems": 1, "maxItems": 6, "items": {
        "type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
        "required": ["x", "y"], "additionalProperties": False}}}, ["title", "points"])],
    ["Plot (1, 2), (3, 5) and (4, 4).", "Chart my weight: 70 in May, 68 in June, 67 in July."])


#: How a benchmark writes its schemas' objects: "closed" as written here (every object says
#: "additionalProperties": false), "unsaid" (no object says anything of other keys: ordinary
#: schemas, which the server closes by default, `grammar.closed_schema`), "open" (every object
#: says "additionalProperties": true: JSON Schema's own default, what the server did before).
OBJECT_MODES = ("closed", "unsaid", "open")


def with_objects(schema, mode: str):
    """A copy of a schema whose objects say of other keys what `mode` says (OBJECT_MODES)."""
    if isinstance(schema, list):
        return [with_objects(s, mode) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: with_objects(v, mode) if k != "additionalProperties" else v
           for k, v in schema.items()}
    if "properties" in out:
        out.pop("additionalProperties", None)
        if mode != "unsaid":
            out["additionalProperties"] = mode == "open"
    return out


def tool_set_with_objects(tool_set: ToolSet, mode: str) -> ToolSet:
    """The tool set with its parameter schemas' objects written as `mode` says."""
    tools = [{"type": "function", "function": {
        **t["function"], "parameters": with_objects(t["function"]["parameters"], mode)}}
        for t in tool_set.tools]
    return ToolSet(tool_set.name, tools, tool_set.questions)


def check_call(tool_set: ToolSet, call) -> dict:
    """The arguments of a returned call (an openai `ChatCompletionMessageToolCall` or OpenAI's
    dict), parsed and validated against the function's schema.

    Raises:
        KeyError: the function is not in the set.
        ValueError: the arguments are not JSON (json.JSONDecodeError).
        jsonschema.ValidationError: they do not match the schema.
    """
    import jsonschema

    fn = call["function"] if isinstance(call, dict) else call.function
    name = fn["name"] if isinstance(fn, dict) else fn.name
    arguments = json.loads(fn["arguments"] if isinstance(fn, dict) else fn.arguments)
    jsonschema.validate(arguments, tool_set.schema(name))
    return arguments
