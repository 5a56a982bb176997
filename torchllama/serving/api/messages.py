"""`POST /v1/messages` and `/v1/messages/count_tokens`: Anthropic's Messages API over the one
request path, so that Anthropic-API clients (the `anthropic` SDK, Claude Code and other agents)
run on the served model.

The request becomes chat messages for the model's template: `system` (a string or text
blocks) as the system message; `text` blocks as text; an assistant's `tool_use` blocks as its
tool calls (`input` as JSON); a user's `tool_result` blocks as tool results (before the
user's own text, as Anthropic orders them); `thinking` blocks given back are dropped (a
thinking template drops earlier turns' reasoning). `tools` (`input_schema`), `tool_choice`
(`auto`, `any`, `tool` with its name, `none`; `disable_parallel_tool_use`), a tool's `strict`,
`stop_sequences`, `max_tokens` (required), `output_config.format` (a JSON schema the answer
follows), `temperature` (0–1), `top_p`, `top_k` (which Anthropic's current SDK sends only
through `extra_body`), and the chat API's `grammar` and `regex` extensions; `thinking` of type
"disabled" sets a thinking template's `enable_thinking` false, any other type true.

The answer's `content`: a `thinking` block (a thinking template's reasoning; its `signature`
empty: nothing is signed here), a `text` block (unless the answer is only tool calls), then one
`tool_use` block per call (`input` the parsed arguments; `{}` for a call cut by max_tokens).
`stop_reason`: "end_turn", "max_tokens", "stop_sequence" (with `stop_sequence`) or "tool_use".
`usage`: `input_tokens` (those not from the prefix cache), `cache_read_input_tokens` (those
that were), `output_tokens`.

Streaming sends Anthropic's events — `message_start`, `ping`, per block
`content_block_start`, `content_block_delta` (`text_delta`, `thinking_delta`,
`input_json_delta`) … `content_block_stop`, then `message_delta` (stop reason, output tokens)
and `message_stop` — from the same parser events as a whole answer (streamed = whole). Errors
have Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`, in a stream too.

Not supported (400 naming the field): images and documents, server tools (web search, code
execution…), a final assistant message to continue ("prefill").

Source: Anthropic's API reference, "Messages" (create, count tokens, streaming messages).
"""

from __future__ import annotations

import contextlib
import json
from typing import Annotated, Any, AsyncIterator, Optional, Union

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field

from torchllama.serving.api.core import (APIError, Choice, Generation, Output, Run, Service,
                                         one_constraint, response_format_constraint, sampling,
                                         stop_strings)
from torchllama.serving.api.schemas import (ANTHROPIC_MESSAGES, ANTHROPIC_TOOL_CHOICE,
                                            ANTHROPIC_TOOLS, described)
from torchllama.serving.tools import ToolCall, ToolError, Tools, tools_of

#: Anthropic's error `type` by HTTP status
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}


def error_response(status: int, message: str, param: Optional[str] = None,
                   kind: Optional[str] = None, headers: Optional[dict] = None) -> JSONResponse:
    """Anthropic's error body: {"type": "error", "error": {"type", "message"}} (the field is
    named in the message)."""
    return JSONResponse(status_code=status, headers=headers, content=_error(status, message))


def _error(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"),
                                       "message": message}}


class MessagesBody(BaseModel):
    """Anthropic's /v1/messages body (fields that change nothing here, e.g. `service_tier`,
    are accepted and ignored)."""
    model: Optional[str] = None
    max_tokens: int = Field(ge=1)
    messages: Annotated[list[dict[str, Any]], described(ANTHROPIC_MESSAGES)] = \
        Field(min_length=1)
    system: Optional[Union[str, list[dict[str, Any]]]] = None
    stop_sequences: Optional[list[str]] = None
    temperature: Optional[float] = Field(None, ge=0.0, le=1.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(None, ge=0)
    stream: bool = False
    tools: Annotated[Optional[list[dict[str, Any]]], described(ANTHROPIC_TOOLS)] = None
    tool_choice: Annotated[Optional[dict[str, Any]], described(ANTHROPIC_TOOL_CHOICE)] = None
    metadata: Optional[dict[str, Any]] = None
    thinking: Optional[dict[str, Any]] = None
    output_config: Optional[dict[str, Any]] = None
    # extensions (the chat API's)
    grammar: Optional[str] = None
    regex: Optional[str] = None


class CountTokensBody(BaseModel):
    """Anthropic's /v1/messages/count_tokens body."""
    model: Optional[str] = None
    messages: Annotated[list[dict[str, Any]], described(ANTHROPIC_MESSAGES)] = \
        Field(min_length=1)
    system: Optional[Union[str, list[dict[str, Any]]]] = None
    tools: Annotated[Optional[list[dict[str, Any]]], described(ANTHROPIC_TOOLS)] = None
    tool_choice: Annotated[Optional[dict[str, Any]], described(ANTHROPIC_TOOL_CHOICE)] = None
    thinking: Optional[dict[str, Any]] = None


# --------------------------------------------------------------------------------------------
# The request: blocks → chat messages, fields → Generation
# --------------------------------------------------------------------------------------------

def _text(content: Any, where: str) -> str:
    """A string, or text blocks joined.

    Raises:
        APIError: 400 for a block that is not text.
    """
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}: a string or a list of text blocks is required", where)
    for j, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text" or \
                not isinstance(block.get("text"), str):
            raise APIError(400, f"{where}.{j}: only text blocks are supported here", where)
    return "".join(block["text"] for block in content)


def _turn(role: str, content: Any, where: str) -> list[dict]:
    """The chat messages of one Anthropic message."""
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise APIError(400, f"{where}: a string or a list of content blocks is required", where)
    texts, calls, results = [], [], []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        at = f"{where}.{j}"
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            calls.append({"id": block.get("id"), "type": "function", "function": {
                "name": block.get("name"),
                "arguments": json.dumps(block.get("input") or {}, ensure_ascii=False)}})
        elif kind == "tool_result" and role == "user":
            text = _text(block.get("content") or "", f"{at}.content")
            results.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                            "content": f"Error: {text}" if block.get("is_error") else text})
        elif kind not in ("thinking", "redacted_thinking") or role != "assistant":
            raise APIError(400, f"{at}.type: {kind!r} blocks are not supported in a {role} "
                                "message here (text, tool_use, tool_result, thinking are)",
                           f"{at}.type")
    if role == "assistant":
        message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
        if calls:
            message["tool_calls"] = calls
        return [message]
    return results + ([{"role": "user", "content": "".join(texts)}] if texts or not results
                      else [])


def messages_of(body: Union[MessagesBody, CountTokensBody]) -> list[dict]:
    """The body's system prompt and messages as chat messages (OpenAI chat's, as dicts).

    Raises:
        APIError: 400 naming the field: an unknown role, an unsupported block, a final
            assistant message.
    """
    out = []
    if body.system:
        out.append({"role": "system", "content": _text(body.system, "system")})
    for i, m in enumerate(body.messages):
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise APIError(400, f"messages.{i}.role: user or assistant, got {role!r}",
                           f"messages.{i}.role")
        out += _turn(role, m.get("content"), f"messages.{i}.content")
    if body.messages[-1].get("role") == "assistant":
        raise APIError(400, "messages: the last message must be the user's (continuing an "
                            "assistant message is not supported)", "messages")
    return out


def tools_from(body: Union[MessagesBody, CountTokensBody]) -> Optional[Tools]:
    """The body's tools and tool_choice as `Tools` (None without tools, or with "none").

    Raises:
        APIError: 400 naming the field: a server tool, an unknown tool_choice or tool name.
    """
    tools = []
    for i, tool in enumerate(body.tools or []):
        if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise APIError(400, f"tools.{i}.type: only client tools (name, input_schema) are "
                                f"supported, got {kind!r}", f"tools.{i}.type")
        tools.append({"type": "function", "function": {
            "name": tool.get("name"), "description": tool.get("description", ""),
            "parameters": tool.get("input_schema", {"type": "object", "properties": {}}),
            "strict": bool(tool.get("strict"))}})
    choice = body.tool_choice or {"type": "auto"}
    kind = choice.get("type")
    chat_choice = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
    if kind == "tool":
        chat_choice = {"type": "function", "function": {"name": choice.get("name")}}
    if chat_choice is None:
        raise APIError(400, f"tool_choice.type: auto, any, tool or none, got {kind!r}",
                       "tool_choice")
    try:
        found = tools_of(tools or None, chat_choice if tools else None,
                         not choice.get("disable_parallel_tool_use", False))
    except ToolError as e:
        param = e.param.replace("[", ".").replace("]", "").replace(".function", "")
        message = str(e).replace(".function.parameters", ".input_schema")
        raise APIError(400, message, param.replace(".parameters", ".input_schema")) from None
    return found if found is not None and found.active else None


def _prompt(body: Union[MessagesBody, CountTokensBody], service: Service,
            tools: Optional[Tools]) -> list[int]:
    variables = None
    if body.thinking is not None and body.thinking.get("type"):
        variables = {"enable_thinking": body.thinking["type"] != "disabled"}
    return service.encode_chat(messages_of(body), tools, variables, "messages")


def generation(body: MessagesBody, service: Service) -> Generation:
    """The request in the engine's terms.

    Raises:
        APIError: 400 naming the field.
    """
    tools = tools_from(body)
    fmt = (body.output_config or {}).get("format")
    constraint = one_constraint(response_format_constraint(fmt, "output_config.format",
                                                           flat=True), body,
                                "output_config.format")
    if tools is not None and constraint is not None:
        raise APIError(400, "output_config.format: not together with tools", "output_config")
    return Generation(
        [_prompt(body, service, tools)],
        sampling(temperature=1.0 if body.temperature is None else body.temperature,
                 top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0),
        body.max_tokens, stop=stop_strings(body.stop_sequences, "stop_sequences", most=None),
        constraint=constraint, tools=tools, chat=True, model=body.model, endpoint="messages",
        prompt_param="messages", constraint_param="output_config.format",
        tool_param="tools.{i}.input_schema")


async def create(body: MessagesBody, http: HTTPRequest):
    """POST /v1/messages: the message object, or a stream of Anthropic's events."""
    service: Service = http.app.state.service
    run = await service.start(generation(body, service), "msg_")
    if not body.stream:
        return whole(run, (await run.whole(http))[0])
    return StreamingResponse(stream(run), media_type="text/event-stream")


async def count_tokens(body: CountTokensBody, http: HTTPRequest) -> dict:
    """POST /v1/messages/count_tokens: the prompt's tokens, as /v1/messages would make it."""
    service: Service = http.app.state.service
    return {"input_tokens": len(_prompt(body, service, tools_from(body)))}


# --------------------------------------------------------------------------------------------
# The answer
# --------------------------------------------------------------------------------------------

def _tool_use_id(call: ToolCall) -> str:
    return "toolu_" + call.id.removeprefix("call_")


def _input(call: ToolCall) -> dict:
    """A call's arguments as an object ({} for a call cut short)."""
    try:
        value = json.loads(call.arguments) if call.complete else {}
    except ValueError:
        value = {}
    return value if isinstance(value, dict) else {}


def _stop(choice: Choice) -> tuple[str, Optional[str]]:
    """(stop_reason, stop_sequence) of a finished choice."""
    if choice.finish_reason == "tool_calls":
        return "tool_use", None
    if choice.finish_reason == "length":
        return "max_tokens", None
    matched = choice.stop_matched
    return ("stop_sequence", matched) if matched is not None else ("end_turn", None)


def _usage(run: Run) -> dict:
    cached = run.cached_tokens
    return {"input_tokens": run.prompt_tokens - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": run.completion_tokens}


def whole(run: Run, out: Output) -> dict:
    """The message object."""
    content: list[dict] = []
    if out.reasoning:
        content.append({"type": "thinking", "thinking": out.reasoning, "signature": ""})
    if out.content or not out.calls:
        content.append({"type": "text", "text": out.content})
    content += [{"type": "tool_use", "id": _tool_use_id(c), "name": c.name, "input": _input(c)}
                for c in out.calls]
    reason, sequence = _stop(run.choices[0])
    return {"id": run.rid, "type": "message", "role": "assistant", "model": run.model,
            "content": content, "stop_reason": reason, "stop_sequence": sequence,
            "usage": _usage(run)}


def _sse(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


class _Blocks:
    """The stream's content blocks, started and stopped as the parsers' events arrive: a new
    kind of event stops the block before it. Yields the events (dicts)."""

    def __init__(self, choice: Choice):
        self.choice = choice
        self.count = 0                       # blocks started
        self.open: Optional[str] = None      # the open block's kind
        self.texts = 0                       # text and tool_use blocks started

    def feed(self, events: list[tuple]) -> list[dict]:
        out = []
        for event in events:
            kind = event[0]
            if kind in ("reasoning", "content"):
                block = "thinking" if kind == "reasoning" else "text"
                out += self._start(block, {"type": "thinking", "thinking": "", "signature": ""}
                                   if block == "thinking" else {"type": "text", "text": ""})
                delta = {"type": "thinking_delta", "thinking": event[1]} \
                    if block == "thinking" else {"type": "text_delta", "text": event[1]}
                out.append({"type": "content_block_delta", "index": self.count - 1,
                            "delta": delta})
            elif kind == "call":
                call = self.choice.parser.calls[event[1]]
                out += self._start("tool_use", {"type": "tool_use", "id": _tool_use_id(call),
                                                "name": call.name, "input": {}}, new=True)
            else:
                out.append({"type": "content_block_delta", "index": self.count - 1,
                            "delta": {"type": "input_json_delta", "partial_json": event[2]}})
        return out

    def finish(self) -> list[dict]:
        """Stop the last block; an answer with neither text nor calls gets an empty text
        block."""
        out = self._stop()
        if not self.texts:
            out += self._start("text", {"type": "text", "text": ""}) + self._stop()
        return out

    def _start(self, kind: str, block: dict, new: bool = False) -> list[dict]:
        if self.open == kind and not new:
            return []
        out = self._stop()
        self.open = kind
        self.texts += kind != "thinking"
        self.count += 1
        return out + [{"type": "content_block_start", "index": self.count - 1,
                       "content_block": block}]

    def _stop(self) -> list[dict]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": self.count - 1}]


async def stream(run: Run) -> AsyncIterator[str]:
    """Anthropic's streaming events of the answer (see the module docstring)."""
    choice = run.choices[0]
    start = {"id": run.rid, "type": "message", "role": "assistant", "model": run.model,
             "content": [], "stop_reason": None, "stop_sequence": None,
             "usage": {**_usage(run), "output_tokens": 0}}
    yield _sse({"type": "message_start", "message": start})
    yield _sse({"type": "ping"})
    blocks = _Blocks(choice)
    async with contextlib.aclosing(run.updates()) as updates:
        async for _, update in updates:
            if update.final and choice.error is not None:
                yield _sse(_error(choice.error.status, choice.error.message))
                return
            events = update.events if update.events is not None else \
                ([("content", update.text)] if update.text else [])
            for event in blocks.feed(events):
                yield _sse(event)
            if update.final:
                for event in blocks.finish():
                    yield _sse(event)
    reason, sequence = _stop(choice)
    yield _sse({"type": "message_delta", "delta": {"stop_reason": reason,
                                                   "stop_sequence": sequence},
                "usage": _usage(run)})           # (cumulative: the cache reads known now)
    yield _sse({"type": "message_stop"})
