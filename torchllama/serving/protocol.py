"""OpenAI's protocol: request bodies, errors, and the bodies and chunks of the answers.

    CompletionBody, ChatBody   the request bodies (OpenAI's fields, tools included; top_k,
                               min_p, repetition_penalty, grammar and regex are extensions)
    message_dicts              a chat body's messages for the chat template
    EmbeddingBody              /v1/embeddings (pooling is an extension)
    APIError, error_response   errors, as {"error": {"message", "type", "param", "code"}}
    constraint_of              a body's output constraint (response_format, grammar, regex)
    Reply                      one request being answered: id, kind, choices, usage
    response, chunk, delta     the whole answer, a server-sent event, one choice's new text
    parsed_deltas              a stream's reasoning_content and tool_calls deltas
                               (`torchllama.serving.reasoning`, `torchllama.serving.tools`)
    *_logprobs                 OpenAI's two log-probability formats

A choice here is anything with index, finish_reason, token_events (the engine's `TokenEvent`s)
and token_text(id) (the app's `_Choice`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

from torchllama.serving.request import TokenEvent
from torchllama.serving.reasoning import split_reasoning
from torchllama.serving.tools import ToolCallParser, Tools, parse_all

try:  # the server's own dependencies; the rest of torchllama works without them
    from fastapi.responses import JSONResponse
    from pydantic import BaseModel, Field
except ImportError as e:  # pragma: no cover - fastapi is a dependency of the package
    raise ImportError("torchllama serve needs fastapi and uvicorn: pip install fastapi uvicorn") \
        from e


# --------------------------------------------------------------------------------------------
# Request bodies (OpenAI's fields; top_k, min_p and repetition_penalty are extensions)
# --------------------------------------------------------------------------------------------

class SamplingBody(BaseModel):
    model: Optional[str] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: Optional[dict[str, float]] = None
    n: int = Field(1, ge=1, le=16)
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    stream: bool = False
    stream_options: Optional[dict[str, Any]] = None
    user: Optional[str] = None
    # structured output: OpenAI's response_format, and (extensions) a Lark/GBNF grammar or a
    # regular expression the output must match
    response_format: Optional[dict[str, Any]] = None
    grammar: Optional[str] = None
    regex: Optional[str] = None


class CompletionBody(SamplingBody):
    prompt: str
    max_tokens: Optional[int] = Field(16, ge=1)          # OpenAI's default for completions
    logprobs: Optional[int] = Field(None, ge=0, le=20)
    echo: bool = False


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
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
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


class EmbeddingBody(BaseModel):
    """OpenAI's /v1/embeddings body; `pooling` ("mean" or "last") is an extension
    (`torchllama.serving.embeddings`)."""
    model: Optional[str] = None
    input: Union[str, list[str], list[int], list[list[int]]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = None
    user: Optional[str] = None
    pooling: Literal["mean", "last"] = "mean"


class LoadAdapterBody(BaseModel):
    """vLLM's /v1/load_lora_adapter body: the name requests will use as `model`, and the PEFT
    folder (or `torchllama finetune` run)."""
    lora_name: str
    lora_path: str


class UnloadAdapterBody(BaseModel):
    """vLLM's /v1/unload_lora_adapter body."""
    lora_name: str
    lora_int_id: Optional[int] = None


class APIError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def error_response(status: int, message: str, param: Optional[str] = None,
                   kind: str = "invalid_request_error") -> JSONResponse:
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""
    return JSONResponse(status_code=status, content={
        "error": {"message": message, "type": kind, "param": param, "code": None}})



def constraint_of(body: SamplingBody) -> Optional[tuple[str, Any]]:
    """(kind, spec) of the request's output constraint for `torchllama.generation.grammar`, or None.

    Raises:
        APIError: 400 for a malformed response_format or more than one constraint.
    """
    found = []
    fmt = body.response_format
    if fmt is not None:
        kind = fmt.get("type")
        if kind == "json_object":
            found.append(("json_object", None))
        elif kind == "json_schema":
            schema = (fmt.get("json_schema") or {}).get("schema")
            if not isinstance(schema, dict):
                raise APIError(400, "response_format.json_schema.schema: a JSON schema object "
                                    "is required", "response_format")
            found.append(("json_schema", schema))
        elif kind != "text":
            raise APIError(400, "response_format.type must be text, json_object or "
                                f"json_schema, got {kind!r}", "response_format")
    if body.grammar is not None:
        found.append(("grammar", body.grammar))
    if body.regex is not None:
        found.append(("regex", body.regex))
    if len(found) > 1:
        raise APIError(400, "give one of response_format (JSON), grammar and regex",
                       "response_format")
    return found[0] if found else None


# --------------------------------------------------------------------------------------------
# Answers
# --------------------------------------------------------------------------------------------

@dataclass
class Reply:
    """One request being answered: its id, kind, model and choices."""

    rid: str
    chat: bool
    logprobs: Optional[int]
    prompt_tokens: int
    choices: list
    model: str = "torchllama"
    tools: Optional[Tools] = None            # the model's output is parsed for tool calls
    thinking: Optional[bool] = None          # split <think>…</think> (True: the prompt opened it)
    created: int = field(default_factory=lambda: int(time.time()))
    started: float = field(default_factory=time.perf_counter)

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)

    def usage(self) -> dict:
        out = self.completion_tokens
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": out,
                "total_tokens": self.prompt_tokens + out}


def response(reply: Reply, texts: list[str]) -> dict:
    """The whole answer (stream=false): every choice's text, finish reason and log-probs."""
    out = []
    for choice, text in zip(reply.choices, texts):
        entry: dict[str, Any] = {"index": choice.index, "finish_reason": choice.finish_reason}
        if reply.chat and (reply.tools is not None or reply.thinking is not None):
            entry["message"] = _parsed_message(reply, text)
            if choice.finish_reason == "stop" and entry["message"].get("tool_calls"):
                entry["finish_reason"] = "tool_calls"
            entry["logprobs"] = chat_logprobs(choice) if reply.logprobs is not None else None
        elif reply.chat:
            entry["message"] = {"role": "assistant", "content": text}
            entry["logprobs"] = chat_logprobs(choice) if reply.logprobs is not None else None
        else:
            entry["text"] = text
            entry["logprobs"] = (completion_logprobs(choice) if reply.logprobs is not None
                                 else None)
        out.append(entry)
    return {"id": reply.rid, "object": "chat.completion" if reply.chat else "text_completion",
            "created": reply.created, "model": reply.model, "choices": out,
            "usage": reply.usage()}


def chunk(reply: Reply, choice_payload: list[dict], extra: Optional[dict] = None) -> str:
    """One server-sent event of a streamed answer."""
    data = {"id": reply.rid,
            "object": "chat.completion.chunk" if reply.chat else "text_completion",
            "created": reply.created, "model": reply.model, "choices": choice_payload,
            **(extra or {})}
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def first_payloads(reply: Reply) -> list[dict]:
    """A chat stream's first chunk: every choice's assistant role."""
    return [{"index": c.index, "finish_reason": None,
             "delta": {"role": "assistant", "content": ""}} for c in reply.choices]


def delta(reply: Reply, choice, text: str, event: Optional[TokenEvent]) -> dict:
    """One choice's payload in a stream chunk: its new text (and log-probabilities)."""
    payload: dict[str, Any] = {"index": choice.index, "finish_reason": None}
    if reply.chat:
        payload["delta"] = {"content": text}
        if reply.logprobs is not None and event is not None:
            payload["logprobs"] = {"content": [chat_token(choice, event)]}
    else:
        payload["text"] = text
        if reply.logprobs is not None and event is not None:
            payload["logprobs"] = completion_logprobs(choice, [event])
    return payload


def _parsed_message(reply: Reply, text: str) -> dict:
    """The assistant message of a whole answer: its reasoning split off (`reasoning_content`),
    then its tool calls (the same parsers a stream goes through)."""
    reasoning, content = (split_reasoning(text, reply.thinking) if reply.thinking is not None
                          else (None, text))
    if reply.tools is not None:
        message = assistant_message(parse_all(content))
    else:
        message = {"role": "assistant", "content": content}
    if reply.thinking is not None:
        message["reasoning_content"] = reasoning
    return message


def assistant_message(parsed: ToolCallParser) -> dict:
    """The assistant message of an answer parsed for tool calls (content None when it is
    only calls, as OpenAI's)."""
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.calls:
        message["content"] = parsed.content or None
        message["tool_calls"] = [c.as_dict() for c in parsed.calls]
    return message


def parsed_deltas(reply: Reply, choice, events: list[tuple], token_events: list) -> list[dict]:
    """A choice's stream payloads for its parsers' events: reasoning (`reasoning_content`),
    content, a call's id and name (arguments ""), then its arguments piece by piece (OpenAI's
    tool_calls deltas). The log-probabilities of `token_events` ride on the first payload
    (with an empty delta if the parsers held their text back, so that none is lost)."""
    calls = choice.parser.calls if choice.parser is not None else []
    payloads = []
    for e in events:
        if e[0] == "content":
            d: dict[str, Any] = {"content": e[1]}
        elif e[0] == "reasoning":
            d = {"reasoning_content": e[1]}
        elif e[0] == "call":
            call = calls[e[1]]
            d = {"tool_calls": [{"index": e[1], "id": call.id, "type": "function",
                                 "function": {"name": call.name, "arguments": ""}}]}
        else:
            d = {"tool_calls": [{"index": e[1], "function": {"arguments": e[2]}}]}
        payloads.append({"index": choice.index, "finish_reason": None, "delta": d})
    if reply.logprobs is not None and token_events:
        if not payloads:
            payloads.append({"index": choice.index, "finish_reason": None, "delta": {}})
        payloads[0]["logprobs"] = {"content": [chat_token(choice, t) for t in token_events]}
    return payloads


def finish_payload(reply: Reply, choice) -> dict:
    """A choice's last payload in a stream: its finish reason."""
    payload = {"index": choice.index, "finish_reason": choice.finish_reason}
    payload.update({"delta": {}} if reply.chat else {"text": ""})
    return payload


def error_event(e: APIError) -> str:
    """OpenAI's in-stream error event."""
    return "data: " + json.dumps({"error": {"message": e.message, "type": e.kind,
                                            "param": e.param, "code": None}}) + "\n\n"


def completion_logprobs(choice, events: Optional[list[TokenEvent]] = None) -> dict:
    """The legacy completions `logprobs` object."""
    events = events if events is not None else choice.token_events
    return {"tokens": [choice.token_text(e.token_id) for e in events],
            "token_logprobs": [e.logprob for e in events],
            "top_logprobs": [{choice.token_text(t): lp for t, lp in (e.top_logprobs or [])}
                             for e in events],
            "text_offset": []}


def chat_token(choice, event: TokenEvent) -> dict:
    """One token of the chat `logprobs.content` list."""
    text = choice.token_text(event.token_id)
    return {"token": text, "logprob": event.logprob, "bytes": list(text.encode()),
            "top_logprobs": [{"token": choice.token_text(t), "logprob": lp,
                              "bytes": list(choice.token_text(t).encode())}
                             for t, lp in (event.top_logprobs or [])]}


def chat_logprobs(choice) -> dict:
    """The chat completions `logprobs` object."""
    return {"content": [chat_token(choice, e) for e in choice.token_events]}

