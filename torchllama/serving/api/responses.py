"""`/v1/responses`: OpenAI's Responses API (what OpenAI's SDKs and the Agents SDK use by
default) over the one request path.

    POST   /v1/responses          input (a string or items) → a response, or its event stream
    GET    /v1/responses/{id}     a stored response
    DELETE /v1/responses/{id}     forget it

The request becomes chat messages for the model's template: `instructions` as the system
message, input items — messages (text parts), `function_call` (an assistant turn's tool call),
`function_call_output` (a tool result) — in order; reasoning items given back are dropped (as
a thinking template drops earlier turns' reasoning). Function tools, `tool_choice`,
`parallel_tool_calls` and `text.format` (json_schema, json_object) work as in chat
completions. The answer's `output` items: `reasoning` (a thinking template's), a `message`
with one `output_text` part (the text before any call; present unless the answer is only
calls), then one `function_call` per call. `status` is "completed", or "incomplete" with
`incomplete_details.reason` "max_output_tokens".

Streaming sends the documented events — `response.created`, `response.in_progress`, per item
`response.output_item.added`, (`response.content_part.added`, `response.output_text.delta`…
`.done`, `response.content_part.done`) or (`response.function_call_arguments.delta`… `.done`),
`response.output_item.done`, then `response.completed` (or `.incomplete`, or `error` and
`response.failed`) — each with a `sequence_number`. Items are built from the same parser
events as a whole answer, so the streamed response equals the whole one.

`store` (default true, as OpenAI's): the response is kept **in memory**, at most
`--responses-store` of them, least recently used out first; nothing survives a restart.
`previous_response_id` continues a stored response: its conversation (input and output items)
comes before the new input (its `instructions` do not carry over, as OpenAI's), and the
prompt's shared prefix is reused from the block prefix cache.

Not supported (400 naming the field): built-in tools (web search, file search, computer use…),
`background`, `conversation`, reusable `prompt`s, `item_reference` items, images and files.
Extensions, as the chat API's: `stop`, `seed`, `top_k`, `grammar`, `regex`,
`chat_template_kwargs`.

Source: OpenAI's API reference, "Responses" (create, retrieve, delete; the response object; the
streaming events).
"""

from __future__ import annotations

import collections
import contextlib
import json
import time
import uuid
from typing import Annotated, Any, AsyncIterator, Optional, Union

from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from torchllama.serving.api.core import (APIError, Choice, Generation, Output, Run, Service,
                                         chat_token, one_constraint,
                                         response_format_constraint, sampling, stop_strings)
from torchllama.serving.api.schemas import (NEEDS_TOOLS, RESPONSES_INPUT, RESPONSES_TOOLS,
                                            described)
from torchllama.serving.tools import ToolCall, ToolError, tools_of

#: responses kept for previous_response_id and GET by default (`serve --responses-store`)
DEFAULT_STORE_SIZE = 1000


class ResponsesBody(BaseModel):
    """OpenAI's /v1/responses request body (fields it lists that change nothing here, e.g.
    `service_tier`, are accepted and ignored)."""
    model_config = ConfigDict(json_schema_extra=NEEDS_TOOLS)
    model: Optional[str] = None
    input: Annotated[Union[str, list[dict[str, Any]]], described(RESPONSES_INPUT)]
    instructions: Optional[str] = None
    tools: Annotated[Optional[list[dict[str, Any]]], described(RESPONSES_TOOLS)] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[dict[str, Any]] = None
    max_output_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    include: Optional[list[str]] = None
    stream: bool = False
    store: bool = True
    previous_response_id: Optional[str] = None
    metadata: Optional[dict[str, str]] = None
    reasoning: Optional[dict[str, Any]] = None
    truncation: Optional[str] = None
    user: Optional[str] = None
    background: Optional[bool] = None
    conversation: Optional[Any] = None
    prompt: Optional[Any] = None
    # extensions (the chat API's)
    grammar: Optional[str] = None
    regex: Optional[str] = None
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    top_k: int = Field(0, ge=0)
    chat_template_kwargs: Optional[dict[str, Any]] = None


class Store:
    """Stored responses, in memory, least recently used out first.

    Args:
        size: responses kept at most (0: none).
    """

    def __init__(self, size: int = DEFAULT_STORE_SIZE):
        self.size = size
        self.entries: collections.OrderedDict[str, tuple[dict, list[dict]]] = \
            collections.OrderedDict()

    def put(self, response: dict, conversation: list[dict]) -> None:
        """Keep a response and the conversation it answered (its input items, previous
        responses' included)."""
        if self.size <= 0:
            return
        self.entries[response["id"]] = (response, conversation)
        self.entries.move_to_end(response["id"])
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)

    def get(self, rid: str, param: Optional[str] = None) -> tuple[dict, list[dict]]:
        """(the response, its conversation).

        Raises:
            APIError: 404 for an id not stored (never, forgotten or deleted).
        """
        if rid not in self.entries:
            raise APIError(404, f"{param + ': ' if param else ''}no stored response has id "
                           f"{rid!r} (responses are kept in memory, the last "
                           f"{self.size} at most)", param, "not_found_error")
        self.entries.move_to_end(rid)
        return self.entries[rid]

    def delete(self, rid: str) -> None:
        self.get(rid)
        del self.entries[rid]


# --------------------------------------------------------------------------------------------
# The request: items → chat messages, fields → Generation
# --------------------------------------------------------------------------------------------

def _text_of(content: Any, where: str) -> str:
    """A message's or a tool output's text: a string, or its text parts joined.

    Raises:
        APIError: 400 for an image, a file or another part that is not text.
    """
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}: a string or a list of text parts is required", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text", "refusal") or \
                not isinstance(part.get("text", part.get("refusal")), str):
            raise APIError(400, f"{where}[{j}]: only text parts are supported, got "
                                f"{kind!r}", where)
        texts.append(part.get("text", part.get("refusal")))
    return "".join(texts)


def messages_of(items: list[dict]) -> list[dict]:
    """Chat messages (OpenAI chat's, as dicts) of Responses input items: an assistant
    message and the function calls after it are one assistant turn.

    Raises:
        APIError: 400 (param input[i]) for an item of an unsupported or unknown type.
    """
    out: list[dict] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(400, f"{where}.role: user, system, developer or assistant, got "
                                    f"{role!r}", f"{where}.role")
            out.append({"role": "system" if role == "developer" else role,
                        "content": _text_of(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"),
                                 "arguments": item.get("arguments") or "{}"}}
            if not isinstance(call["function"]["name"], str):
                raise APIError(400, f"{where}.name is required", f"{where}.name")
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": _text_of(item.get("output"), f"{where}.output")})
        elif kind != "reasoning":
            raise APIError(400, f"{where}.type: message, function_call, function_call_output "
                                f"or reasoning items are supported, got {kind!r}",
                           f"{where}.type")
    return out


def _chat_tools(body: ResponsesBody) -> tuple[Optional[list], Any]:
    """The body's tools and tool_choice in the chat API's shape.

    Raises:
        APIError: 400 (tools[i].type) for a built-in tool.
    """
    tools = []
    for i, tool in enumerate(body.tools or []):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise APIError(400, f"tools[{i}].type: only function tools are supported, got "
                                f"{kind!r}", f"tools[{i}].type")
        tools.append({"type": "function", "function": {
            k: v for k, v in tool.items() if k in ("name", "description", "parameters",
                                                    "strict")}})
    choice = body.tool_choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    return tools or None, choice


def _refuse_unsupported(body: ResponsesBody) -> None:
    for name in ("background", "conversation", "prompt"):
        if getattr(body, name):
            raise APIError(400, f"{name}: not supported by this server", name)
    if body.metadata is not None and (len(body.metadata) > 16 or any(
            len(k) > 64 or len(v) > 512 for k, v in body.metadata.items())):
        raise APIError(400, "metadata: at most 16 keys of up to 64 characters, values of up "
                            "to 512", "metadata")


def generation(body: ResponsesBody, service: Service,
               conversation: list[dict]) -> Generation:
    """The request in the engine's terms; `conversation` is every input item (a previous
    response's first).

    Raises:
        APIError: 400 naming the field.
    """
    _refuse_unsupported(body)
    chat_tools, choice = _chat_tools(body)
    try:
        tools = tools_of(chat_tools, choice, body.parallel_tool_calls)
    except ToolError as e:
        param = e.param.replace(".function", "")
        raise APIError(400, str(e).replace(".function", ""), param) from None
    if tools is not None and not tools.active:
        tools = None
    constraint = one_constraint(response_format_constraint(
        (body.text or {}).get("format"), "text.format", flat=True), body, "text.format")
    if tools is not None and constraint is not None:
        raise APIError(400, "tools: give either tools or one of text.format (JSON), grammar "
                            "and regex", "tools")
    messages = messages_of(conversation)
    if body.instructions:
        messages.insert(0, {"role": "system", "content": body.instructions})
    if not messages:
        raise APIError(400, "input: no messages", "input")
    prompt = service.encode_chat(messages, tools, body.chat_template_kwargs, "input")
    logprobs = body.top_logprobs or 0 \
        if "message.output_text.logprobs" in (body.include or []) else None
    return Generation(
        [prompt], sampling(temperature=1.0 if body.temperature is None else body.temperature,
                           top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k,
                           seed=body.seed),
        body.max_output_tokens, stop=stop_strings(body.stop), logprobs=logprobs,
        constraint=constraint, tools=tools, chat=True, model=body.model, endpoint="responses",
        prompt_param="input", constraint_param="text.format",
        tool_param="tools[{i}].parameters")


def _input_items(body: ResponsesBody) -> list[dict]:
    if isinstance(body.input, str):
        return [{"type": "message", "role": "user", "content": body.input}]
    return list(body.input)


async def create(body: ResponsesBody, http: HTTPRequest):
    """POST /v1/responses: the response object, or a stream of its events."""
    service: Service = http.app.state.service
    store: Store = http.app.state.responses
    conversation = _input_items(body)
    if body.previous_response_id is not None:
        previous, before = store.get(body.previous_response_id, "previous_response_id")
        conversation = before + previous["output"] + conversation
    gen = generation(body, service, conversation)
    run = await service.start(gen, "resp_")
    view = _View(body, run, service, gen.tools.parallel if gen.tools is not None
                 else body.parallel_tool_calls is not False)
    if not body.stream:
        response = view.response("completed", _output_items(
            run.choices[0], (await run.whole(http))[0], view.logprobs))
        if body.store:
            store.put(response, conversation)
        return response
    return StreamingResponse(_events(view, store, conversation),
                             media_type="text/event-stream")


async def retrieve(response_id: str, http: HTTPRequest) -> dict:
    """GET /v1/responses/{response_id} (404: not stored)."""
    return http.app.state.responses.get(response_id)[0]


async def delete(response_id: str, http: HTTPRequest) -> dict:
    """DELETE /v1/responses/{response_id} (404: not stored)."""
    http.app.state.responses.delete(response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}


# --------------------------------------------------------------------------------------------
# The answer
# --------------------------------------------------------------------------------------------

def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def reasoning_item(rid: str, text: str, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": rid, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def message_item(mid: str, text: Optional[str], status: str = "completed",
                 logprobs: Optional[list] = None) -> dict:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [],
                                        "logprobs": logprobs or []}]
    return {"type": "message", "id": mid, "status": status, "role": "assistant",
            "content": content}


def call_item(fid: str, call: ToolCall, status: str = "completed") -> dict:
    return {"type": "function_call", "id": fid, "call_id": call.id, "name": call.name,
            "arguments": call.arguments, "status": status}


def _output_items(choice: Choice, out: Output, logprobs: bool) -> list[dict]:
    """The output items of a whole answer: reasoning, the message (unless only calls), the
    calls (the last one "incomplete" if max_output_tokens cut it)."""
    items = []
    if out.reasoning:
        items.append(reasoning_item(_item_id("rs"), out.reasoning))
    if out.content or not out.calls:
        tokens = [chat_token(choice, e) for e in choice.token_events] if logprobs else None
        items.append(message_item(_item_id("msg"), out.content, "completed", tokens))
    for call in out.calls:
        items.append(call_item(_item_id("fc"), call,
                               "completed" if call.complete else "incomplete"))
    return items


class _View:
    """What a response object says besides its output: the request's settings, its status,
    its usage."""

    def __init__(self, body: ResponsesBody, run: Run, service: Service, parallel: bool):
        self.body, self.run, self.service, self.parallel = body, run, service, parallel
        self.created = int(time.time())
        self.logprobs = "message.output_text.logprobs" in (body.include or [])

    def response(self, status: str, output: list[dict],
                 error: Optional[dict] = None) -> dict:
        """The response object (status "completed" becomes "incomplete" when the answer ran
        out of tokens)."""
        body, run = self.body, self.run
        choice = run.choices[0]
        incomplete = None
        if status == "completed" and choice.finish_reason == "length":
            status, incomplete = "incomplete", {"reason": "max_output_tokens"}
        return {
            "id": run.rid, "object": "response", "created_at": self.created, "status": status,
            "background": False, "error": error, "incomplete_details": incomplete,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "model": run.model, "output": output,
            "parallel_tool_calls": self.parallel,
            "previous_response_id": body.previous_response_id,
            "reasoning": body.reasoning or {"effort": None, "summary": None},
            "store": body.store, "temperature": 1.0 if body.temperature is None
            else body.temperature, "text": body.text or {"format": {"type": "text"}},
            "tool_choice": body.tool_choice or "auto", "tools": body.tools or [],
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "top_logprobs": body.top_logprobs, "truncation": body.truncation or "disabled",
            "usage": self.usage(output) if status != "in_progress" else None,
            "user": body.user, "metadata": body.metadata or {}}

    def usage(self, output: list[dict]) -> dict:
        """Token counts: input (of which from the prefix cache), output (of which reasoning,
        re-tokenized from its text)."""
        run = self.run
        reasoning = sum(len(self.service.tokenizer.encode(c["text"])) for item in output
                        if item["type"] == "reasoning" for c in item["content"])
        out = run.completion_tokens
        return {"input_tokens": run.prompt_tokens,
                "input_tokens_details": {"cached_tokens": run.cached_tokens},
                "output_tokens": out, "output_tokens_details": {"reasoning_tokens": reasoning},
                "total_tokens": run.prompt_tokens + out}


class _Items:
    """The stream's output items, opened and closed as the parsers' events arrive: a new kind
    of event closes the item before it. Yields the events' dicts (without sequence numbers)."""

    def __init__(self, choice: Choice, logprobs: bool):
        self.choice, self.logprobs = choice, logprobs
        self.items: list[dict] = []                 # closed and open, in output order
        self.open: Optional[dict] = None
        self.calls: dict[int, int] = {}            # call index → output index
        self.tokens: list[dict] = []               # the message's token log-probabilities

    def feed(self, events: list[tuple], token) -> list[dict]:
        out = []
        if self.logprobs and token is not None:
            self.tokens.append(chat_token(self.choice, token))
        for event in events:
            kind = event[0]
            if kind == "reasoning":
                out += self._ensure("reasoning") + self._text_delta("reasoning_text", event[1])
            elif kind == "content":
                out += self._ensure("message") + self._text_delta("output_text", event[1])
            elif kind == "call":
                out += self._close()
                call = self.choice.parser.calls[event[1]]
                self.calls[event[1]] = len(self.items)
                item = call_item(_item_id("fc"), call, "in_progress")
                item["arguments"] = ""             # (the parser's may be ahead of its events)
                out += self._add(item)
            else:
                item = self.items[self.calls[event[1]]]
                item["arguments"] += event[2]
                out.append({"type": "response.function_call_arguments.delta",
                            "item_id": item["id"], "output_index": self.calls[event[1]],
                            "delta": event[2]})
        return out

    def finish(self) -> list[dict]:
        """Close the last item; an answer with neither text nor calls gets an empty
        message."""
        out = self._close()
        if not any(i["type"] in ("message", "function_call") for i in self.items):
            out += self._ensure("message") + self._close()
        return out

    def _add(self, item: dict) -> list[dict]:
        self.items.append(item)
        self.open = item
        return [{"type": "response.output_item.added", "output_index": len(self.items) - 1,
                 "item": json.loads(json.dumps(item))}]

    def _ensure(self, kind: str) -> list[dict]:
        if self.open is not None and self.open["type"] == kind:
            return []
        out = self._close()
        if kind == "reasoning":
            item = reasoning_item(_item_id("rs"), "", "in_progress")
        else:
            item = message_item(_item_id("msg"), "", "in_progress")
        part = item["content"][0]
        item["content"] = []
        out += self._add(item)
        item["content"].append(part)
        out.append({"type": "response.content_part.added", "item_id": item["id"],
                    "output_index": len(self.items) - 1, "content_index": 0,
                    "part": dict(part)})
        return out

    def _text_delta(self, part_type: str, text: str) -> list[dict]:
        item = self.open
        item["content"][0]["text"] += text
        kind = "output_text" if part_type == "output_text" else "reasoning_text"
        event = {"type": f"response.{kind}.delta", "item_id": item["id"],
                 "output_index": len(self.items) - 1, "content_index": 0, "delta": text}
        if kind == "output_text":
            event["logprobs"] = []
        return [event]

    def _close(self) -> list[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = self.items.index(item)
        out = []
        if item["type"] == "function_call":
            call = self.choice.parser.calls[[k for k, v in self.calls.items()
                                             if v == index][0]]
            item["status"] = "completed" if call.complete else "incomplete"
            out.append({"type": "response.function_call_arguments.done", "item_id": item["id"],
                        "output_index": index, "arguments": item["arguments"],
                        "name": item["name"]})
        else:
            item["status"] = "completed"
            part = item["content"][0]
            kind = part["type"]
            if kind == "output_text" and self.logprobs:
                part["logprobs"] = self.tokens
            done = {"type": f"response.{kind}.done", "item_id": item["id"],
                    "output_index": index, "content_index": 0, "text": part["text"]}
            if kind == "output_text":
                done["logprobs"] = part["logprobs"]
            out += [done, {"type": "response.content_part.done", "item_id": item["id"],
                           "output_index": index, "content_index": 0, "part": dict(part)}]
        out.append({"type": "response.output_item.done", "output_index": index,
                    "item": json.loads(json.dumps(item))})
        return out


async def _events(view: _View, store: Store, conversation: list[dict]) -> AsyncIterator[str]:
    """The response's server-sent events (see the module docstring)."""
    sequence = 0

    def sse(event: dict) -> str:
        nonlocal sequence
        event["sequence_number"] = sequence
        sequence += 1
        return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"

    start = view.response("in_progress", [])
    yield sse({"type": "response.created", "response": start})
    yield sse({"type": "response.in_progress", "response": start})
    choice = view.run.choices[0]
    items = _Items(choice, view.logprobs)
    async with contextlib.aclosing(view.run.updates()) as updates:
        async for _, update in updates:
            if update.final and choice.error is not None:
                error = {"code": "server_error", "message": choice.error.message}
                yield sse({"type": "error", "code": "server_error",
                           "message": choice.error.message, "param": None})
                yield sse({"type": "response.failed",
                           "response": view.response("failed", items.items, error)})
                return
            events = update.events if update.events is not None else \
                ([("content", update.text)] if update.text else [])
            for event in items.feed(events, update.event):
                yield sse(event)
            if update.final:
                for event in items.finish():
                    yield sse(event)
    response = view.response("completed", items.items)
    if view.body.store:
        store.put(response, conversation)
    kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
    yield sse({"type": kind, "response": response})
