"""What the request bodies accept, as JSON Schema for the OpenAPI document.

Where a body field stays a plain dict in Python (the handlers check it and answer 400 naming
what is wrong: Anthropic's content blocks, the Responses API's input items, tools), these
schemas tell clients — and schemathesis, which generates bodies from them — its real shape;
`WithJsonSchema` changes the document, not the validation. Token ids carry `x-token-id`: the
app puts the vocabulary's size in as their `maximum` (`torchllama.serving.app`).

Sources: OpenAI's and Anthropic's API references (the request bodies).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, WithJsonSchema

#: a token id: ≥ 0 (below the vocabulary's size: the app's OpenAPI document says which)
TokenId = Annotated[int, Field(ge=0, json_schema_extra={"x-token-id": True})]

#: a non-empty list of token ids
TokenIds = Annotated[list[TokenId], Field(min_length=1)]

TEXT = {"type": "string"}
TEXT_BLOCK = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"const": "text"}, "text": TEXT}}
TOOL_NAME = {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"}
OBJECT_SCHEMA = {"type": "object", "required": ["type"],
                 "properties": {"type": {"const": "object"}, "properties": {"type": "object"}}}

_TOOL_USE = {"type": "object", "required": ["type", "id", "name", "input"], "properties": {
    "type": {"const": "tool_use"}, "id": TEXT, "name": TOOL_NAME, "input": {"type": "object"}}}
_TOOL_RESULT = {"type": "object", "required": ["type", "tool_use_id", "content"],
                "properties": {"type": {"const": "tool_result"}, "tool_use_id": TEXT,
                               "content": TEXT, "is_error": {"type": "boolean"}}}

#: Anthropic's messages: a user's content a string or text/tool_result blocks, an
#: assistant's text/tool_use blocks (the last message must be the user's: checked)
ANTHROPIC_MESSAGES = {"type": "array", "minItems": 1, "items": {"anyOf": [
    {"type": "object", "required": ["role", "content"], "properties": {
        "role": {"const": "user"}, "content": {"anyOf": [TEXT, {
            "type": "array", "minItems": 1, "items": {"anyOf": [TEXT_BLOCK, _TOOL_RESULT]}}]}}},
    {"type": "object", "required": ["role", "content"], "properties": {
        "role": {"const": "assistant"}, "content": {"anyOf": [TEXT, {
            "type": "array", "minItems": 1, "items": {"anyOf": [TEXT_BLOCK, _TOOL_USE]}}]}}}]}}

ANTHROPIC_TOOLS = {"type": "array", "items": {
    "type": "object", "required": ["name", "input_schema"], "properties": {
        "name": TOOL_NAME, "description": TEXT, "input_schema": OBJECT_SCHEMA}}}

ANTHROPIC_TOOL_CHOICE = {"type": "object", "required": ["type"], "properties": {
    "type": {"enum": ["auto", "any", "none"]},
    "disable_parallel_tool_use": {"type": "boolean"}}}

#: OpenAI's function tools (chat completions: {"type": "function", "function": {...}})
CHAT_TOOLS = {"type": "array", "items": {
    "type": "object", "required": ["type", "function"], "properties": {
        "type": {"const": "function"}, "function": {
            "type": "object", "required": ["name"], "properties": {
                "name": TOOL_NAME, "description": TEXT, "parameters": OBJECT_SCHEMA,
                "strict": {"type": "boolean"}}}}}}

#: the Responses API's function tools (flat: {"type": "function", "name", "parameters"})
RESPONSES_TOOLS = {"type": "array", "items": {
    "type": "object", "required": ["type", "name"], "properties": {
        "type": {"const": "function"}, "name": TOOL_NAME, "description": TEXT,
        "parameters": OBJECT_SCHEMA, "strict": {"type": "boolean"}}}}

#: the Responses API's input: text, or items (messages, function calls and their outputs)
RESPONSES_INPUT = {"anyOf": [TEXT, {"type": "array", "minItems": 1, "items": {"anyOf": [
    {"type": "object", "required": ["role", "content"], "properties": {
        "type": {"const": "message"}, "role": {"enum": ["user", "system", "developer"]},
        "content": {"anyOf": [TEXT, {"type": "array", "items": {
            "type": "object", "required": ["type", "text"], "properties": {
                "type": {"const": "input_text"}, "text": TEXT}}}]}}},
    {"type": "object", "required": ["type", "call_id", "name", "arguments"], "properties": {
        "type": {"const": "function_call"}, "call_id": TEXT, "name": TOOL_NAME,
        "arguments": TEXT}},
    {"type": "object", "required": ["type", "call_id", "output"], "properties": {
        "type": {"const": "function_call_output"}, "call_id": TEXT, "output": TEXT}}]}}]}


def described(schema: dict) -> Any:
    """An annotation that documents a dict-typed field with `schema`."""
    return WithJsonSchema(schema)


_TEXT_PARTS = {"type": "array", "minItems": 1, "items": TEXT_BLOCK}
_CONTENT = {"anyOf": [TEXT, _TEXT_PARTS]}

#: OpenAI's chat messages as the chat template takes them
CHAT_MESSAGES = {"type": "array", "minItems": 1, "items": {"anyOf": [
    {"type": "object", "required": ["role", "content"], "properties": {
        "role": {"enum": ["system", "developer", "user", "assistant"]}, "content": _CONTENT,
        "name": TEXT}},
    {"type": "object", "required": ["role", "tool_calls"], "properties": {
        "role": {"const": "assistant"}, "tool_calls": {"type": "array", "minItems": 1,
                                                       "items": {
            "type": "object", "required": ["id", "type", "function"], "properties": {
                "id": TEXT, "type": {"const": "function"}, "function": {
                    "type": "object", "required": ["name", "arguments"],
                    "properties": {"name": TOOL_NAME, "arguments": TEXT}}}}}}},
    {"type": "object", "required": ["role", "content", "tool_call_id"], "properties": {
        "role": {"const": "tool"}, "content": _CONTENT, "tool_call_id": TEXT}}]}}

#: chat messages of plain text (/tokenize)
TEXT_MESSAGES = {"type": "array", "minItems": 1, "items": {
    "type": "object", "required": ["role", "content"], "properties": {
        "role": {"enum": ["system", "developer", "user", "assistant"]}, "content": TEXT}}}

#: OpenAI's tool_choice
CHAT_TOOL_CHOICE = {"anyOf": [{"enum": ["none", "auto", "required"]}, {
    "type": "object", "required": ["type", "function"], "properties": {
        "type": {"const": "function"}, "function": {
            "type": "object", "required": ["name"], "properties": {"name": TOOL_NAME}}}}]}

#: OpenAI's response_format
RESPONSE_FORMAT = {"anyOf": [
    {"type": "object", "required": ["type"], "properties": {
        "type": {"enum": ["text", "json_object"]}}},
    {"type": "object", "required": ["type", "json_schema"], "properties": {
        "type": {"const": "json_schema"}, "json_schema": {
            "type": "object", "required": ["name"], "properties": {
                "name": TOOL_NAME, "schema": OBJECT_SCHEMA, "strict": {"type": "boolean"}}}}}]}

#: fields that make sense only with tools (JSON Schema's dependentRequired, and draft 7's
#: `dependencies` for generators that read only that)
NEEDS_TOOLS = {"dependentRequired": {"tool_choice": ["tools"]},
               "dependencies": {"tool_choice": ["tools"]}}

#: OpenAI's logit_bias: token id (as a string) → a bias in [-100, 100]
LOGIT_BIAS = {"type": "object", "propertyNames": {"pattern": "^[0-9]{1,5}$"},
              "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}}
