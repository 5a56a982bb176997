"""`POST /v1/chat/completions`: OpenAI's Chat Completions API over the one request path.

The body's messages go through the model's chat template (tools offered as
`torchllama.serving.tools` describes), its fields become a `Generation`; the answer is the
choices' `Output`s (whole) or chunks of their `Update`s (stream: `data: {...}` events ending
with `data: [DONE]`): content, `reasoning_content` (thinking templates, as vLLM and DeepSeek
send it), and `tool_calls` deltas (a call's id, type and name, then its arguments piece by
piece). Log-probabilities in OpenAI's chat format.

Source: OpenAI's API reference, "Chat Completions" (request body, the chat completion object
and its chunk object).
"""

from __future__ import annotations

import contextlib
from typing import Annotated, Any, AsyncIterator, Literal, Optional, Union

from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from torchllama.serving.api.core import (APIError, Choice, Generation, Output, Run, SamplingBody,
                                         Service, Update, body_constraint, body_sampling,
                                         chat_token, openai_chunk, openai_error_event,
                                         stop_strings)
from torchllama.serving.api.schemas import (CHAT_MESSAGES, CHAT_TOOL_CHOICE, CHAT_TOOLS,
                                            NEEDS_TOOLS, described)
from torchllama.serving.tools import ToolError, tools_of

#: the object of a streamed answer's chunks
KIND = "chat.completion.chunk"


class FunctionCall(BaseModel):
    name: str
    arguments: str = "{}"                        # JSON text, as OpenAI sends it


class ToolCallBody(BaseModel):
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """One message: its content a string, a list of text parts, or None (an assistant turn of
    tool calls); tool_calls on an assistant turn, tool_call_id on a tool result."""
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[dict[str, Any]]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCallBody]] = None
    tool_call_id: Optional[str] = None


class ChatBody(SamplingBody):
    model_config = ConfigDict(json_schema_extra=NEEDS_TOOLS)
    messages: Annotated[list[ChatMessage], described(CHAT_MESSAGES)] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    tools: Annotated[Optional[list[dict[str, Any]]], described(CHAT_TOOLS)] = None
    tool_choice: Annotated[Optional[Union[str, dict[str, Any]]],
                           described(CHAT_TOOL_CHOICE)] = None
    parallel_tool_calls: Optional[bool] = None
    # extension (vLLM's): more variables for the chat template, e.g. {"enable_thinking": false}
    chat_template_kwargs: Optional[dict[str, Any]] = None


def message_dicts(messages: list[ChatMessage]) -> list[dict]:
    """The messages as dicts for the chat template: content a string (text parts joined),
    "developer" as "system", tool_calls and tool_call_id kept.

    Raises:
        APIError: 400 (param messages[i].content) for a part that is not text, or no content
            on a turn that is not an assistant's tool calls.
    """
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            if any(not isinstance(p, dict) or p.get("type") != "text" or
                   not isinstance(p.get("text"), str) for p in content):
                raise APIError(400, f"messages[{i}].content: only text parts "
                                    '({"type": "text", "text": ...}) are supported',
                               f"messages[{i}].content")
            content = "".join(p["text"] for p in content)
        if content is None and not (m.role == "assistant" and m.tool_calls):
            raise APIError(400, f"messages[{i}].content is required", f"messages[{i}].content")
        entry: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                                 "content": content}
        if m.tool_calls:
            entry["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        if m.tool_call_id is not None:
            entry["tool_call_id"] = m.tool_call_id
        if m.name is not None and m.role == "tool":
            entry["name"] = m.name
        out.append(entry)
    return out


def generation(body: ChatBody, service: Service) -> Generation:
    """The body in the engine's terms (the messages through the chat template).

    Raises:
        APIError: 400 naming the field: invalid tools or tool_choice, tools together with
            another output constraint, messages the chat template refuses, values out of range.
    """
    try:
        tools = tools_of(body.tools, body.tool_choice, body.parallel_tool_calls)
    except ToolError as e:
        raise APIError(400, str(e), e.param) from None
    if tools is not None and not tools.active:
        tools = None
    constraint = body_constraint(body)
    if tools is not None and constraint is not None:
        raise APIError(400, "tools: give either tools or one of response_format, grammar "
                            "and regex", "tools")
    prompt = service.encode_chat(message_dicts(body.messages), tools,
                                 body.chat_template_kwargs)
    return Generation(
        [prompt], body_sampling(body, service.tokenizer.vocab_size),
        body.max_completion_tokens or body.max_tokens, body.n, stop_strings(body.stop),
        logprobs=(body.top_logprobs or 0) if body.logprobs else None, constraint=constraint,
        tools=tools, chat=True, model=body.model, endpoint="chat", prompt_param="messages")


async def create(body: ChatBody, http: HTTPRequest):
    """POST /v1/chat/completions: the chat completion object, or a stream of its chunks."""
    service: Service = http.app.state.service
    run = await service.start(generation(body, service), "chatcmpl-")
    if not body.stream:
        return whole(run, await run.whole(http), body.logprobs)
    include_usage = bool((body.stream_options or {}).get("include_usage"))
    return StreamingResponse(stream(run, body.logprobs, include_usage),
                             media_type="text/event-stream")


# --------------------------------------------------------------------------------------------
# The answer
# --------------------------------------------------------------------------------------------

def message(out: Output) -> dict:
    """The assistant message of a parsed answer: content (None when it is only calls, as
    OpenAI's), tool_calls, reasoning_content (thinking templates)."""
    entry: dict[str, Any] = {"role": "assistant", "content": out.content}
    if out.calls:
        entry["content"] = out.content or None
        entry["tool_calls"] = [c.as_dict() for c in out.calls]
    if out.reasoning is not None:
        entry["reasoning_content"] = out.reasoning or None
    return entry


def whole(run: Run, outputs: list[Output], logprobs: bool) -> dict:
    """The chat completion object."""
    choices = []
    for choice, out in zip(run.choices, outputs):
        choices.append({"index": choice.index, "finish_reason": out.finish_reason,
                        "message": message(out),
                        "logprobs": {"content": [chat_token(choice, e)
                                                 for e in choice.token_events]}
                        if logprobs else None})
    return {"id": run.rid, "object": "chat.completion", "created": run.created,
            "model": run.model, "choices": choices, "usage": run.usage()}


async def stream(run: Run, logprobs: bool, include_usage: bool) -> AsyncIterator[str]:
    """The chunks: every choice's role first, then their deltas as they come, each choice's
    finish reason, the usage (if asked), [DONE]."""
    yield openai_chunk(run, KIND, [{"index": c.index, "finish_reason": None,
                       "delta": {"role": "assistant", "content": ""}} for c in run.choices])
    async with contextlib.aclosing(run.updates()) as updates:
        async for choice, update in updates:
            if update.final and choice.error is not None:
                yield openai_error_event(choice.error)
                return
            for payload in deltas(choice, update, logprobs):
                yield openai_chunk(run, KIND, [payload])
            if update.final:
                yield openai_chunk(run, KIND, [{"index": choice.index, "delta": {},
                                                "finish_reason": choice.finish_reason}])
    if include_usage:
        yield openai_chunk(run, KIND, [], {"usage": run.usage()})
    yield "data: [DONE]\n\n"


def deltas(choice: Choice, update: Update, logprobs: bool) -> list[dict]:
    """A choice's payloads for one update: its text (a choice without parsers), or its
    parsers' events — reasoning, content, a call's id and name (arguments ""), then its
    arguments piece by piece. The token's log-probabilities ride on the first payload (with
    an empty delta if the parsers held the text back, so that none is lost)."""
    tokens = [update.event] if update.event is not None else []
    if update.events is None:
        if update.final or not (update.text or tokens):
            return []
        payloads = [{"index": choice.index, "finish_reason": None,
                     "delta": {"content": update.text}}]
    else:
        payloads = [{"index": choice.index, "finish_reason": None, "delta": _delta(choice, e)}
                    for e in update.events]
    if logprobs and tokens:
        if not payloads:
            payloads.append({"index": choice.index, "finish_reason": None, "delta": {}})
        payloads[0]["logprobs"] = {"content": [chat_token(choice, t) for t in tokens]}
    return payloads


def _delta(choice: Choice, event: tuple) -> dict:
    if event[0] == "content":
        return {"content": event[1]}
    if event[0] == "reasoning":
        return {"reasoning_content": event[1]}
    if event[0] == "call":
        call = choice.parser.calls[event[1]]
        return {"tool_calls": [{"index": event[1], "id": call.id, "type": "function",
                                "function": {"name": call.name, "arguments": ""}}]}
    return {"tool_calls": [{"index": event[1], "function": {"arguments": event[2]}}]}
