"""The HTTP server (FastAPI + uvicorn): every API's routes over one engine.

    GET  /health                 liveness
    GET  /metrics                Prometheus metrics (`torchllama.serving.metrics`)
    GET  /v1/models              the served model and its LoRA adapters
    POST /v1/completions         OpenAI's completions            `serving.api.completions`
    POST /v1/chat/completions    OpenAI's chat completions       `serving.api.chat`
    POST /v1/embeddings          OpenAI's embeddings             `serving.api.embeddings`
    POST /v1/load_lora_adapter   vLLM's runtime LoRA endpoints   `serving.api.adapters`
    POST /v1/unload_lora_adapter
    POST /v1/responses           OpenAI's Responses API          `serving.api.responses`
    GET, DELETE /v1/responses/{id}
    POST /v1/messages            Anthropic's Messages API        `serving.api.messages`
    POST /v1/messages/count_tokens
    POST /tokenize, /detokenize  vLLM's tokenizer endpoints      `serving.api.tokenization`
    GET  /tokenizer_info

Each protocol module translates its body into the one request path (`serving.api.core`: a
`Generation` run on the continuous-batching `torchllama.serving.engine.Engine`) and renders
the answer in its own format; none has a generation loop of its own. Errors use the route's
API's error body (OpenAI's `{"error": {"message", "type", "param", "code"}}`, Anthropic's under
/v1/messages): 400 for invalid fields (naming them) and prompts that do not fit, 401 without
the API key, 404 for what does not exist, 413 for a body over the size limit, 429 when the
waiting queue is full, 500 when generation fails for a request (in a stream: an error event).
A client that goes away, streaming or not, has its generation cancelled.
"""

from __future__ import annotations

import hmac
import logging
from pathlib import Path
from typing import Any, Callable, Optional

from torchllama.generation.speculative import DEFAULT_DRAFT_TOKENS, make_drafter
from torchllama.serving.adapters import Adapters
from torchllama.serving.api import (adapters as adapter_api, chat, completions, embeddings,
                                    messages, responses, tokenization)
from torchllama.serving.api.core import APIError, Service, openai_error
from torchllama.serving.engine import Engine
from torchllama.serving.metrics import ServerMetrics

log = logging.getLogger("torchllama.serving.app")

try:  # the server's own dependencies; the rest of torchllama works without them
    from fastapi import FastAPI, Request as HTTPRequest
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import Response
except ImportError as e:  # pragma: no cover - fastapi is a dependency of the package
    raise ImportError("torchllama serve needs fastapi and uvicorn: pip install fastapi uvicorn") \
        from e


#: path prefix → the error response of the API served there (OpenAI's everywhere else)
ERROR_SHAPES: list[tuple[str, Callable]] = [("/v1/messages", messages.error_response)]


def error_response(path: str, status: int, message: str, param: Optional[str] = None,
                   kind: str = "invalid_request_error", headers: Optional[dict] = None):
    """The error in the body of the API that `path` belongs to."""
    for prefix, render in ERROR_SHAPES:
        if path.startswith(prefix):
            return render(status, message, param, kind, headers)
    return openai_error(status, message, param, kind, headers)


#: the largest request body by default, MiB (`serve --max-body-mb`)
DEFAULT_MAX_BODY_MB = 8.0


class _Guard:
    """ASGI middleware: the API key and the body size limit.

    With API keys, every HTTP request but /health needs one, as `Authorization: Bearer KEY`
    (OpenAI's clients) or `x-api-key: KEY` (Anthropic's), compared in constant time
    (`hmac.compare_digest`), else 401. A body larger than `max_body` bytes is a 413 naming the
    limit, before the app reads it (by its Content-Length, or counted as a chunked body
    arrives). A plain ASGI wrapper, not Starlette's BaseHTTPMiddleware, which passes every
    streamed chunk through an extra in-memory stream (a quarter of the event loop's time with
    8 streams).
    """

    def __init__(self, app, api_keys: list[str], max_body: Optional[int]):
        self.app, self.max_body = app, max_body
        self.keys = [k.encode() for k in api_keys]

    def authorized(self, headers: dict) -> bool:
        bearer = headers.get(b"authorization", b"")
        given = [bearer[7:]] if bearer[:7].lower() == b"bearer " else []
        given += [headers[b"x-api-key"]] if b"x-api-key" in headers else []
        return any(hmac.compare_digest(g, k) for g in given for k in self.keys)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, headers = scope["path"], dict(scope["headers"])
        if self.keys and path != "/health" and not self.authorized(headers):
            response = error_response(path, 401, "invalid or missing API key (Authorization: "
                                      "Bearer KEY, or x-api-key: KEY)",
                                      kind="authentication_error")
            return await response(scope, receive, send)
        if self.max_body is not None:
            receive = await self._bounded(scope, headers, receive)
            if receive is None:
                response = error_response(
                    path, 413, f"the request body is larger than this server's limit of "
                    f"{self.max_body} bytes (serve --max-body-mb)", kind="invalid_request_error")
                return await response(scope, _nothing, send)
        await self.app(scope, receive, send)

    async def _bounded(self, scope, headers: dict, receive):
        """`receive` for a body within the limit (a chunked body read here and replayed), or
        None for one beyond it."""
        declared = headers.get(b"content-length")
        if declared is not None:
            return receive if not declared.isdigit() or int(declared) <= self.max_body \
                else None                      # (uvicorn holds a body to its length)
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return receive
        buffered, size = [], 0
        while True:
            message = await receive()
            buffered.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.max_body:
                return None
            if not message.get("more_body"):
                break

        async def replay():
            return buffered.pop(0) if buffered else await receive()
        return replay


async def _nothing():                          # (a refused body is not read)
    return {"type": "http.disconnect"}


# --------------------------------------------------------------------------------------------
# The server's own routes
# --------------------------------------------------------------------------------------------

async def health(http: HTTPRequest) -> dict:
    """GET /health: liveness (no API key needed) and the requests holding a row."""
    return {"status": "ok", "active": http.app.state.engine.active}


async def prometheus_metrics(http: HTTPRequest) -> Response:
    """GET /metrics: Prometheus' text format."""
    from prometheus_client import CONTENT_TYPE_LATEST

    return Response(http.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def models(http: HTTPRequest) -> dict:
    """GET /v1/models: the served model, then each LoRA adapter (`parent`, `root`)."""
    service: Service = http.app.state.service
    data = [{"id": service.model_name, "object": "model", "created": 0,
             "owned_by": "torchllama"}]
    data += [{"id": name, "object": "model", "created": 0, "owned_by": "torchllama",
              "root": path, "parent": service.model_name}
             for name, path in service.adapters.paths.items()]
    return {"object": "list", "data": data}


#: (method, path, handler): every route of the server.
ROUTES: list[tuple[str, str, Callable]] = [
    ("GET", "/health", health),
    ("GET", "/metrics", prometheus_metrics),
    ("GET", "/v1/models", models),
    ("POST", "/v1/completions", completions.create),
    ("POST", "/v1/chat/completions", chat.create),
    ("POST", "/v1/embeddings", embeddings.create),
    ("POST", "/v1/responses", responses.create),
    ("GET", "/v1/responses/{response_id}", responses.retrieve),
    ("DELETE", "/v1/responses/{response_id}", responses.delete),
    ("POST", "/v1/messages", messages.create),
    ("POST", "/v1/messages/count_tokens", messages.count_tokens),
    ("POST", "/v1/load_lora_adapter", adapter_api.load),
    ("POST", "/v1/unload_lora_adapter", adapter_api.unload),
    ("POST", "/tokenize", tokenization.tokenize),
    ("POST", "/detokenize", tokenization.detokenize),
    ("GET", "/tokenizer_info", tokenization.tokenizer_info),
]


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
               adapters: Optional[dict[str, str]] = None,
               responses_store: int = responses.DEFAULT_STORE_SIZE,
               max_body_mb: Optional[float] = DEFAULT_MAX_BODY_MB) -> FastAPI:
    """The FastAPI application serving `model` (engine started and stopped with the app).

    Args:
        model, tokenizer: what `torchllama.load` returns.
        model_name: the id reported by /v1/models and in responses.
        api_key: when set, requests need it (`Authorization: Bearer KEY` or `x-api-key: KEY`;
            else 401).
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
        responses_store: Responses API responses kept in memory (`store`, for
            previous_response_id and GET), least recently used out first (0: none).
        max_body_mb: the largest request body, MiB (beyond: 413; None: no limit).

    Raises:
        ModelFileError: an adapter that is not for this model.
    """
    from contextlib import asynccontextmanager

    engine = Engine(model, max_batch_size, max_queue, pad_id=tokenizer.pad_id or 0,
                    prefill_chunk=prefill_chunk, prefix_cache_bytes=prefix_cache_mb << 20,
                    draft=draft, draft_tokens=draft_tokens, kv_cache_dtype=kv_cache_dtype)
    metrics = ServerMetrics(engine)
    served = Adapters(engine, model_name)
    for name, path in (adapters or {}).items():
        served.load_now(name, path)

    @asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        engine.shutdown()

    app = FastAPI(title="torchllama", lifespan=lifespan)
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.service = Service(engine, tokenizer, metrics, model_name, served)
    app.state.responses = responses.Store(responses_store)
    _add_error_handlers(app)
    if api_key is not None or max_body_mb is not None:
        app.add_middleware(_Guard, api_keys=[api_key] if api_key is not None else [],
                           max_body=None if max_body_mb is None else int(max_body_mb * 2**20))
    for method, path, handler in ROUTES:
        app.add_api_route(path, handler, methods=[method])
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Invalid bodies and `APIError`s answered with the route's API's error body."""

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = (".".join(loc) or None) if first.get("type") != "json_invalid" else None
        return error_response(request.url.path, 400,
                              f"{param or 'body'}: {first.get('msg', 'invalid request')}", param)

    @app.exception_handler(APIError)
    async def api_error(request, exc: APIError):
        return error_response(request.url.path, exc.status, exc.message, exc.param, exc.kind)


def serve(model_path: Optional[str] = None, host: str = "127.0.0.1", port: int = 8000,
          api_key: Optional[str] = None, dtype: str = "auto", max_batch_size: int = 8,
          max_queue: int = 64, prefill_chunk: int = 512,
          prefix_cache_mb: int = DEFAULT_PREFIX_CACHE_MB, draft: Optional[str] = None,
          draft_tokens: int = DEFAULT_DRAFT_TOKENS, adapter: Optional[str] = None,
          kv_cache_dtype: str = "auto", adapters: Optional[dict[str, str]] = None,
          responses_store: int = responses.DEFAULT_STORE_SIZE,
          max_body_mb: Optional[float] = DEFAULT_MAX_BODY_MB) -> None:
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
                     adapters=adapters, responses_store=responses_store,
                     max_body_mb=max_body_mb)
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
    are slower (`torchllama bench serve` shows it). A finished thread's pool goes away with
    it.
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
