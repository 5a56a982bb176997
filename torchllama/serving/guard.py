"""What stands in front of every route: API keys, the body size limit, admission while draining.

    keys      `api_keys`: from --api-key-file (one per line), TORCHLLAMA_API_KEY, --api-key
    Guard     ASGI middleware: 401 without a key, 413 for a body over the limit, 503 with
              Retry-After once the server is draining (`Drain`), before any route runs
    Drain     the server's state on the way out: draining (no new requests), the engine
              failed (/health turns 503 and the process exits non-zero)

Sources: vLLM's `--api-key` / `VLLM_API_KEY` (keys), RFC 9110 §15.6.4 and §10.2.3 (503 with
Retry-After), Kubernetes' readiness probes (a draining server answers /health with 503 so
that no new traffic is routed to it).
"""

from __future__ import annotations

import hmac
import logging
import os
from pathlib import Path
from typing import Callable, Optional

from torchllama.errors import ArgumentError

log = logging.getLogger("torchllama.serving.guard")

#: the environment variable holding the server's API key
API_KEY_ENV = "TORCHLLAMA_API_KEY"

#: paths a draining server still answers: its probes
PROBES = ("/health", "/metrics")


def api_keys(api_key: Optional[str] = None, api_key_file: Optional[str] = None,
             environ: Optional[dict] = None) -> list[str]:
    """The server's API keys: each non-empty line of `api_key_file` that is not a `#` comment,
    the `TORCHLLAMA_API_KEY` environment variable, and `api_key` (which every user of the
    machine sees in `ps`: a warning says so). No key at all: the server is open.

    Raises:
        ArgumentError: the key file cannot be read or holds no key; a key with whitespace
            inside.
    """
    environ = os.environ if environ is None else environ
    keys: list[str] = []
    if api_key_file is not None:
        path = Path(api_key_file)
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise ArgumentError(f"--api-key-file {path}: cannot read it ({e})") from None
        found = [line.strip() for line in lines if line.strip() and
                 not line.lstrip().startswith("#")]
        if not found:
            raise ArgumentError(f"--api-key-file {path}: no key in it (one key per line)")
        keys += found
    if environ.get(API_KEY_ENV, "").strip():
        keys.append(environ[API_KEY_ENV].strip())
    if api_key is not None:
        log.warning("--api-key shows the key to every user of this machine (ps, /proc); "
                    "prefer --api-key-file or %s", API_KEY_ENV)
        keys.append(api_key)
    for key in keys:
        if not key or any(c.isspace() for c in key):
            raise ArgumentError("an API key must be non-empty, without whitespace")
    return list(dict.fromkeys(keys))


class Drain:
    """The server's way out (see `torchllama.serving.shutdown`).

    Attributes:
        draining: no new requests are admitted (503 with `Retry-After: retry_after`).
        failed: why the engine stopped, if it did: /health answers 503 and the server exits
            with status 1, for a supervisor to restart it.
    """

    def __init__(self, retry_after: int = 5):
        self.draining = False
        self.failed: Optional[str] = None
        self.retry_after = retry_after

    @property
    def status(self) -> str:
        """What /health says: "ok", "draining" or "failed"."""
        return "failed" if self.failed else "draining" if self.draining else "ok"


class Guard:
    """ASGI middleware: the API keys, the body size limit and admission while draining.

    With API keys, every HTTP request but /health needs one, as `Authorization: Bearer KEY`
    (OpenAI's clients) or `x-api-key: KEY` (Anthropic's), compared in constant time
    (`hmac.compare_digest`, against every key), else 401. A body larger than `max_body`
    bytes is a 413 naming the limit, before the app reads it (by its Content-Length, or
    counted as a chunked body arrives). While the server drains, or once its engine failed,
    every request but the probes (/health, /metrics) is a 503 with Retry-After. A plain ASGI
    wrapper, not Starlette's BaseHTTPMiddleware, which passes every streamed chunk through an
    extra in-memory stream.

    Args:
        app: the ASGI app.
        api_keys: the keys (empty: none needed).
        max_body: the largest body, bytes (None: no limit).
        drain: the server's `Drain`.
        error_response: (path, status, message, kind, headers) → the route's error response.
    """

    def __init__(self, app, api_keys: list[str], max_body: Optional[int], drain: Drain,
                 error_response: Callable):
        self.app, self.max_body, self.drain = app, max_body, drain
        self.keys = [k.encode() for k in api_keys]
        self.error_response = error_response

    def authorized(self, headers: dict) -> bool:
        bearer = headers.get(b"authorization", b"")
        given = [bearer[7:]] if bearer[:7].lower() == b"bearer " else []
        given += [headers[b"x-api-key"]] if b"x-api-key" in headers else []
        matches = [hmac.compare_digest(g, k) for g in given for k in self.keys]
        return any(matches)                    # (every key compared: no early exit)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, headers = scope["path"], dict(scope["headers"])
        refusal = None
        if self.keys and path != "/health" and not self.authorized(headers):
            refusal = (401, "invalid or missing API key (Authorization: Bearer KEY, or "
                            "x-api-key: KEY)", "authentication_error", None)
        elif self.drain.status != "ok" and path not in PROBES:
            why = "is shutting down" if self.drain.failed is None else \
                f"failed ({self.drain.failed}) and is about to exit"
            refusal = (503, f"the server {why}; retry on another instance or later",
                       "service_unavailable", {"Retry-After": str(self.drain.retry_after)})
        elif self.max_body is not None:
            receive = await self._bounded(scope, headers, receive)
            if receive is None:
                refusal = (413, f"the request body is larger than this server's limit of "
                                f"{self.max_body} bytes (serve --max-body-mb)",
                           "invalid_request_error", None)
        if refusal is not None:
            status, message, kind, extra = refusal
            response = self.error_response(path, status, message, kind=kind, headers=extra)
            return await response(scope, _nothing if status == 413 else receive, send)
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
