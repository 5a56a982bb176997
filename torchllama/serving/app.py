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

import logging
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Sequence, Union

from torchllama.generation.speculative import DEFAULT_DRAFT_TOKENS, make_drafter
from torchllama.serving.adapters import Adapters
from torchllama.serving.api import (adapters as adapter_api, chat, completions, embeddings,
                                    messages, responses, tokenization)
from torchllama.serving.api.core import APIError, Service, openai_error
from torchllama.serving.engine import Engine
from torchllama.serving.guard import Drain, Guard
from torchllama.serving.metrics import ServerMetrics

log = logging.getLogger("torchllama.serving.app")

try:  # the server's own dependencies; the rest of torchllama works without them
    from fastapi import FastAPI, Request as HTTPRequest
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException
    from fastapi.responses import JSONResponse, Response
    from pydantic import BaseModel
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


# --------------------------------------------------------------------------------------------
# The server's own routes
# --------------------------------------------------------------------------------------------

async def health(http: HTTPRequest):
    """GET /health (no API key needed): {"status": "ok" | "draining" | "failed", "active":
    requests holding a row, "waiting": requests queued}; 503 unless ok (a draining server
    takes no new requests; a failed engine: the process is about to exit non-zero)."""
    drain: Drain = http.app.state.drain
    engine = http.app.state.engine
    body = {"status": drain.status, "active": engine.active, "waiting": engine.waiting}
    if drain.failed:
        body["error"] = drain.failed
    return JSONResponse(body, status_code=200 if drain.status == "ok" else 503,
                        headers=None if drain.status == "ok" else
                        {"Retry-After": str(drain.retry_after)})


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


#: (method, path, handler, what it may answer besides 200 and the errors every route
#: may give): every route of the server.
ROUTES: list[tuple[str, str, Callable, tuple[int, ...]]] = [
    ("GET", "/health", health, (503,)),
    ("GET", "/metrics", prometheus_metrics, ()),
    ("GET", "/v1/models", models, ()),
    ("POST", "/v1/completions", completions.create, (400, 404, 413, 429)),
    ("POST", "/v1/chat/completions", chat.create, (400, 404, 413, 429)),
    ("POST", "/v1/embeddings", embeddings.create, (400, 404, 413, 429)),
    ("POST", "/v1/responses", responses.create, (400, 404, 413, 429)),
    ("GET", "/v1/responses/{response_id}", responses.retrieve, (404,)),
    ("DELETE", "/v1/responses/{response_id}", responses.delete, (404,)),
    ("POST", "/v1/messages", messages.create, (400, 404, 413, 429)),
    ("POST", "/v1/messages/count_tokens", messages.count_tokens, (400, 413)),
    ("POST", "/v1/load_lora_adapter", adapter_api.load, (400, 403, 413)),
    ("POST", "/v1/unload_lora_adapter", adapter_api.unload, (403, 404, 413)),
    ("POST", "/tokenize", tokenization.tokenize, (400, 413)),
    ("POST", "/detokenize", tokenization.detokenize, (400, 413)),
    ("GET", "/tokenizer_info", tokenization.tokenizer_info, ()),
]

#: routes whose answer is a stream of server-sent events when the body asks for one
STREAMING = {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"}

#: routes that take a JSON body
BODIES = {path for method, path, _, _ in ROUTES if method == "POST"}

#: routes answered in plain text
PLAIN_TEXT = {"/metrics"}


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class OpenAIError(BaseModel):
    """OpenAI's error body."""
    error: OpenAIErrorDetail


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    """Anthropic's error body (under /v1/messages)."""
    type: Literal["error"]
    error: AnthropicErrorDetail


#: what each status means, for the OpenAPI document
STATUS_TEXT = {400: "an invalid field (named in the message)", 401: "no valid API key",
               403: "not allowed on this server (runtime adapter loading off, or a path "
                    "outside --adapter-root)",
               404: "no such model, adapter or stored response", 413: "body over the limit",
               429: "the waiting queue is full (Retry-After)",
               500: "generation failed for this request (its id and the cause)",
               503: "draining or failed (Retry-After)"}


def openapi_responses(path: str, statuses: tuple[int, ...]) -> dict:
    """The OpenAPI `responses` of a route: its 200's media types and every error status it
    may answer with the error body of its API (401 where a key is asked, 503 while the
    server drains, 500 where generation may fail)."""
    model = AnthropicError if path.startswith("/v1/messages") else OpenAIError
    always = (401, 503) if path != "/health" else (503,)
    if path in BODIES:
        always += (400, 413)                  # (a body that is not JSON, or too large)
    if path in STREAMING:
        always += (500,)
    out: dict = {status: {"model": model, "description": STATUS_TEXT[status]}
                 for status in sorted(set(statuses + always))}
    if path in STREAMING:
        out[200] = {"description": "the answer, or its server-sent events (stream: true)",
                    "content": {"application/json": {},
                                "text/event-stream": {}}}
    if path in PLAIN_TEXT:
        out[200] = {"description": "Prometheus' text format",
                    "content": {"text/plain": {"schema": {"type": "string"}}}}
    return out


# --------------------------------------------------------------------------------------------
# The app
# --------------------------------------------------------------------------------------------

#: The prefix cache's default memory budget (MiB): ~11,000 tokens of SmolLM2's keys and values.
DEFAULT_PREFIX_CACHE_MB = 512


#: seconds running requests get to finish after SIGTERM/SIGINT (`serve --drain-timeout`)
DEFAULT_DRAIN_TIMEOUT = 30.0


def create_app(model, tokenizer, model_name: str = "torchllama",
               api_key: Union[None, str, Sequence[str]] = None, max_batch_size: int = 8,
               max_queue: int = 64, prefill_chunk: int = 512,
               prefix_cache_mb: int = DEFAULT_PREFIX_CACHE_MB, draft=None,
               draft_tokens: int = DEFAULT_DRAFT_TOKENS,
               kv_cache_dtype: Optional[str] = None,
               adapters: Optional[dict[str, str]] = None,
               responses_store: int = responses.DEFAULT_STORE_SIZE,
               max_body_mb: Optional[float] = DEFAULT_MAX_BODY_MB,
               allow_adapter_loading: bool = False, adapter_root: Optional[str] = None,
               drain_timeout: float = DEFAULT_DRAIN_TIMEOUT) -> FastAPI:
    """The FastAPI application serving `model` (engine started and stopped with the app).

    Args:
        model, tokenizer: what `torchllama.load` returns.
        model_name: the id reported by /v1/models and in responses.
        api_key: a key or several (`torchllama.serving.guard.api_keys`): requests need one
            (`Authorization: Bearer KEY` or `x-api-key: KEY`; else 401). None: no key.
        max_batch_size: requests decoded together.
        max_queue: requests that may wait for a free row (beyond: 429 with Retry-After).
        prefill_chunk: prompt tokens prefilled per engine iteration: longer prompts are
            prefilled in chunks while the running requests keep decoding (`Engine`).
        prefix_cache_mb: memory for the prefix cache, MiB (0: no prefix cache).
        draft, draft_tokens: a `torchllama.generation.speculative.Drafter` and the most tokens it
            drafts: speculative rounds for a lone decoding request (`Engine`).
        kv_cache_dtype: what the engine's KV cache stores (`Engine`; None: the model's
            `kv_cache_dtype`, which `torchllama.load` sets).
        adapters: LoRA adapters served by name (name → PEFT folder), loaded now.
        responses_store: Responses API responses kept in memory (`store`, for
            previous_response_id and GET), least recently used out first (0: none).
        max_body_mb: the largest request body, MiB (beyond: 413; None: no limit).
        allow_adapter_loading: whether /v1/load_lora_adapter and /v1/unload_lora_adapter
            work (else 403).
        adapter_root: the folder runtime-loaded adapters must be inside (None: any folder,
            once loading is allowed).
        drain_timeout: seconds running requests get to finish once the server drains
            (`torchllama.serving.shutdown`).

    Raises:
        ModelFileError: an adapter that is not for this model.
    """
    from contextlib import asynccontextmanager

    engine = Engine(model, max_batch_size, max_queue, pad_id=tokenizer.pad_id or 0,
                    prefill_chunk=prefill_chunk, prefix_cache_bytes=prefix_cache_mb << 20,
                    draft=draft, draft_tokens=draft_tokens, kv_cache_dtype=kv_cache_dtype)
    metrics = ServerMetrics(engine)
    served = Adapters(engine, model_name, allow_adapter_loading, adapter_root)
    for name, path in (adapters or {}).items():
        served.load_now(name, path)
    drain = Drain()
    engine.on_failure = lambda why: setattr(drain, "failed", why)

    @asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        engine.shutdown()

    app = FastAPI(title="torchllama", lifespan=lifespan, version=_version(),
                  description="OpenAI's, Anthropic's and vLLM's APIs over one torchllama model.")
    app.state.engine, app.state.metrics, app.state.drain = engine, metrics, drain
    app.state.drain_timeout = drain_timeout
    app.state.service = Service(engine, tokenizer, metrics, model_name, served)
    app.state.responses = responses.Store(responses_store)
    _add_error_handlers(app)
    keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
    app.add_middleware(Guard, api_keys=keys, drain=drain, error_response=error_response,
                       max_body=None if max_body_mb is None else int(max_body_mb * 2**20))
    for method, path, handler, statuses in ROUTES:
        app.add_api_route(path, handler, methods=[method],
                          responses=openapi_responses(path, statuses))
    app.openapi = lambda: _openapi(app)
    return app


def _openapi(app: FastAPI) -> dict:
    """FastAPI's OpenAPI document without its 422 answers (invalid bodies are 400s here,
    in the route's API's error body, as OpenAI's and Anthropic's APIs answer them)."""
    from fastapi.openapi.utils import get_openapi

    if app.openapi_schema is None:
        document = get_openapi(title=app.title, version=app.version,
                               description=app.description, routes=app.routes)
        for item in document["paths"].values():
            for operation in item.values():
                operation.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            document.get("components", {}).get("schemas", {}).pop(name, None)
        _bound_token_ids(document, app.state.service.tokenizer.vocab_size)
        app.openapi_schema = document
    return app.openapi_schema


def _bound_token_ids(node: Any, vocab_size: int) -> None:
    """Every token id of the document (`x-token-id`) below the vocabulary's size."""
    if isinstance(node, dict):
        if node.pop("x-token-id", False):
            node["maximum"] = vocab_size - 1
        for value in node.values():
            _bound_token_ids(value, vocab_size)
    elif isinstance(node, list):
        for value in node:
            _bound_token_ids(value, vocab_size)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torchllama")
    except PackageNotFoundError:               # pragma: no cover - run from a source tree
        return "0"


def _add_error_handlers(app: FastAPI) -> None:
    """Invalid bodies and `APIError`s answered with the route's API's error body."""

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ())    # (not pydantic's union-member tags,
               if p != "body" and (isinstance(p, int) or p.isidentifier())]  # "list[int]")
        param = (".".join(loc) or None) if first.get("type") != "json_invalid" else None
        return error_response(request.url.path, 400,
                              f"{param or 'body'}: {first.get('msg', 'invalid request')}", param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):   # e.g. a body not UTF-8
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(request.url.path, exc.status_code, f"{exc.detail}", kind=kind,
                              headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def internal(request, exc: Exception):    # a bug: our error body, not bare text
        log.error("%s %s failed: %s: %s", request.method, request.url.path,
                  type(exc).__name__, exc, exc_info=exc)
        return error_response(request.url.path, 500, f"internal error: {type(exc).__name__}: "
                              f"{exc}", kind="server_error")

    @app.exception_handler(APIError)
    async def api_error(request, exc: APIError):
        return error_response(request.url.path, exc.status, exc.message, exc.param, exc.kind,
                              exc.headers)


#: the environment variable that allows runtime adapter loading (as --allow-adapter-loading)
ALLOW_ADAPTER_LOADING_ENV = "TORCHLLAMA_ALLOW_ADAPTER_LOADING"


def serve(model_path: Optional[str] = None, host: str = "127.0.0.1", port: int = 8000,
          dtype: str = "auto", adapter: Optional[str] = None, kv_cache_dtype: str = "auto",
          draft: Optional[str] = None, draft_tokens: int = DEFAULT_DRAFT_TOKENS,
          **options) -> int:
    """Load a checkpoint (with a LoRA adapter applied unmerged for every request, and a
    draft: `torchllama.generation.speculative.make_drafter`) and serve it with uvicorn until
    SIGTERM or SIGINT drains it (`torchllama.serving.shutdown`). `options` are
    `create_app`'s; runtime adapter loading is also allowed by TORCHLLAMA_ALLOW_ADAPTER_LOADING
    set to 1 or true. Returns the exit status: 0 after a drain, 1 when the engine failed."""
    import os

    from torchllama.serving import shutdown

    model, tokenizer = load_for_engine(model_path, dtype, adapter=adapter,
                                       kv_cache_dtype=kv_cache_dtype)
    drafter = _in_thread(lambda: make_drafter(draft, model_path, progress=True)) \
        if draft is not None else None
    name = Path(model_path).name if model_path else "SmolLM2-135M-Instruct"   # (trailing /)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if os.environ.get(ALLOW_ADAPTER_LOADING_ENV, "").lower() in ("1", "true", "yes"):
        options["allow_adapter_loading"] = True
    app = create_app(model, tokenizer, name, draft=drafter, draft_tokens=draft_tokens,
                     **options)
    return shutdown.run(app, host, port)


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
