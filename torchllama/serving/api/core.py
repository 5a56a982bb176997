"""The one request path under every API, and the shapes the APIs share.

    protocol body ──translation (chat, completions, responses, messages)──▶ Generation
    Generation ──Service.start──▶ Run: one engine `Request` per prompt × n (a `Choice` each)
    Run.updates()  (choice, Update) as tokens arrive: new text, its TokenEvent, parser events
    Run.whole()    every choice's `Output`: text, reasoning, content, tool calls, finish reason

What a choice's text becomes is decided here, once: a thinking template's reasoning parser
(`torchllama.serving.reasoning`), then a request with tools' call parser
(`torchllama.serving.tools`) read the text piece by piece, the same way for a stream and for a
whole answer — so every API's streamed answer equals its whole one by construction. No API
has a generation loop of its own: each protocol module translates its body into a `Generation`
and renders the updates or outputs in its own wire format (vLLM's `serving_*.py` split;
llama-server turns Anthropic's Messages into its OpenAI path the same way).

Shared shapes: `APIError` (status, message, the field it names, kind) and OpenAI's error
body; `SamplingBody`, the sampling fields of OpenAI's chat and completion bodies; OpenAI's
per-token log-probability object (`chat_token`, used by chat and responses).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Any, AsyncIterator, Callable, Optional, Union

from torchllama.errors import ArgumentError, TorchLlamaError
from torchllama.generation.grammar import GrammarError, Grammars, closed_schema
from torchllama.generation.sampling import (REPETITION_PENALTY_MAX, REPETITION_PENALTY_MIN,
                                           SamplingParams)
from torchllama.generation.session import encode_chat
from torchllama.generation.text import TextStream
from torchllama.serving.api.schemas import LOGIT_BIAS, RESPONSE_FORMAT, described
from torchllama.serving.engine import Engine, EngineStopped, QueueFull, Request, TokenEvent
from torchllama.serving.metrics import ServerMetrics
from torchllama.serving.reasoning import ReasoningParser, template_thinks
from torchllama.serving.tools import (ToolCall, ToolCallParser, Tools, chat_messages,
                                      renders_tools, tool_grammar)

try:  # the server's own dependencies; the rest of torchllama works without them
    from fastapi import Request as HTTPRequest
    from fastapi.responses import JSONResponse
    from pydantic import BaseModel, Field
except ImportError as e:  # pragma: no cover - fastapi is a dependency of the package
    raise ImportError("torchllama serve needs fastapi and uvicorn: pip install fastapi uvicorn") \
        from e

log = logging.getLogger("torchllama.serving.app")


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------

class APIError(Exception):
    """An error answered in the API's own error body (OpenAI's unless the route's API has its
    own: `torchllama.serving.app.error_response`).

    Args:
        status: the HTTP status.
        message: what was wrong, naming the field.
        param: the field (OpenAI's `param`), or None.
        kind: OpenAI's error `type` (invalid_request_error, authentication_error,
            not_found_error, rate_limit_error, server_error, ...).
        headers: response headers (Retry-After of a 429 or 503).
    """

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 kind: str = "invalid_request_error", headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.headers = headers


def openai_error(status: int, message: str, param: Optional[str] = None,
                 kind: str = "invalid_request_error",
                 headers: Optional[dict] = None) -> JSONResponse:
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""
    return JSONResponse(status_code=status, headers=headers, content={
        "error": {"message": message, "type": kind, "param": param, "code": None}})


def openai_error_event(e: APIError) -> str:
    """OpenAI's in-stream error event (chat and completions streams)."""
    return "data: " + json.dumps({"error": {"message": e.message, "type": e.kind,
                                            "param": e.param, "code": None}}) + "\n\n"


# --------------------------------------------------------------------------------------------
# A request in the engine's terms
# --------------------------------------------------------------------------------------------

@dataclass
class Generation:
    """One API request in the engine's terms: what every protocol translates its body into.

    Attributes:
        prompts: one or more prompts' token ids; each gets `n` choices (choice index
            prompt·n + j, as OpenAI's completions with a list of prompts).
        sampling: the sampling settings; choice j of a prompt uses seed + j.
        max_tokens: new tokens at most (None: up to the context; 0: none, only with
            prompt_logprobs — the prompt is scored, nothing generated). Capped by the context.
        stop: stop strings (never part of the output).
        logprobs: None, or how many alternatives to report with each generated token.
        prompt_logprobs: None, or how many alternatives to report with each prompt token (the
            prompt is then prefilled whole, not taken from the prefix cache).
        constraint: (kind, spec) for `torchllama.generation.grammar`, or None.
        tools: the tools the output is parsed for (their grammar constrains it), or None.
        chat: a chat answer: a thinking template's reasoning is split off.
        model: the request's `model` (a LoRA adapter's name picks it).
        endpoint: the metrics' `endpoint` label.
        prompt_param, constraint_param, tool_param: the fields errors name: a prompt that
            does not fit, a constraint that does not compile, tool i's schema ("{i}").
    """

    prompts: list[list[int]]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: Optional[int] = None
    n: int = 1
    stop: list[str] = field(default_factory=list)
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    constraint: Optional[tuple[str, Any]] = None
    tools: Optional[Tools] = None
    chat: bool = False
    model: Optional[str] = None
    endpoint: str = "completions"
    prompt_param: str = "prompt"
    constraint_param: Optional[str] = None
    tool_param: str = "tools[{i}].function.parameters"


def sampling(names: Optional[dict] = None, **fields) -> SamplingParams:
    """`SamplingParams(**fields)`, its errors as 400s naming the field (`names` maps a field
    to the API's name for it, e.g. {"temperature": "temperature"}).

    Raises:
        APIError: 400 for a value out of range.
    """
    try:
        return SamplingParams(**fields)
    except ArgumentError as e:
        name = str(e).split(" ", 1)[0]
        raise APIError(400, str(e), (names or {}).get(name, name)) from None


# --------------------------------------------------------------------------------------------
# One choice: engine events (tokens with their text, stop strings decided) → parsed output
# --------------------------------------------------------------------------------------------

@dataclass
class Output:
    """A choice's whole answer, parsed.

    Attributes:
        text: the generated text (up to a stop string).
        content: the answer's text (after any reasoning, before any tool call).
        reasoning: a thinking template's reasoning (None without a reasoning parser).
        calls: the tool calls (the last one incomplete if max_tokens cut it).
        finish_reason: "stop", "length" or "tool_calls" (a complete call, ended by itself).
    """

    text: str
    content: str
    reasoning: Optional[str]
    calls: list[ToolCall]
    finish_reason: str


@dataclass
class Update:
    """What one choice adds to a stream.

    Attributes:
        text: new text ('' when only a token's log-probabilities come).
        event: the token that brought it (None for text held back until the end).
        events: the parsers' events of the text — ("content", text), ("reasoning", text),
            ("call", i), ("arguments", i, text) — or None for a choice without parsers.
        final: the choice has ended: `finish_reason` (or `error`) is set; `events` are what the
            parsers held back.
    """

    text: str
    event: Optional[TokenEvent]
    events: Optional[list[tuple]]
    final: bool = False


#: tokens a request's stream may hold unread before its generation is stopped (its client
#: stopped reading while keeping the connection: memory stays bounded)
MAX_UNREAD_EVENTS = 1024

#: events of several choices in flight to one stream's writer
MERGED_EVENTS = 64


class Choice:
    """One generated sequence: its engine request and what the client sees of it.

    Attributes:
        index: the choice's index in the answer (prompt·n + j).
        prompt_index: its prompt's index in the request.
        prompt_ids: its prompt's token ids.
        token_ids, token_events: the tokens generated so far, and their `TokenEvent`s.
        finish_reason: "stop", "length" or "tool_calls" once it ended.
        error: an `APIError` if generation failed for it.
        parser, reasoning: its tool-call and reasoning parsers (None: not parsed so).
    """

    def __init__(self, index: int, prompt_ids: list[int], tokenizer,
                 loop: asyncio.AbstractEventLoop, metrics: Optional[ServerMetrics] = None,
                 endpoint: str = "", started: float = 0.0, prompt_index: int = 0):
        self.index, self.prompt_ids, self.prompt_index = index, prompt_ids, prompt_index
        self.metrics, self.endpoint = metrics, endpoint
        self.started = started                  # perf_counter() when the request arrived
        self.last_token_at: Optional[float] = None
        self.tokenizer = tokenizer
        self.events: asyncio.Queue = asyncio.Queue()
        self.loop = loop
        self.token_ids: list[int] = []
        self.token_events: list[TokenEvent] = []
        self.finish_reason: Optional[str] = None
        self.request: Optional[Request] = None
        self.error: Optional[APIError] = None
        self.parser: Optional[ToolCallParser] = None
        self.reasoning: Optional[ReasoningParser] = None
        self.done: Optional[Callable[[], None]] = None  # called (event loop) when it ends

    # called from the engine thread
    def on_token(self, event: TokenEvent) -> None:
        if self.events.qsize() >= MAX_UNREAD_EVENTS:      # its client stopped reading
            self.request.abort(f"the client read nothing of {MAX_UNREAD_EVENTS} tokens: "
                               "generation stopped", status=500)
            return
        if self.metrics is not None:
            now = time.perf_counter()
            if self.last_token_at is None:
                self.metrics.ttft.observe(now - self.started)
            else:
                self.metrics.itl.observe(now - self.last_token_at)
            self.last_token_at = now
            self.metrics.generation_tokens.inc()
        self.loop.call_soon_threadsafe(self.events.put_nowait, ("token", event))

    def on_finish(self, reason: str) -> None:
        if self.done is not None:                   # the adapter it used is free of it
            self.loop.call_soon_threadsafe(self.done)
        if self.metrics is not None:
            self.metrics.requests.labels(self.endpoint, reason).inc()
            self.metrics.duration.observe(time.perf_counter() - self.started)
        self.loop.call_soon_threadsafe(self.events.put_nowait, ("finish", reason))

    async def pieces(self) -> AsyncIterator[tuple[str, Optional[TokenEvent]]]:
        """Yield (text, event) as tokens arrive (their text from the engine's TextStream, which
        ends the request at a stop string); sets finish_reason at the end.

        Raises:
            APIError: 500 when generation failed for this request.
        """
        while True:
            kind, value = await self.events.get()
            if kind == "finish":
                if value == "error" or self.request.error is not None:
                    raise self.failure()
                if self.request.tail:                  # what the TextStream held back
                    yield self.request.tail, None
                self.finish_reason = "length" if value == "length" else "stop"
                return
            self.token_ids.append(value.token_id)
            self.token_events.append(value)
            if value.stopped and not value.text:       # the stop string's own token: no piece
                continue
            yield value.text, value

    def failure(self) -> APIError:
        """The error of a request that failed (500, its cause), whose grammar could not be
        followed (400) or that the server ended (503: shutting down; its cause)."""
        request = self.request
        cause = request.error or "generation failed (see the server log)"
        if request.error_status == 503:
            return APIError(503, f"request {request.id}: {cause}",
                            kind="service_unavailable")
        if request.error_status == 400:                 # the request's own (its grammar)
            return APIError(400, f"request {request.id}: {cause}")
        return APIError(500, f"request {request.id}: generation failed: {cause}",
                        kind="server_error")

    def parser_failure(self, error: Exception) -> APIError:
        """The 500 of a choice whose reasoning or tool-call parser raised (logged)."""
        log.error("request %s: parsing its output failed: %s: %s", self.request.id,
                  type(error).__name__, error, exc_info=error)
        return APIError(500, f"request {self.request.id}: parsing the output failed: "
                             f"{type(error).__name__}: {error}", kind="server_error")

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    @property
    def parsed(self) -> bool:
        """Its text goes through parsers (reasoning and/or tool calls)."""
        return self.parser is not None or self.reasoning is not None

    @property
    def prompt_scores(self) -> list[tuple[float, list[tuple[int, float]]]]:
        """Each prompt token's (log-probability, top alternatives) after the first
        (`Generation.prompt_logprobs`; the engine's `Request.prompt_scores`)."""
        return self.request.prompt_scores

    @property
    def stop_matched(self) -> Optional[str]:
        """The stop string that ended it, or None."""
        return self.request.text.matched if self.request.text is not None else None

    def split(self, text: str, final: bool = False) -> list[tuple]:
        """Parser events of new text (`final`: and of what the parsers held back): reasoning
        first, its content then through the tool-call parser."""
        pieces = [("content", text)]
        if self.reasoning is not None:
            pieces = self.reasoning.feed(text) + (self.reasoning.finish() if final else [])
        events: list[tuple] = []
        for kind, piece in pieces:
            if kind == "content" and self.parser is not None:
                events += self.parser.feed(piece)
            else:
                events.append((kind, piece))
        if final and self.parser is not None:
            events += self.parser.finish()
        return events

    def end(self) -> list[tuple]:
        """The parsers' last events (what they held back); the finish reason becomes
        "tool_calls" when the choice ended by itself after a complete call."""
        if not self.parsed:
            return []
        events = self.split("", final=True)
        if self.finish_reason == "stop" and self.parser is not None and \
                self.parser.finish_reason:
            self.finish_reason = self.parser.finish_reason
        return events

    def output(self, text: str) -> Output:
        """The whole answer `text` through the parsers (what its stream gives, piece by piece)."""
        if not self.parsed:
            return Output(text, text, None, [], self.finish_reason)
        self.split(text)
        self.end()
        reasoning = self.reasoning.reasoning if self.reasoning is not None else None
        if self.parser is not None:
            content = self.parser.content
        else:
            content = self.reasoning.content
        calls = self.parser.calls if self.parser is not None else []
        return Output(text, content, reasoning, calls, self.finish_reason)


# --------------------------------------------------------------------------------------------
# One request's choices together
# --------------------------------------------------------------------------------------------

@dataclass
class Run:
    """An API request's choices running on the engine.

    Attributes:
        rid: its id (the API's prefix + 24 hex digits).
        choices: one per prompt × n.
        prompt_tokens: the prompts' tokens, in all.
        model: the served model's name, or the adapter's.
    """

    rid: str
    choices: list[Choice]
    prompt_tokens: int
    model: str
    created: int = field(default_factory=lambda: int(time.time()))
    started: float = field(default_factory=time.perf_counter)

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens taken from the prefix cache (each prompt's first choice's)."""
        first: dict[int, int] = {}
        for c in self.choices:
            first.setdefault(c.prompt_index, c.request.cached_tokens)
        return sum(first.values())

    def usage(self) -> dict:
        """OpenAI's usage object of chat and completions."""
        out = self.completion_tokens
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": out,
                "total_tokens": self.prompt_tokens + out}

    def cancel(self) -> None:
        """Free the engine's rows (a client gone, or the answer complete)."""
        for choice in self.choices:
            choice.request.cancel()

    def log(self) -> None:
        """The request's one log line: its token counts, latency and rate."""
        out = self.completion_tokens
        seconds = time.perf_counter() - self.started
        log.info("%s prompt_tokens=%d completion_tokens=%d latency=%.2fs tok/s=%.1f", self.rid,
                 self.prompt_tokens, out, seconds, out / seconds if seconds else 0.0)

    async def whole(self, http: Optional[HTTPRequest]) -> list[Output]:
        """Wait for every choice and parse its answer; cancel them if the client goes away
        first.

        Raises:
            APIError: 500 when generation failed for a choice.
        """
        watcher = asyncio.create_task(self._watch(http)) if http is not None else None
        texts = []
        try:
            for choice in self.choices:
                texts.append("".join([text async for text, _ in choice.pieces()]))
        finally:
            if watcher is not None:
                watcher.cancel()
            self.cancel()
        self.log()
        outputs = []
        for choice, text in zip(self.choices, texts):
            try:
                outputs.append(choice.output(text))
            except Exception as e:             # a parser's bug: this request's 500
                raise choice.parser_failure(e) from None
        return outputs

    async def _watch(self, http: HTTPRequest) -> None:
        """Cancel the choices when the client disconnects."""
        try:
            while (await http.receive())["type"] != "http.disconnect":
                pass
        except Exception:              # noqa: BLE001 - cannot tell: let it finish
            return
        self.cancel()

    async def updates(self) -> AsyncIterator[tuple[Choice, Update]]:
        """(choice, Update) as any choice's text arrives, and a final Update when one ends
        (its error, if any, in choice.error). The rows are freed when the caller stops
        reading (the client went away) or all have ended."""
        merged = _merged(self.choices)
        broken: set[int] = set()                      # choices whose parser failed
        try:
            async for choice, text, event in merged:
                if choice.index in broken:
                    continue
                if text is None:
                    events = self.final_events(choice)
                    yield choice, Update("", None, events, final=True)
                    continue
                try:
                    events = choice.split(text) if choice.parsed else None
                except Exception as e:                # ends this choice, not the others
                    choice.error = choice.parser_failure(e)
                    choice.request.cancel()
                    broken.add(choice.index)
                    yield choice, Update("", None, None, final=True)
                    continue
                yield choice, Update(text, event, events)
            self.log()
        finally:
            self.cancel()
            await merged.aclose()

    @staticmethod
    def final_events(choice: Choice) -> Optional[list[tuple]]:
        """The parsers' last events of an ended choice (None: not parsed, or it failed)."""
        if choice.error is not None:
            return None
        try:
            events = choice.end()
        except Exception as e:                        # a parser's bug: this choice's error
            choice.error = choice.parser_failure(e)
            return None
        return events if choice.parsed else None


async def _merged(choices: list[Choice]) -> AsyncIterator[tuple]:
    """(choice, text, event) as any choice's pieces arrive, and (choice, None, None) when one
    ends (its error, if any, in choice.error). One choice is read directly; several through a
    task each and a shared queue."""
    if len(choices) == 1:
        (choice,) = choices
        try:
            async for text, event in choice.pieces():
                yield choice, text, event
        except APIError as e:
            choice.error = e
        yield choice, None, None
        return
    # bounded: with a slow reader the pumps wait, and the choices' own queues fill up
    merged: asyncio.Queue = asyncio.Queue(maxsize=MERGED_EVENTS)

    async def pump(choice):
        try:
            async for text, event in choice.pieces():
                await merged.put((choice, text, event))
        except APIError as e:
            choice.error = e
        finally:
            await merged.put((choice, None, None))

    tasks = [asyncio.create_task(pump(c)) for c in choices]
    try:
        for _ in choices:
            while True:
                item = await merged.get()
                yield item
                if item[1] is None:
                    break
    finally:
        for task in tasks:
            task.cancel()


# --------------------------------------------------------------------------------------------
# The service: Generation → Run
# --------------------------------------------------------------------------------------------

def text_limit(tokenizer, context: int) -> Optional[int]:
    """The most bytes of text that can fit `context` − 1 tokens: every token spells at most
    the longest token's bytes (special tokens counted as their text), so longer text needs
    more tokens than the context holds. None when the tokenizer does not list its tokens."""
    try:
        longest = max(len(b) for b in tokenizer.token_bytes())
    except (AttributeError, TypeError, ValueError):
        return None
    specials = getattr(tokenizer, "special_tokens", None) or {}
    longest = max([longest] + [len(str(t).encode()) for t in specials])
    return (context - 1) * longest


def _texts(content: Any) -> list[str]:
    """The strings of a message's content (a string, or text parts)."""
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        return [p["text"] for p in content if isinstance(p, dict) and
                isinstance(p.get("text"), str)]
    return []


#: seconds a client told "the queue is full" (429) waits before it retries (Retry-After)
QUEUE_RETRY_AFTER = 1


class Service:
    """What every API shares: the engine, the tokenizer, the adapters, the grammars, the
    metrics; `start` runs a `Generation`.

    Args:
        engine: the running `Engine`.
        tokenizer: the model's tokenizer.
        metrics: the server's `ServerMetrics`.
        model_name: the served model's name.
        adapters: the `torchllama.serving.adapters.Adapters` served by name.
    """

    def __init__(self, engine: Engine, tokenizer, metrics: ServerMetrics, model_name: str,
                 adapters):
        self.engine, self.tokenizer, self.metrics = engine, tokenizer, metrics
        self.model_name, self.adapters = model_name, adapters
        self.grammars = Grammars(tokenizer)
        self.context = engine.context
        self.native_tools = renders_tools(tokenizer.chat_template)
        self.thinks = template_thinks(tokenizer.chat_template)
        self.text_limit = text_limit(tokenizer, self.context)

    def check_texts(self, texts: list[str], param: str) -> None:
        """Refuse, before tokenizing, text that cannot fit the context (`text_limit`): the
        tokenizer holds the GIL while it works (8 MiB took seconds, and every stream on the
        server stalled meanwhile).

        Raises:
            APIError: 400 naming `param`.
        """
        size = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
        if self.text_limit is not None and size > self.text_limit:
            raise APIError(400, f"{param}: {size} bytes of text are more tokens than the "
                                f"context holds ({self.context}; a token spells at most "
                                f"{self.text_limit // max(self.context - 1, 1)} bytes)", param)

    def encode_chat(self, messages: list[dict], tools: Optional[Tools] = None,
                    variables: Optional[dict] = None, param: str = "messages") -> list[int]:
        """The prompt's token ids of chat messages (OpenAI's, as dicts: role, content a string,
        tool_calls, tool_call_id) with `tools` offered (`torchllama.serving.tools`) and more
        template variables.

        Raises:
            APIError: 400 naming `param` for messages the chat template refuses.
        """
        self.check_texts([c for m in messages for c in _texts(m.get("content"))], param)
        messages, offered = chat_messages(messages, tools, self.native_tools)
        try:
            return encode_chat(self.tokenizer, messages, tools=offered, variables=variables)
        except TorchLlamaError as e:
            raise APIError(400, str(e), param) from None

    def thinking(self, prompt_ids: list[int]) -> Optional[bool]:
        """For a thinking model's template: whether the prompt opened `<think>` itself (the
        answer starts inside it); None for other templates (no reasoning split)."""
        if not self.thinks:
            return None
        return self.tokenizer.decode(prompt_ids[-8:]).rstrip().endswith("<think>")

    def max_tokens(self, gen: Generation, prompt_ids: list[int]) -> int:
        """The request's max_tokens for this prompt, capped by the context.

        Raises:
            APIError: 400 (gen.prompt_param) for an empty prompt or one that fills the context.
        """
        context = self.context
        if not prompt_ids:
            raise APIError(400, f"{gen.prompt_param}: the prompt is empty (no tokens)",
                           gen.prompt_param)
        if len(prompt_ids) >= context:
            raise APIError(400, f"the prompt has {len(prompt_ids)} tokens but the context holds "
                                f"{context}", gen.prompt_param)
        left = context - len(prompt_ids)
        return left if gen.max_tokens is None else min(gen.max_tokens, left)

    async def constraints_for(self, gen: Generation, count: int) -> list:
        """`count` grammar constraints (None each without one): the request's, or its tools'
        (`tool_grammar`); compiled off the event loop (the first one builds the vocabulary's
        token table).

        Raises:
            APIError: 400 naming the field whose grammar does not compile.
        """
        tools = gen.tools
        spec = gen.constraint if tools is None else ("grammar", tool_grammar(tools))
        if spec is None:
            return [None] * count
        try:
            first = await asyncio.to_thread(self.grammars.compile, *spec)
        except GrammarError as e:
            if tools is not None:
                raise await asyncio.to_thread(self.tool_schema_error, gen, e) from None
            param = gen.constraint_param or \
                ("response_format" if spec[0].startswith("json") else spec[0])
            raise APIError(400, str(e), param) from None
        return [first] + [first.copy() for _ in range(count - 1)]

    def tool_schema_error(self, gen: Generation, error: GrammarError) -> APIError:
        """The 400 for tools whose grammar does not compile, naming the first tool whose
        parameter schema does not compile alone."""
        for i, (name, schema) in enumerate(gen.tools.functions.items()):
            try:
                self.grammars.compile("json_schema", schema)
            except GrammarError as e:
                param = gen.tool_param.format(i=i)
                return APIError(400, f"{param} ({name}): {e}", param)
        return APIError(400, f"tools: {error}", "tools")

    async def start(self, gen: Generation, prefix: str) -> Run:
        """Check the request and queue one engine request per prompt × n.

        Args:
            gen: the request.
            prefix: its id's prefix ("chatcmpl-", "cmpl-", "resp_", "msg_").

        Raises:
            APIError: 400 naming the field (a prompt that does not fit, a grammar that does
                not compile), 404 for an adapter being unloaded, 429 when the queue is full.
        """
        limits = [self.max_tokens(gen, p) for p in gen.prompts]
        count = len(gen.prompts) * gen.n
        constraints = await self.constraints_for(gen, count)
        adapter = self.adapters.pick(gen.model)      # (no await from here to its use)
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        rid = prefix + uuid.uuid4().hex[:24]
        choices = []
        for p, (prompt_ids, limit) in enumerate(zip(gen.prompts, limits)):
            thinking = self.thinking(prompt_ids) if gen.chat else None
            for j in range(gen.n):
                choice = Choice(p * gen.n + j, prompt_ids, self.tokenizer, loop, self.metrics,
                                gen.endpoint, started, prompt_index=p)
                choice.request = self.request(gen, prompt_ids, limit, j, choice,
                                              constraints[len(choices)], adapter)
                choice.request.id = f"{rid}#{p * gen.n + j}" if count > 1 else rid
                choice.parser = ToolCallParser() if gen.tools is not None else None
                choice.reasoning = ReasoningParser(thinking) if thinking is not None else None
                choices.append(choice)
        self.submit(choices, adapter)
        prompt_tokens = sum(len(p) for p in gen.prompts)
        self.metrics.prompt_tokens.inc(prompt_tokens)
        return Run(rid, choices, prompt_tokens,
                   adapter or self.model_name)      # (the adapter's name, as vLLM)

    def request(self, gen: Generation, prompt_ids: list[int], max_tokens: int, j: int,
                choice: Choice, constraint, adapter: Optional[str]) -> Request:
        """The engine request of choice j of a prompt."""
        seed = gen.sampling.seed
        params = dataclasses.replace(gen.sampling, logprobs=gen.logprobs or 0,
                                     seed=None if seed is None else seed + j)
        return Request(prompt_ids, max_tokens, params, self.tokenizer.stop_ids, choice.on_token,
                       choice.on_finish, logprobs=gen.logprobs, constraint=constraint,
                       text=TextStream(self.tokenizer, prompt_ids, gen.stop), adapter=adapter,
                       prompt_logprobs=gen.prompt_logprobs)

    def submit(self, choices: list[Choice], adapter: Optional[str]) -> None:
        """Queue every choice's request (all or none).

        Raises:
            APIError: 429 when the queue is full, 400 for what the engine refuses.
        """
        try:
            for choice in choices:
                done = self.adapters.use(adapter)
                try:
                    self.engine.submit(choice.request)
                except Exception:
                    if done is not None:
                        done()
                    raise
                choice.done = done
        except EngineStopped as e:
            for choice in choices:
                choice.request.cancel()
            raise APIError(503, str(e), kind="service_unavailable",
                           headers={"Retry-After": str(QUEUE_RETRY_AFTER)}) from None
        except QueueFull as e:
            for choice in choices:
                choice.request.cancel()
            raise APIError(429, str(e), kind="rate_limit_error",
                           headers={"Retry-After": str(QUEUE_RETRY_AFTER)}) from None
        except TorchLlamaError as e:
            for choice in choices:
                choice.request.cancel()
            raise APIError(400, str(e)) from None


# --------------------------------------------------------------------------------------------
# OpenAI's shapes shared by its chat, completions and responses APIs
# --------------------------------------------------------------------------------------------

class SamplingBody(BaseModel):
    """The fields OpenAI's chat and completion bodies share (top_k, min_p,
    repetition_penalty, grammar and regex are extensions)."""
    model: Optional[str] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, ge=REPETITION_PENALTY_MIN,
                                      le=REPETITION_PENALTY_MAX)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: Annotated[Optional[dict[str, float]], described(LOGIT_BIAS)] = None
    n: int = Field(1, ge=1, le=16)
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    stream: bool = False
    stream_options: Optional[dict[str, Any]] = None
    user: Optional[str] = None
    # structured output: OpenAI's response_format, and (extensions) a Lark/GBNF grammar or a
    # regular expression the output must match
    response_format: Annotated[Optional[dict[str, Any]], described(RESPONSE_FORMAT)] = None
    grammar: Optional[str] = None
    regex: Optional[str] = None


def body_sampling(body: SamplingBody, vocab_size: int) -> SamplingParams:
    """The sampling settings of an OpenAI chat or completion body.

    Raises:
        APIError: 400 naming the field (logit_bias keys that are not token ids, values out of
            range).
    """
    bias = {}
    for token, value in (body.logit_bias or {}).items():
        if not (token.isascii() and token.isdigit()) or int(token) >= vocab_size:
            raise APIError(400, f"logit_bias: {token!r} is not a token id", "logit_bias")
        bias[int(token)] = value
    return sampling(temperature=body.temperature, top_k=body.top_k, top_p=body.top_p,
                    min_p=body.min_p, repetition_penalty=body.repetition_penalty,
                    frequency_penalty=body.frequency_penalty,
                    presence_penalty=body.presence_penalty, logit_bias=bias or None,
                    seed=body.seed)


def stop_strings(stop: Union[None, str, list[str]], param: str = "stop",
                 most: Optional[int] = 4) -> list[str]:
    """The stop strings of a body (OpenAI allows 4).

    Raises:
        APIError: 400 (param) for an empty string or more than `most`.
    """
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not s for s in stops) or (most is not None and len(stops) > most):
        raise APIError(400, f"{param}: up to {most} non-empty strings" if most else
                       f"{param}: non-empty strings", param)
    return stops


def response_format_constraint(fmt: Optional[dict], param: str = "response_format",
                               flat: bool = False) -> Optional[tuple[str, Any]]:
    """(kind, spec) of OpenAI's `response_format` (chat: {"type": "json_schema",
    "json_schema": {"schema": ...}}) or, `flat`, the Responses API's `text.format` ({"type":
    "json_schema", "schema": ...}); None for text. With `strict: true` every object of the
    schema requires all its properties and takes no others (`grammar.closed_schema`, as
    OpenAI's strict mode); without, objects that list their properties are closed all the
    same when the grammar is compiled.

    Raises:
        APIError: 400 (param) for a malformed format.
    """
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise APIError(400, f"{param}: an object is required", param)
    kind = fmt.get("type")
    if kind == "json_object":
        return "json_object", None
    if kind == "json_schema":
        spec = fmt if flat else (fmt.get("json_schema") or {})
        schema = spec.get("schema") if isinstance(spec, dict) else None     # (fuzzed: a list)
        if not isinstance(schema, dict):
            where = f"{param}.schema" if flat else f"{param}.json_schema.schema"
            raise APIError(400, f"{where}: a JSON schema object is required", param)
        return "json_schema", closed_schema(schema, require_all=spec.get("strict") is True)
    if kind != "text":
        raise APIError(400, f"{param}.type must be text, json_object or json_schema, got "
                            f"{kind!r}", param)
    return None


def one_constraint(fmt: Optional[tuple[str, Any]], body: Any,
                   param: str = "response_format") -> Optional[tuple[str, Any]]:
    """The one output constraint of a body: its JSON format (`fmt`, parsed), or its `grammar`
    or `regex` extension (a Lark/GBNF grammar, a regular expression), or None.

    Raises:
        APIError: 400 (param) for more than one.
    """
    found = [fmt] if fmt is not None else []
    found += [(kind, getattr(body, kind)) for kind in ("grammar", "regex")
              if getattr(body, kind, None) is not None]
    if len(found) > 1:
        raise APIError(400, f"give one of {param} (JSON), grammar and regex", param)
    return found[0] if found else None


def body_constraint(body: SamplingBody) -> Optional[tuple[str, Any]]:
    """(kind, spec) of a chat or completion body's output constraint (response_format,
    grammar, regex), or None.

    Raises:
        APIError: 400 for a malformed response_format or more than one constraint.
    """
    return one_constraint(response_format_constraint(body.response_format), body)


def openai_chunk(run: Run, kind: str, payloads: list[dict],
                 extra: Optional[dict] = None) -> str:
    """One server-sent event of a streamed chat or text completion (`kind`: its object)."""
    data = {"id": run.rid, "object": kind, "created": run.created, "model": run.model,
            "choices": payloads, **(extra or {})}
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def chat_token(choice: Choice, event: TokenEvent) -> dict:
    """One token of OpenAI's chat `logprobs.content` list (also the Responses API's
    `output_text.logprobs`)."""
    text = choice.token_text(event.token_id)
    return {"token": text, "logprob": event.logprob, "bytes": list(text.encode()),
            "top_logprobs": [{"token": choice.token_text(t), "logprob": lp,
                              "bytes": list(choice.token_text(t).encode())}
                             for t, lp in (event.top_logprobs or [])]}
