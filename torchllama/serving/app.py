"""An OpenAI-compatible HTTP server (FastAPI + uvicorn) over the continuous-batching engine.

    GET  /health                 liveness
    GET  /metrics                Prometheus metrics (`torchllama.serving.metrics`)
    GET  /v1/models              the one model served
    POST /v1/completions         text completion (OpenAI's legacy API), stream or not
    POST /v1/chat/completions    chat completion with the model's chat template, stream or not;
                                 tool calling (`torchllama.serving.tools`)
    POST /v1/embeddings          pooled final hidden states (`torchllama.serving.embeddings`)
    POST /v1/load_lora_adapter   load a LoRA adapter, served by name (`model`) from then on
    POST /v1/unload_lora_adapter unload one (after the requests using it end)

Every request is tokenized here and handed to `torchllama.serving.engine.Engine`, which decodes all
running requests together (with `--draft`, a request decoding alone runs speculative rounds),
turns their tokens into text and ends them at their stop strings (each request's `TextStream`);
tokens and their text come back to the request's handler through an asyncio queue. The bodies
of requests and answers are `torchllama.serving.protocol`'s.
Streaming responses are server-sent events ending with `data: [DONE]`. Errors use OpenAI's body,
`{"error": {"message", "type", "param", "code"}}`: 400 for invalid fields (naming them) and prompts
that do not fit, 401 without the API key, 429 when the waiting queue is full, 500 when generation
fails for a request (in a stream: an error event). A client that goes away, streaming or not,
has its generation cancelled.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
import uuid
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Optional

from torchllama.serving.engine import Engine, QueueFull, Request, TokenEvent
from torchllama.errors import ArgumentError, TorchLlamaError
from torchllama.generation.session import encode_chat, encode_prompt
from torchllama.generation.grammar import Grammars, GrammarError
from torchllama.serving.metrics import ServerMetrics
from torchllama.serving.protocol import (APIError, ChatBody, CompletionBody, EmbeddingBody,
                                         LoadAdapterBody, Reply, SamplingBody, UnloadAdapterBody,
                                         chunk, constraint_of, delta, error_event, error_response,
                                         finish_payload, first_payloads, message_dicts,
                                         parsed_deltas, response)
from torchllama.serving.reasoning import ReasoningParser, template_thinks
from torchllama.serving.tools import (ToolCallParser, ToolError, Tools, chat_messages,
                                      renders_tools, tool_grammar, tools_of)
from torchllama.generation.sampling import SamplingParams
from torchllama.generation.speculative import DEFAULT_DRAFT_TOKENS, make_drafter
from torchllama.generation.text import TextStream

log = logging.getLogger("torchllama.serving.app")

try:  # the server's own dependencies; the rest of torchllama works without them
    from fastapi import FastAPI, Request as HTTPRequest
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import Response, StreamingResponse
except ImportError as e:  # pragma: no cover - fastapi is a dependency of the package
    raise ImportError("torchllama serve needs fastapi and uvicorn: pip install fastapi uvicorn") \
        from e


class _APIKey:
    """ASGI middleware: every HTTP request but /health needs `Authorization: Bearer <key>`,
    else 401. A plain ASGI wrapper, not Starlette's BaseHTTPMiddleware, which passes every
    streamed chunk through an extra in-memory stream (a quarter of the event loop's time with 8
    streams)."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health" and \
                dict(scope["headers"]).get(b"authorization") != self.expected:
            response = error_response(401, "invalid or missing API key (Authorization: "
                                      "Bearer ...)", kind="authentication_error")
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


# --------------------------------------------------------------------------------------------
# One choice: engine events (tokens with their text, stop strings decided) → the client
# --------------------------------------------------------------------------------------------

class _Choice:
    """Collects one generated sequence: its engine request and what the client sees of it."""

    def __init__(self, index: int, tokenizer, loop: asyncio.AbstractEventLoop,
                 metrics: Optional[ServerMetrics] = None, endpoint: str = "",
                 started: float = 0.0):
        self.index = index
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
        self.parser: Optional[ToolCallParser] = None     # a chat answer offered tools
        self.reasoning: Optional[ReasoningParser] = None  # a thinking model's chat answer
        self.done: Optional[Callable[[], None]] = None  # called (event loop) when it ends

    # called from the engine thread
    def on_token(self, event: TokenEvent) -> None:
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
        ends the request at a stop string); sets finish_reason at the end."""
        while True:
            kind, value = await self.events.get()
            if kind == "finish":
                if value == "error":
                    raise APIError(500, "generation failed for this request (see the server "
                                        "log)", kind="server_error")
                if self.request.tail:                  # what the TextStream held back
                    yield self.request.tail, None
                self.finish_reason = "length" if value == "length" else "stop"
                return
            self.token_ids.append(value.token_id)
            self.token_events.append(value)
            if value.stopped and not value.text:       # the stop string's own token: no piece
                continue
            yield value.text, value

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

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


class _Adapters:
    """The LoRA adapters a server serves by name (`transforms.multi_lora`): loaded and unloaded
    while it runs, the model's modules changed only in the engine thread (`Engine.call`); a
    request chooses one by its `model` field. Unloading waits until no request uses it."""

    def __init__(self, engine: Engine, model_name: str):
        self.engine, self.model_name = engine, model_name
        self.paths: dict[str, str] = {}
        self.unloading: set[str] = set()
        self.in_use: collections.Counter = collections.Counter()

    def load_now(self, name: str, path: str) -> None:
        """Load before the engine runs (server start).

        Raises:
            ModelFileError: not an adapter for this model (see `multi_lora.read_adapter`).
        """
        from torchllama.transforms.multi_lora import add_adapter, install, read_adapter

        adapters = install(self.engine.model)
        add_adapter(adapters, read_adapter(self.engine.model, name, path))
        self.paths[name] = str(path)

    async def load(self, name: str, path: str) -> None:
        """Load while serving: wrap the products (engine thread), read the files (a worker
        thread), attach (engine thread).

        Raises:
            APIError: 400 for a name in use or an adapter that does not load.
        """
        from torchllama.transforms.multi_lora import add_adapter, install, read_adapter

        if not name or name == self.model_name or name in self.paths:
            raise APIError(400, f"lora_name: {name!r} is already the name of a served model",
                           "lora_name")
        if not Path(path).is_dir():
            raise APIError(400, f"lora_path: {path}: no such folder", "lora_path")
        model = self.engine.model
        adapters = await asyncio.wrap_future(self.engine.call(lambda: install(model)))
        try:
            weights = await asyncio.to_thread(read_adapter, model, name, path)
        except TorchLlamaError as e:
            raise APIError(400, f"lora_path: {e}", "lora_path") from None
        if name in self.paths:
            raise APIError(400, f"lora_name: {name!r} was loaded meanwhile", "lora_name")
        self.paths[name] = str(path)
        await asyncio.wrap_future(self.engine.call(lambda: add_adapter(adapters, weights)))

    async def unload(self, name: str) -> None:
        """Stop taking requests for `name`, wait for those using it, then detach it.

        Raises:
            APIError: 404 for a name that is not loaded.
        """
        from torchllama.transforms.multi_lora import remove_adapter

        if name not in self.paths or name in self.unloading:
            raise APIError(404, f"lora_name: no LoRA adapter {name!r} is loaded", "lora_name",
                           "not_found_error")
        self.unloading.add(name)
        try:
            while self.in_use[name] > 0:
                await asyncio.sleep(0.02)
            model = self.engine.model
            await asyncio.wrap_future(self.engine.call(
                lambda: remove_adapter(model, model.adapter_set, name)))
            del self.paths[name]
        finally:
            self.unloading.discard(name)

    def pick(self, model: Optional[str]) -> Optional[str]:
        """The adapter a request's `model` names, or None (the base model).

        Raises:
            APIError: 404 for an adapter being unloaded.
        """
        if model in self.unloading:
            raise APIError(404, f"model: the LoRA adapter {model!r} is being unloaded",
                           "model", "not_found_error")
        return model if model in self.paths else None

    def use(self, name: Optional[str]) -> Optional[Callable[[], None]]:
        """Count one more request using `name`; returns what ends its use (None: the base)."""
        if name is None:
            return None
        self.in_use[name] += 1

        def done() -> None:
            self.in_use[name] -= 1
        return done


class _Completions:
    """What the completion endpoints do: check a request, submit one engine request per choice
    and answer with the whole result or a stream of server-sent events."""

    def __init__(self, engine: Engine, tokenizer, metrics: ServerMetrics, model_name: str):
        self.engine, self.tokenizer, self.metrics = engine, tokenizer, metrics
        self.model_name = model_name
        self.adapters = _Adapters(engine, model_name)
        self.grammars = Grammars(tokenizer)
        self.context = engine.context
        self.native_tools = renders_tools(tokenizer.chat_template)
        self.thinks = template_thinks(tokenizer.chat_template)

    def chat_prompt(self, body: ChatBody) -> tuple[Optional[Tools], list[int]]:
        """(the tools the answer is parsed for, or None; the prompt's token ids) of a chat
        request (`torchllama.serving.tools`; `chat_template_kwargs` are more template
        variables).

        Raises:
            APIError: 400 naming the field: invalid tools or tool_choice, tools together with
                another output constraint, messages the chat template refuses.
        """
        try:
            tools = tools_of(body.tools, body.tool_choice, body.parallel_tool_calls)
        except ToolError as e:
            raise APIError(400, str(e), e.param) from None
        if tools is not None and not tools.active:
            tools = None
        if tools is not None and constraint_of(body) is not None:
            raise APIError(400, "tools: give either tools or one of response_format, grammar "
                                "and regex", "tools")
        messages, offered = chat_messages(message_dicts(body.messages), tools, self.native_tools)
        try:
            return tools, encode_chat(self.tokenizer, messages, tools=offered,
                                      variables=body.chat_template_kwargs)
        except TorchLlamaError as e:
            raise APIError(400, str(e), "messages") from None

    def thinking(self, prompt_ids: list[int]) -> Optional[bool]:
        """For a thinking model's template: whether the prompt opened `<think>` itself (the
        answer starts inside it); None for other templates (no reasoning split)."""
        if not self.thinks:
            return None
        return self.tokenizer.decode(prompt_ids[-8:]).rstrip().endswith("<think>")

    @staticmethod
    def sampling_of(body: SamplingBody, index: int, top_logprobs: int) -> SamplingParams:
        try:
            bias = {int(k): v for k, v in (body.logit_bias or {}).items()}
        except ValueError:
            raise APIError(400, "logit_bias: keys must be token ids", "logit_bias") from None
        try:
            return SamplingParams(
                temperature=body.temperature, top_k=body.top_k, top_p=body.top_p,
                min_p=body.min_p, repetition_penalty=body.repetition_penalty,
                frequency_penalty=body.frequency_penalty, presence_penalty=body.presence_penalty,
                logit_bias=bias or None, logprobs=top_logprobs,
                seed=None if body.seed is None else body.seed + index)
        except ArgumentError as e:
            param = str(e).split(" ", 1)[0]
            raise APIError(400, str(e), param) from None

    async def constraints_for(self, body: SamplingBody, tools: Optional[Tools] = None) -> list:
        """One grammar constraint per choice (None each without one): the body's, or the
        tools' (`tool_grammar`); compiled off the event loop (the first one builds the
        vocabulary's token table)."""
        spec = constraint_of(body) if tools is None else ("grammar", tool_grammar(tools))
        if spec is None:
            return [None] * body.n
        try:
            first = await asyncio.to_thread(self.grammars.compile, *spec)
        except GrammarError as e:
            if tools is not None:
                raise await asyncio.to_thread(self.tool_schema_error, tools, e) from None
            param = "response_format" if spec[0].startswith("json") else spec[0]
            raise APIError(400, str(e), param) from None
        return [first] + [first.copy() for _ in range(body.n - 1)]

    def tool_schema_error(self, tools: Tools, error: GrammarError) -> APIError:
        """The 400 for tools whose grammar does not compile, naming the first tool whose
        parameter schema does not compile alone."""
        for i, (name, schema) in enumerate(tools.functions.items()):
            try:
                self.grammars.compile("json_schema", schema)
            except GrammarError as e:
                param = f"tools[{i}].function.parameters"
                return APIError(400, f"{param} ({name}): {e}", param)
        return APIError(400, f"tools: {error}", "tools")

    def check(self, body: SamplingBody, prompt_ids: list[int], chat: bool,
              max_tokens: Optional[int]) -> tuple[int, list[str]]:
        """(max_tokens capped by the context, stop strings) of a valid request.

        Raises:
            APIError: 400 naming the field.
        """
        context = self.context
        if len(prompt_ids) >= context:
            raise APIError(400, f"the prompt has {len(prompt_ids)} tokens but the context holds "
                                f"{context}", "messages" if chat else "prompt")
        for token in (body.logit_bias or {}):
            if not (token.isascii() and token.isdigit()) or \
                    int(token) >= self.tokenizer.vocab_size:
                raise APIError(400, f"logit_bias: {token!r} is not a token id", "logit_bias")
        stops = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
        if any(not s for s in stops) or len(stops) > 4:
            raise APIError(400, "stop: up to 4 non-empty strings", "stop")
        return min(max_tokens or context, context - len(prompt_ids)), stops

    async def submit(self, body: SamplingBody, prompt_ids: list[int], chat: bool,
                     max_tokens: Optional[int], logprobs: Optional[int],
                     tools: Optional[Tools] = None,
                     thinking: Optional[bool] = None) -> list[_Choice]:
        """Check the request and queue one engine request per choice (each parsed for `tools`
        and, `thinking` not None, for reasoning: `Completions.thinking`)."""
        max_tokens, stops = self.check(body, prompt_ids, chat, max_tokens)
        constraints = await self.constraints_for(body, tools)
        adapter = self.adapters.pick(body.model)      # (no await from here to its use)
        loop = asyncio.get_running_loop()
        choices = []
        started = time.perf_counter()
        for i in range(body.n):
            choice = _Choice(i, self.tokenizer, loop, self.metrics,
                             "chat" if chat else "completions", started)
            choice.request = Request(prompt_ids, max_tokens,
                                     self.sampling_of(body, i, logprobs or 0),
                                     self.tokenizer.stop_ids, choice.on_token, choice.on_finish,
                                     logprobs=logprobs, constraint=constraints[i],
                                     text=TextStream(self.tokenizer, prompt_ids, stops),
                                     adapter=adapter)
            choice.parser = ToolCallParser() if tools is not None else None
            choice.reasoning = ReasoningParser(thinking) if thinking is not None else None
            choices.append(choice)
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
        except QueueFull as e:
            for choice in choices:
                choice.request.cancel()
            raise APIError(429, str(e), kind="rate_limit_error") from None
        except TorchLlamaError as e:
            for choice in choices:
                choice.request.cancel()
            raise APIError(400, str(e)) from None
        self.metrics.prompt_tokens.inc(len(prompt_ids))
        return choices

    async def respond(self, http: HTTPRequest, body: SamplingBody, prompt_ids: list[int],
                      chat: bool, max_tokens: Optional[int], logprobs: Optional[int],
                      tools: Optional[Tools] = None):
        """The response to a completion request: a JSON body, or a stream of events; a chat
        answer offered `tools` is parsed for tool calls."""
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        thinking = self.thinking(prompt_ids) if chat else None
        reply = Reply(rid, chat, logprobs, len(prompt_ids), [], self.model_name, tools, thinking)
        reply.choices = await self.submit(body, prompt_ids, chat, max_tokens, logprobs, tools,
                                          thinking)
        reply.model = reply.choices[0].request.adapter or self.model_name    # (as vLLM)
        if not body.stream:
            return await self.whole(http, reply)
        include_usage = bool((body.stream_options or {}).get("include_usage"))
        return StreamingResponse(self.events(reply, include_usage),
                                 media_type="text/event-stream")

    async def whole(self, http: HTTPRequest, reply: Reply) -> dict:
        """Wait for every choice; cancel them if the client goes away first."""
        choices = reply.choices

        async def watch() -> None:         # the client went away: free the engine's rows
            try:
                while (await http.receive())["type"] != "http.disconnect":
                    pass
            except Exception:              # noqa: BLE001 - cannot tell: let it finish
                return
            for choice in choices:
                choice.request.cancel()

        watcher = asyncio.create_task(watch())
        texts = []
        try:
            for choice in choices:
                parts = [text async for text, _ in choice.pieces()]
                texts.append("".join(parts))
        finally:
            watcher.cancel()
            for choice in choices:
                choice.request.cancel()
        _log_reply(reply)
        return response(reply, texts)

    async def events(self, reply: Reply, include_usage: bool) -> AsyncIterator[str]:
        """Server-sent events of every choice as their tokens arrive, then [DONE]."""
        choices = reply.choices
        pieces = _merged(choices)
        try:
            if reply.chat:
                yield chunk(reply, first_payloads(reply))
            async for choice, text, event in pieces:
                if text is None:
                    if choice.error is not None:       # OpenAI's in-stream error event
                        yield error_event(choice.error)
                        return
                    for payload in _parsed_finish(reply, choice):
                        yield chunk(reply, [payload])
                    yield chunk(reply, [finish_payload(reply, choice)])
                elif choice.parser is not None or choice.reasoning is not None:
                    events = choice.split(text)      # reasoning, content, tool_calls deltas
                    for payload in parsed_deltas(reply, choice, events,
                                                 [event] if event else []):
                        yield chunk(reply, [payload])
                elif text or event is not None:
                    yield chunk(reply, [delta(reply, choice, text, event)])
            if include_usage:
                yield chunk(reply, [], {"usage": reply.usage()})
            yield "data: [DONE]\n\n"
            _log_reply(reply)
        finally:                          # client gone or done: free the engine's rows
            for choice in choices:
                choice.request.cancel()
            await pieces.aclose()


def _parsed_finish(reply: Reply, choice: _Choice) -> list[dict]:
    """A choice's last parsed payloads (the text its parsers held back); its finish reason
    becomes "tool_calls" when it made a call."""
    if choice.parser is None and choice.reasoning is None:
        return []
    payloads = parsed_deltas(reply, choice, choice.split("", final=True), [])
    if choice.finish_reason == "stop" and choice.parser is not None and \
            choice.parser.finish_reason:
        choice.finish_reason = choice.parser.finish_reason
    return payloads


def _log_reply(reply: Reply) -> None:
    """The request's one log line: its token counts, latency and rate."""
    out = reply.completion_tokens
    seconds = time.perf_counter() - reply.started
    log.info("%s prompt_tokens=%d completion_tokens=%d latency=%.2fs tok/s=%.1f", reply.rid,
             reply.prompt_tokens, out, seconds, out / seconds if seconds else 0.0)


async def _merged(choices: list[_Choice]) -> AsyncIterator[tuple]:
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
    merged: asyncio.Queue = asyncio.Queue()

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
# The app
# --------------------------------------------------------------------------------------------

#: The prefix cache's default memory budget (MiB): ~11,000 tokens of SmolLM2's keys and values.
DEFAULT_PREFIX_CACHE_MB = 512


def create_app(model, tokenizer, model_name: str = "torchllama", api_key: Optional[str] = None,
               max_batch_size: int = 8, max_queue: int = 64, prefill_chunk: int = 512,
               prefix_cache_mb: int = DEFAULT_PREFIX_CACHE_MB, draft=None,
               draft_tokens: int = DEFAULT_DRAFT_TOKENS,
               kv_cache_dtype: Optional[str] = None,
               adapters: Optional[dict[str, str]] = None) -> FastAPI:
    """The FastAPI application serving `model` (engine started and stopped with the app).

    Args:
        model, tokenizer: what `torchllama.load` returns.
        model_name: the id reported by /v1/models and in responses.
        api_key: when set, requests need `Authorization: Bearer <api_key>` (else 401).
        max_batch_size: requests decoded together.
        max_queue: requests that may wait for a free row (beyond: 429).
        prefill_chunk: prompt tokens prefilled per engine iteration: longer prompts are
            prefilled in chunks while the running requests keep decoding (`Engine`).
        prefix_cache_mb: memory for the prefix cache, MiB (0: no prefix cache).
        draft, draft_tokens: a `torchllama.generation.speculative.Drafter` and the most tokens it
            drafts: speculative rounds for a lone decoding request (`Engine`).
        kv_cache_dtype: what the engine's KV cache stores (`Engine`; None: the model's
            `kv_cache_dtype`, which `torchllama.load` sets).
        adapters: LoRA adapters served by name (name → PEFT folder), loaded now; more can be
            loaded and unloaded at run time (/v1/load_lora_adapter).

    Raises:
        ModelFileError: an adapter that is not for this model.
    """
    from contextlib import asynccontextmanager

    engine = Engine(model, max_batch_size, max_queue, pad_id=tokenizer.pad_id or 0,
                    prefill_chunk=prefill_chunk, prefix_cache_bytes=prefix_cache_mb << 20,
                    draft=draft, draft_tokens=draft_tokens, kv_cache_dtype=kv_cache_dtype)
    metrics = ServerMetrics(engine)
    service = _Completions(engine, tokenizer, metrics, model_name)
    for name, path in (adapters or {}).items():
        service.adapters.load_now(name, path)

    @asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        engine.shutdown()

    app = FastAPI(title="torchllama", lifespan=lifespan)
    app.state.engine = engine
    app.state.metrics = metrics
    _add_error_handlers(app)
    if api_key is not None:
        app.add_middleware(_APIKey, api_key=api_key)
    _add_routes(app, service)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Invalid bodies and `APIError`s answered with OpenAI's error body."""

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = (".".join(loc) or None) if first.get("type") != "json_invalid" else None
        return error_response(400, f"{param or 'body'}: {first.get('msg', 'invalid request')}",
                              param)

    @app.exception_handler(APIError)
    async def api_error(request, exc: APIError):
        return error_response(exc.status, exc.message, exc.param, exc.kind)


def _add_routes(app: FastAPI, service: "_Completions") -> None:
    """The endpoints (see the module docstring)."""
    engine, metrics, tokenizer = service.engine, service.metrics, service.tokenizer
    model_name = service.model_name

    @app.get("/health")
    async def health():
        return {"status": "ok", "active": engine.active}

    @app.get("/metrics")
    async def prometheus_metrics():
        from prometheus_client import CONTENT_TYPE_LATEST
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        data = [{"id": model_name, "object": "model", "created": 0, "owned_by": "torchllama"}]
        data += [{"id": name, "object": "model", "created": 0, "owned_by": "torchllama",
                  "root": path, "parent": model_name}
                 for name, path in service.adapters.paths.items()]
        return {"object": "list", "data": data}

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadAdapterBody):
        await service.adapters.load(body.lora_name, body.lora_path)
        return {"object": "lora_adapter", "lora_name": body.lora_name, "status": "loaded"}

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadAdapterBody):
        await service.adapters.unload(body.lora_name)
        return {"object": "lora_adapter", "lora_name": body.lora_name, "status": "unloaded"}

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, http: HTTPRequest):
        prompt_ids = encode_prompt(tokenizer, body.prompt)
        if body.echo:
            raise APIError(400, "echo is not supported", "echo")
        return await service.respond(http, body, prompt_ids, False, body.max_tokens,
                                     body.logprobs)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingBody):
        from torchllama.serving.embeddings import encoded, pooled

        lists = embedding_inputs(tokenizer, body, engine.context, engine.model.args.vocab_size)
        future = engine.call(lambda: pooled(engine.model, lists, body.pooling))
        vectors = await asyncio.wrap_future(future)                      # (N, dim) float32
        n = sum(len(ids) for ids in lists)
        metrics.requests.labels("embeddings", "stop").inc()
        metrics.prompt_tokens.inc(n)
        return {"object": "list", "model": model_name,
                "data": [{"object": "embedding", "index": i,
                          "embedding": encoded(v, body.encoding_format)}
                         for i, v in enumerate(vectors)],
                "usage": {"prompt_tokens": n, "total_tokens": n}}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, http: HTTPRequest):
        tools, prompt_ids = service.chat_prompt(body)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        return await service.respond(http, body, prompt_ids, True,
                                     body.max_completion_tokens or body.max_tokens, logprobs,
                                     tools)


def embedding_inputs(tokenizer, body: EmbeddingBody, context: int,
                     vocab_size: int) -> list[list[int]]:
    """The body's inputs as token-id lists (a string, strings, token ids, lists of them; no
    BOS added, as OpenAI's tokens are the text's).

    Raises:
        APIError: 400 (param "input") for an empty input, one longer than the context or a
            token id outside the vocabulary; (param "dimensions") for `dimensions`, which the
            model's hidden size fixes.
    """
    if body.dimensions is not None:
        raise APIError(400, "dimensions: this model's embeddings have its hidden size; "
                       "leave dimensions out", "dimensions")
    items = body.input
    if isinstance(items, str) or (items and isinstance(items[0], int)):
        items = [items]
    lists = [tokenizer.encode(x, bos=False) if isinstance(x, str) else list(x) for x in items]
    for i, ids in enumerate(lists):
        if not ids:
            raise APIError(400, f"input[{i}] is empty (no tokens)", "input")
        if len(ids) > context:
            raise APIError(400, f"input[{i}] has {len(ids)} tokens; the context holds "
                           f"{context}", "input")
        if min(ids) < 0 or max(ids) >= vocab_size:
            raise APIError(400, f"input[{i}]: token ids must be in [0, {vocab_size})", "input")
    if not lists:
        raise APIError(400, "input is empty", "input")
    return lists


def serve(model_path: Optional[str] = None, host: str = "127.0.0.1", port: int = 8000,
          api_key: Optional[str] = None, dtype: str = "auto", max_batch_size: int = 8,
          max_queue: int = 64, prefill_chunk: int = 512,
          prefix_cache_mb: int = DEFAULT_PREFIX_CACHE_MB, draft: Optional[str] = None,
          draft_tokens: int = DEFAULT_DRAFT_TOKENS, adapter: Optional[str] = None,
          kv_cache_dtype: str = "auto", adapters: Optional[dict[str, str]] = None) -> None:
    """Load a checkpoint (with a LoRA adapter applied unmerged for every request, named
    adapters served per request, and a draft: `torchllama.generation.speculative.make_drafter`)
    and serve it with uvicorn until interrupted (arguments: `create_app`)."""
    import uvicorn

    model, tokenizer = load_for_engine(model_path, dtype, adapter=adapter,
                                       kv_cache_dtype=kv_cache_dtype)
    drafter = _in_thread(lambda: make_drafter(draft, model_path, progress=True)) \
        if draft is not None else None
    name = Path(model_path).name if model_path else "SmolLM2-135M-Instruct"   # (trailing /)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    app = create_app(model, tokenizer, name, api_key, max_batch_size, max_queue, prefill_chunk,
                     prefix_cache_mb, draft=drafter, draft_tokens=draft_tokens,
                     adapters=adapters)
    uvicorn.run(app, host=host, port=port, log_level="warning")


def load_for_engine(model_path: Optional[str] = None, dtype: str = "float32",
                    progress: bool = True, adapter: Optional[str] = None,
                    kv_cache_dtype: str = "auto"):
    """`torchllama.load` run in a short-lived thread, for a process whose model then runs in the
    engine's thread.

    Why: each thread that runs torch's OpenMP regions keeps its own pool of worker threads. Had
    the main thread loaded the model, its idle pool and the engine thread's pool together would
    exceed the CPUs of a small machine, and libgomp then stops spin-waiting between parallel
    regions (its "throttled" spin): every region pays futex wake-ups, and batched decode steps
    were ~20% slower (measured at batch 8 on 2 cores: 76 instead of 63 ms per step). A finished
    thread's pool goes away with it.
    """
    from torchllama.checkpoint import load

    return _in_thread(lambda: load(model_path, dtype=dtype, progress=progress, adapter=adapter,
                                   kv_cache_dtype=kv_cache_dtype))


def _in_thread(fn: Callable[[], Any]) -> Any:
    """fn() run in a short-lived thread (see `load_for_engine`); its exception is re-raised."""
    import threading

    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            result["error"] = e

    thread = threading.Thread(target=run, name="torchllama-load", daemon=True)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]
